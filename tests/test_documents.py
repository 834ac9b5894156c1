"""Documents that stay apart: several documents packed in a row compute what each computes alone in a row of its
own (logits, fp32, 1e-5 of their scale), and a packed batch's loss and every parameter leaf's gradient equal those of
its documents run unpacked (1e-5 / 1e-4), on one device and under every layout; the loss is a mean over the target
tokens that count, whatever the accumulation; a window of the token stream is cut into documents at its
end-of-document tokens.
"""
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention

from layouts import leaves
from mlm_jax import Trainer, load_config
from mlm_jax.config import ConfigError
from mlm_jax.data.documents import document_fields
from mlm_jax.model.attention import local_attention
from mlm_jax.model.transformer import Transformer, segment_positions
from mlm_jax.ops import packed_attention, te
from mlm_jax.validation.plan import _check_backend

S, ROWS, VOCAB = 32, 8, 128
TINY = ["model.dtype=float32", "model.vocab_size=512", "model.hidden_size=64", "model.num_heads=4",
        "model.ffn_size=128", "model.init_std=0.2"]
MODELS = {
    "llama-gqa": ["model.num_kv_heads=2"],
    "sliding-window": ["model.num_kv_heads=1", "model.sliding_window=6", "model.layer_types=[sliding_attention,"
                       "full_attention,sliding_attention,full_attention]", "model.local_rope_theta=1000.0"],
    "latent-attention": ["model.mla.kv_lora_rank=16", "model.mla.q_lora_rank=24", "model.mla.qk_nope_head_dim=16",
                         "model.mla.qk_rope_head_dim=8", "model.mla.v_head_dim=16"],
}


def split_lengths(rng, total: int, parts: int) -> list[int]:
    cuts = np.sort(rng.choice(np.arange(2, total - 1), parts - 1, replace=False))
    return np.diff(np.concatenate([[0], cuts, [total]])).tolist()


def documents(seed: int, rows: int = ROWS) -> list[list[np.ndarray]]:
    """Per row, 2 to 4 documents of random tokens filling it exactly."""
    rng = np.random.default_rng(seed)
    return [[rng.integers(0, VOCAB, n).astype(np.int32) for n in split_lengths(rng, S, int(rng.integers(2, 5)))]
            for _ in range(rows)]


def packed(rows: list[list[np.ndarray]]) -> dict[str, np.ndarray]:
    """The documents packed row by row: each document's last target (the next document's first token, or nothing)
    is masked, its positions start at 0."""
    inputs = np.stack([np.concatenate(docs) for docs in rows])
    targets = np.concatenate([inputs[:, 1:], np.zeros((len(rows), 1), np.int32)], axis=1)
    segments = np.stack([np.concatenate([np.full(len(d), i, np.int32) for i, d in enumerate(docs)]) for docs in rows])
    last = np.stack([np.concatenate([np.arange(len(d)) == len(d) - 1 for d in docs]) for docs in rows])
    return {"inputs": inputs, "targets": targets, "segment_ids": segments,
            "positions": np.asarray(segment_positions(jnp.asarray(segments))), "loss_mask": (~last).astype(np.float32)}


def unpacked(rows: list[list[np.ndarray]]) -> dict[str, np.ndarray]:
    """Each document alone in a row, padded with a segment of its own that no loss reads."""
    docs = [d for r in rows for d in r]
    out = {k: np.zeros((len(docs), S), np.float32 if k == "loss_mask" else np.int32)
           for k in ("inputs", "targets", "segment_ids", "positions", "loss_mask")}
    for i, d in enumerate(docs):
        n = len(d)
        out["inputs"][i, :n], out["targets"][i, :n - 1] = d, d[1:]
        out["segment_ids"][i, n:], out["positions"][i] = 1, np.arange(S)
        out["loss_mask"][i, :n - 1] = 1
    return out


@pytest.mark.parametrize("family", list(MODELS))
def test_a_packed_row_gives_each_document_its_own_logits(family):
    model = Transformer(load_config(None, TINY + MODELS[family]).model, rngs=nnx.Rngs(0))
    rows = documents(1, rows=3)
    batch = packed(rows)
    got = np.asarray(model(jnp.asarray(batch["inputs"]), segment_ids_BS=jnp.asarray(batch["segment_ids"])))
    for r, docs in enumerate(rows):
        start = 0
        for d in docs:
            alone = np.asarray(model(jnp.asarray(d)[None]))[0]
            scale = np.abs(alone).max()
            np.testing.assert_allclose(got[r, start:start + len(d)], alone, rtol=0, atol=1e-5 * scale)
            start += len(d)
    # the positions default to each token's place in its document: given explicitly, the same logits
    explicit = model(jnp.asarray(batch["inputs"]), jnp.asarray(batch["positions"]), jnp.asarray(batch["segment_ids"]))
    np.testing.assert_array_equal(np.asarray(explicit), got)


BASE = TINY + ["train.steps=1", "train.global_batch_size=8", f"train.seq_len={S}", "log.progress=never",
               "train.eval_every=0", "data.max_bytes=2000000", "checkpoint.save=false",
               "data.document_masking=true"]  # the embedded corpus's batches then carry segment ids
MOE = ["model.moe.num_experts=4", "model.moe.aux_loss_coef=0", "model.moe.z_loss_coef=0"]  # routing statistics
# count the padding of unpacked rows too: only the cross-entropy is the same function packed and unpacked


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Per model: one device, the documents unpacked (loss and gradients at the initial weights)."""
    cache = {}

    def get(model: tuple[str, ...]):
        if model not in cache:
            cfg = load_config(None, BASE + list(model) + [f"train.output_dir={tmp_path_factory.mktemp('ref')}",
                                                          "parallel.data=1"])
            trainer = Trainer(cfg, devices=jax.devices()[:1])
            params = jax.device_get(trainer.state.params)
            metrics, grads = trainer.gradients(params, batch=unpacked(documents(0)))
            cache[model] = params, float(metrics["loss"]), leaves(grads)
        return cache[model]
    return get


@pytest.mark.parametrize("model, layout, num_devices", [
    pytest.param(MODELS["llama-gqa"], ["parallel.data=1"], 1, id="one-device"),
    pytest.param(MODELS["llama-gqa"], ["parallel.data=1", "train.num_microbatches=4"], 1, id="accumulation"),
    pytest.param(MODELS["llama-gqa"], ["parallel.data=2", "parallel.fsdp=2", "parallel.tensor=2",
                                       "parallel.sequence_parallel=true"], 8, id="data2-fsdp2-tensor2-sp"),
    pytest.param(MODELS["llama-gqa"], ["parallel.data=2", "parallel.context=2", "parallel.tensor=2"], 8,
                 id="context2-allgather"),
    pytest.param(MODELS["llama-gqa"], ["parallel.data=4", "parallel.context=2", "parallel.context_strategy=ring"], 8,
                 id="context2-ring"),
    pytest.param(MODELS["llama-gqa"], ["parallel.stage=2", "parallel.virtual_stages=2", "parallel.data=2",
                                       "parallel.tensor=2", "train.num_microbatches=4"], 8, id="stage2-virtual2-1f1b"),
    pytest.param(MODELS["llama-gqa"], ["parallel.stage=2", "parallel.virtual_stages=2", "parallel.data=2",
                                       "parallel.tensor=2", "parallel.pipeline_schedule=zb1",
                                       "train.num_microbatches=4"], 8,
                 id="stage2-virtual2-zb1"),
    pytest.param(MOE, ["parallel.expert=2", "parallel.data=4"], 8, id="moe-expert2"),
    pytest.param(MODELS["sliding-window"], ["parallel.data=4", "parallel.tensor=2", "model.scan_layers=false",
                                            "train.num_microbatches=2"], 8, id="sliding-window-tensor2-unrolled"),
    pytest.param(MODELS["latent-attention"], ["parallel.data=2", "parallel.fsdp=4"], 8, id="latent-fsdp4"),
])
def test_packed_documents_train_as_they_do_unpacked(model, layout, num_devices, reference, tmp_path):
    params, want_loss, want = reference(tuple(model))
    cfg = load_config(None, BASE + model + layout + [f"train.output_dir={tmp_path}"])
    metrics, grads = Trainer(cfg, devices=jax.devices()[:num_devices]).gradients(params, batch=packed(documents(0)))
    np.testing.assert_allclose(float(metrics["loss"]), want_loss, rtol=1e-5)
    got = leaves(grads)
    assert got.keys() == want.keys()
    for path, g in want.items():
        error = np.linalg.norm(got[path] - g)
        assert error <= 1e-4 * np.linalg.norm(g), f"{path}: relative error {error / np.linalg.norm(g):.2e}"


def test_masked_targets_change_neither_loss_nor_gradients(reference, tmp_path):
    """A target the loss mask drops may be any token: the function does not read it."""
    params, want_loss, want = reference(tuple(MODELS["llama-gqa"]))
    batch = unpacked(documents(0))
    batch["targets"] = np.where(batch["loss_mask"] > 0, batch["targets"], (batch["targets"] + 7) % VOCAB)
    cfg = load_config(None, BASE + MODELS["llama-gqa"] + ["parallel.data=1", f"train.output_dir={tmp_path}"])
    metrics, grads = Trainer(cfg, devices=jax.devices()[:1]).gradients(params, batch=batch)
    assert float(metrics["loss"]) == want_loss
    for path, g in leaves(grads).items():
        np.testing.assert_array_equal(g, want[path])


def test_a_window_is_cut_into_documents_at_its_end_of_document_tokens():
    eod = 9
    inputs = np.array([[1, 2, eod, 3, 4, 5, eod, eod, 6]], np.int32)
    got = document_fields(inputs, eod)
    np.testing.assert_array_equal(got["segment_ids"], [[0, 0, 0, 1, 1, 1, 1, 2, 3]])
    np.testing.assert_array_equal(got["positions"], [[0, 1, 2, 0, 1, 2, 3, 0, 0]])
    np.testing.assert_array_equal(got["loss_mask"], [[1, 1, 0, 1, 1, 1, 0, 0, 1]])


def test_a_kernel_that_cannot_keep_segments_apart_refuses_them():
    q = jnp.zeros((1, 4, 2, 8))
    with pytest.raises(ValueError, match="keeps no segments apart"):
        local_attention(q, q, q, impl="te", segment_ids=jnp.zeros((1, 4), jnp.int32))


def test_the_packed_layout_lists_each_rows_runs_of_equal_ids():
    ids = np.array([[0, 0, 1, 1, 1, 2, 2, 5], [3, 3, 3, 3, 3, 3, 3, 3], [0, 1, 2, 3, 4, 5, 6, 7]], np.int32)
    lengths, offsets, count = packed_attention.segment_layout(jnp.asarray(ids), max_segments=4)
    np.testing.assert_array_equal(lengths, [[2, 3, 2, 1], [8, -1, -1, -1], [1, 1, 1, 1]])
    np.testing.assert_array_equal(offsets, [[0, 2, 5, 7, -1], [0, -1, -1, -1, -1], [0, 1, 2, 3, 4]])
    np.testing.assert_array_equal(count, [4, 1, 8])  # the last row overflows: its step runs the masked kernel


def test_the_private_cudnn_entry_point_still_takes_the_packed_layout():
    params = inspect.signature(cudnn_attention.dot_product_attention).parameters
    assert set(packed_attention.SIGNATURE) <= set(params)
    assert cudnn_attention.MaskType.PADDING_CAUSAL


@pytest.mark.parametrize("capability, context, bound, packed", [
    ("9.0", 1, "null", 2048 // 64), ("9.0", 1, "12", 12), ("9.0", 1, "0", 0), ("8.0", 1, "null", 0),
    ("9.0", 2, "null", 0)])
def test_hopper_gpus_keep_documents_apart_through_the_packed_layout(capability, context, bound, packed):
    cfg = load_config(None, ["model.dtype=bfloat16", "train.seq_len=2048", f"model.max_segments_per_row={bound}"])
    degrees = {"data": 1, "fsdp": 1, "stage": 1, "context": context, "expert": 1, "tensor": 1}
    kernels, attn, _ = _check_backend(cfg, degrees, "gpu", "NVIDIA H200", capability)
    assert kernels.attention == "cudnn" and kernels.packed_segments == packed
    assert ("packed layout" in attn) == bool(packed)


@pytest.mark.parametrize("overrides, masks", [
    ([], False), (["data.paths=[some/dir]"], True), (["data.packing=true"], True),
    (["data.document_masking=true"], True), (["data.paths=[some/dir]", "data.document_masking=false"], False)])
def test_documents_are_kept_apart_by_default_in_prepared_and_packed_data_only(overrides, masks):
    assert load_config(None, overrides).data.masks_documents is masks


def test_documents_kept_apart_by_default_refuse_a_kernel_that_cannot(monkeypatch):
    monkeypatch.setattr(te, "missing", lambda: None)  # as if Transformer Engine imported
    cfg = load_config(None, ["model.dtype=bfloat16", "model.attention_impl=te", "data.paths=[some/dir]"])
    degrees = {"data": 1, "fsdp": 1, "stage": 1, "context": 1, "expert": 1, "tensor": 1}
    with pytest.raises(ConfigError, match=r"^data\.document_masking=null \(on for prepared directories\) with "
                                          r"model\.attention_impl=te: .* data\.document_masking=false"):
        _check_backend(cfg, degrees, "gpu", "NVIDIA H200", "9.0")
