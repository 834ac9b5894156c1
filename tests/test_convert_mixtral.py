"""Hugging Face Mixtral interop: every (layer, expert) tensor has one home in our stacked experts, logits match
transformers (through `load_pretrained` and an expert-parallel Trainer), round trips are exact, and a Mixtral we
cannot reproduce is one `error: ...` line with exit code 2."""
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402  (transformers brings safetensors)
from safetensors.torch import save_file  # noqa: E402

from hf_models import TOKENS_BS, VOCAB, convert, hf_logits, hf_tensors, our_logits, save_random  # noqa: E402
from mlm_jax import Trainer, load_config  # noqa: E402
from mlm_jax.config import Config, ModelConfig, MoEConfig  # noqa: E402
from mlm_jax.checkpoint import weights as store  # noqa: E402
from mlm_jax.convert import hf as convert_hf  # noqa: E402
from mlm_jax.convert import mixtral  # noqa: E402
from mlm_jax.convert import format as hf_format  # noqa: E402
from mlm_jax.model.transformer import model_spec  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, rope_theta=1e6, rms_norm_eps=1e-5,
            tie_word_embeddings=False, sliding_window=None, router_aux_loss_coef=0.02)
SAME_CONFIG = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "rms_norm_eps", "rope_parameters", "tie_word_embeddings",
               "max_position_embeddings", "bos_token_id", "eos_token_id", "dtype", "num_local_experts",
               "num_experts_per_tok", "router_aux_loss_coef", "router_jitter_noise", "sliding_window")


def save_hf(path, dtype=torch.float32, max_shard_size="5GB", **overrides):
    """A random Mixtral, every weight perturbed (`hf_models.save_random`): a swapped expert or a transposed
    router shows."""
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**{**TINY, **overrides}))
    return save_random(model, path, dtype, max_shard_size)


def test_every_hf_tensor_is_one_slice_of_a_stacked_parameter(tmp_path):
    """The name/layout table alone: HF's per-(layer, expert) tensors and our stacked parameters pair up 1:1."""
    save_hf(tmp_path / "hf")
    source = convert_hf.read_source(str(tmp_path / "hf"))
    m = source.model
    assert (m.moe.num_experts, m.moe.top_k, m.moe.expert_ffn_size, m.moe.router, m.moe.capacity_factor,
            m.moe.aux_loss_coef) == (4, 2, 128, "softmax", None, 0.02)
    tensors = hf_format.hf_tensors(mixtral.layout(m, model_spec(m).shapes))
    with safe_open(source.files["lm_head.weight"], framework="numpy") as f:
        saved = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    assert {name: hf_format.hf_shape(e, shape) for name, e, _, shape in tensors} == saved
    by_name = {name: (e.path, index) for name, e, index, _ in tensors}
    assert by_name["model.layers.1.block_sparse_moe.experts.3.w3.weight"] == (("blocks", "moe", "experts", "up"),
                                                                               (1, 3))
    assert by_name["model.layers.0.block_sparse_moe.gate.weight"] == (("blocks", "moe", "router", "kernel"), (0,))
    assert by_name["model.embed_tokens.weight"] == (("embed", "embedding"), ())


@pytest.mark.parametrize("overrides", [
    pytest.param({}, id="top2"),
    pytest.param({"num_experts_per_tok": 1, "tie_word_embeddings": True, "head_dim": 8}, id="top1-tied-head-dim"),
    pytest.param({"sliding_window": 8}, id="sliding-window"),
])
def test_converted_mixtral_logits_match_transformers(tmp_path, overrides):
    hf = save_hf(tmp_path / "hf", max_shard_size="100KB", **overrides)  # sharded source, with an index
    convert("from-hf", tmp_path / "hf", tmp_path / "ours")
    cfg = load_config(tmp_path / "ours" / "config.yaml")
    assert cfg.model.moe.num_experts == 4 and cfg.model.moe.top_k == overrides.get("num_experts_per_tok", 2)
    assert np.abs(our_logits(tmp_path / "ours") - hf_logits(hf)).max() <= 1e-4


def test_from_hf_then_to_hf_gives_identical_mixtral_tensors(tmp_path):
    save_hf(tmp_path / "hf", dtype=torch.bfloat16)
    convert("from-hf", tmp_path / "hf", tmp_path / "ours")
    convert("to-hf", tmp_path / "ours" / "checkpoints", tmp_path / "back", "--dtype", "bfloat16",
            "--max-shard-size", "100KB")
    original, back = hf_tensors(tmp_path / "hf"), hf_tensors(tmp_path / "back")
    assert sorted(back) == sorted(original)
    assert all(back[k].dtype == original[k].dtype and torch.equal(back[k], original[k]) for k in original)
    assert (tmp_path / "back" / "model.safetensors.index.json").exists()
    before, after = (transformers.AutoConfig.from_pretrained(tmp_path / d) for d in ("hf", "back"))
    assert type(after) is transformers.MixtralConfig
    assert {k: getattr(after, k) for k in SAME_CONFIG} == {k: getattr(before, k) for k in SAME_CONFIG}


def test_converted_mixtral_starts_a_run_sharded_over_experts(tmp_path):
    """`checkpoint.init_from` reads the converted experts into a data x expert x tensor layout, unchanged."""
    hf = save_hf(tmp_path / "hf")
    convert("from-hf", tmp_path / "hf", tmp_path / "ours")
    cfg = load_config(tmp_path / "ours" / "config.yaml", [
        f"checkpoint.init_from={tmp_path / 'ours' / 'checkpoints'}", f"train.output_dir={tmp_path / 'run'}",
        "parallel.data=2", "parallel.expert=2", "parallel.tensor=2", "train.global_batch_size=8",
        "train.seq_len=32", "log.progress=never", "data.max_bytes=2000000", "model.dtype=float32"])
    trainer = Trainer(cfg)
    assert trainer.state.params["blocks"]["moe"]["experts"]["up"].sharding.spec[1] == "expert"
    assert np.abs(np.asarray(trainer.model(jnp.asarray(TOKENS_BS))) - hf_logits(hf)).max() <= 1e-4


def _config_only(tmp_path, **changes):
    """A folder with a valid Mixtral config.json, edited, and no weights (config checks come first)."""
    config = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_act": "silu",
              "max_position_embeddings": 32768, **TINY, **changes}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def _moe_checkpoint(tmp_path, **moe):
    m = ModelConfig(vocab_size=256, hidden_size=32, num_layers=2, num_heads=2, ffn_size=64,
                    moe=MoEConfig(num_experts=4, **moe))
    zeros = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), model_spec(m).shapes)
    store.save_weights(str(tmp_path / "checkpoints"), zeros, {"step": 0, "config": Config(model=m).to_dict()})
    return tmp_path / "checkpoints"


def _without(tmp_path, name):
    """A saved Mixtral whose safetensors file lacks tensor `name`."""
    save_hf(tmp_path / "hf")
    tensors = hf_tensors(tmp_path / "hf")
    del tensors[name]
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    return tmp_path / "hf"


ERRORS = {
    "top-k-above-experts": (lambda t: ["from-hf", _config_only(t, num_experts_per_tok=5), t / "o"],
                            ["num_experts_per_tok=5", "num_local_experts=4"]),
    "missing-expert": (lambda t: ["from-hf", _without(t, "model.layers.1.block_sparse_moe.experts.2.w2.weight"),
                                  t / "o"], ["model.layers.1.block_sparse_moe.experts.2.w2.weight is missing"]),
    "sigmoid-router-export": (lambda t: ["to-hf", _moe_checkpoint(t, router="sigmoid"), t / "o"],
                              ["model.moe.router=sigmoid cannot be exported"]),
    "dense-first-layer-export": (lambda t: ["to-hf", _moe_checkpoint(t, first_dense_layers=1), t / "o"],
                                 ["model.moe.first_dense_layers=1", "every layer"]),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_cli_rejects_unsupported_mixtral_with_one_line(tmp_path, case):
    make_args, expected = ERRORS[case]
    args = [str(a) for a in make_args(tmp_path)]
    result = subprocess.run([sys.executable, "-m", "mlm_jax.convert", *args], cwd=REPO, env=dict(os.environ),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert all(s in lines[0] for s in expected), lines[0]
