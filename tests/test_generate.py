"""Generation: greedy decoding equals transformers' greedy `generate` for every family the converter imports, on
one device and split over 2 tensor ranks; each decode step's logits equal the model's on the whole sequence so far
(fp32, 1e-5); sampling is reproducible and honours top-k, top-p and stop tokens; lengths share compiled programs;
bad input is one line."""
import functools
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from families import FAMILIES  # noqa: E402
from hf_models import VOCAB, convert, save_random  # noqa: E402

import mlm_jax  # noqa: E402
from mlm_jax import Trainer, load_config, load_pretrained  # noqa: E402
from mlm_jax.generate import main as generate_main  # noqa: E402
from mlm_jax.infer import decode as dec  # noqa: E402
from mlm_jax.infer.generate import _generate  # noqa: E402
from mlm_jax.infer.pretrained import load_tokenizer  # noqa: E402
from mlm_jax.model.kernels import Kernels  # noqa: E402
from mlm_jax.model.transformer import Transformer  # noqa: E402
from mlm_jax.ops import flash_decode, gemv  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
NEW = 32  # new tokens per prompt
PROMPTS = [list(np.random.default_rng(s).integers(0, VOCAB, n)) for s, n in ((1, 5), (2, 11), (3, 20))]
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=128)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 500000.0}
# Each family with what it switches on; windows and original RoPE contexts shorter than prompt + new tokens.
HF_FAMILIES = {
    "llama3": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **{**BASE, "tie_word_embeddings": True}, rope_parameters=LLAMA3_ROPE)),
    "mistral-window": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**BASE, sliding_window=8)),
    "qwen2-window": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        **BASE, use_sliding_window=True, sliding_window=6, max_window_layers=1)),
    "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**BASE, head_dim=32)),
    "qwen3-moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **{**BASE, "num_hidden_layers": 3}, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        mlp_only_layers=[1], norm_topk_prob=False)),
    "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **BASE, num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    "gemma3": lambda: transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        **{**BASE, "num_hidden_layers": 3, "num_key_value_heads": 1}, head_dim=32, query_pre_attn_scalar=24,
        sliding_window=6, final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    "deepseek-v3": lambda: transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        **{**BASE, "num_hidden_layers": 3, "num_key_value_heads": 4}, moe_intermediate_size=32, n_routed_experts=8,
        num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1, n_shared_experts=1,
        routed_scaling_factor=2.5, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=12)),
}
CLOSE = 1e-4  # a top-2 logit margin below this is a tie that rounding may break either way


def hf_greedy(model, prompt: list[int]) -> tuple[list[int], int]:
    """transformers' greedy continuation of `prompt` (never stopping early) and the number of its leading steps
    whose top-2 logit margin is at least CLOSE (the steps that rounding cannot flip)."""
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    margins = [float(np.diff(np.sort(step[0].float().numpy())[-2:])[0]) for step in out.logits]
    decided = next((t for t, m in enumerate(margins) if m < CLOSE), len(margins))
    return tokens, decided


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Per family: the transformers model and its converted checkpoint."""
    out = {}

    def get(family):
        if family not in out:
            root = tmp_path_factory.mktemp(family)
            torch.manual_seed(0)
            hf = save_random(HF_FAMILIES[family](), root / "hf")
            convert("from-hf", root / "hf", root / "ours")
            out[family] = hf, root / "ours"
        return out[family]
    return get


@pytest.mark.parametrize("tensor", [1, 2], ids=["one-device", "tensor2"])
@pytest.mark.parametrize("family", list(HF_FAMILIES))
def test_greedy_generation_matches_transformers(family, tensor, folders):
    """A batch of prompts of different lengths in one call, compared with transformers prompt by prompt up to the
    first near-tie of its logits (how many prompts end early is printed)."""
    hf, ours = folders(family)
    got = mlm_jax.generate(load_pretrained(ours, dtype="float32", tensor=tensor), PROMPTS, max_new_tokens=NEW)
    assert [len(g) for g in got] == [NEW] * len(PROMPTS)
    for prompt, mine in zip(PROMPTS, got):
        theirs, decided = hf_greedy(hf, prompt)
        if decided < NEW:
            print(f"{family}: prompt of {len(prompt)} compared over {decided} of {NEW} steps (a near-tie after)")
        assert decided >= NEW // 2, (family, decided)
        assert mine[:decided] == theirs[:decided], (family, len(prompt))


DECODE_FAMILIES = {**FAMILIES, "llama": ["model.num_kv_heads=2", "model.num_layers=2"]}


def _model(family: str) -> Transformer:
    overrides = DECODE_FAMILIES[family] + ["model.dtype=float32", "model.init_std=0.2"]  # logits far from uniform
    return Transformer(load_config(None, overrides).model, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("family, few_rows", [("gemma3", False), ("deepseek-v3", False),
                                               ("llama3-qwen3-window", False), ("qwen3-moe", False),
                                               ("gemma3", True), ("deepseek-v3", True), ("llama", True)])
def test_each_decode_step_equals_the_whole_sequence(family, few_rows, monkeypatch):
    """Prompts of 3, 9 and 17 tokens, then 24 known tokens fed one step at a time: every step's logits equal those
    of the model run on the whole sequence, within 1e-5 of their scale (windows of 8 and 16: the ring caches
    wrap). `few_rows`: the few-row Pallas kernels (interpreted) that generation installs on a GPU: the output
    projections of decode steps (latent attention's too), and the attention over the cache where it takes the
    shapes (Gemma 3's global layer: its local layers' 8-slot rings are shorter than a block; every layer of a plain
    Llama, whose folded norm's row scale goes into that kernel), a Llama's residual adds with the next norm's
    factor (`gemv.add_residual`), which sum the partial products of its output and down projections, and the
    gated MLPs' fused gate/up products with their activation (`gemv.gated`), which finish that factor."""
    calls, matmul = [], gemv.matmul
    monkeypatch.setattr(gemv, "matmul", lambda *a, **k: calls.append(1) or matmul(*a, **k))
    monkeypatch.setattr(gemv, "SPLIT", (32, 64, 4))  # blocks that divide the llama's FFN of 384 and model dim of 128
    monkeypatch.setattr(flash_decode, "PRODUCT_BLOCKS", (32, 64, 4))
    monkeypatch.setattr(gemv, "GATED", (32, 64, 4, 3))  # 4 steps a program, 6 column blocks
    attends, residuals, gated = [], [], []
    kernels = Kernels(few_rows=functools.partial(gemv.einsum, interpret=True),
                      cached_attention=lambda *a, **k: attends.append(1) or flash_decode.step(*a, **k, interpret=True),
                      residual=lambda *a, **k: residuals.append(1) or gemv.add_residual(*a, **k, interpret=True),
                      gated=lambda *a: _counted(gated, gemv.gated(*a, interpret=True)))
    _decode_steps_equal_the_whole_sequence(family, kernels if few_rows else Kernels())
    layers = load_config(None, DECODE_FAMILIES[family]).model.num_layers
    # each layer in the one trace of a decode step: its output projection, and a Llama's fused q/k/v product and
    # down projection (partials for the residual add)
    assert len(calls) == (layers * (3 if family == "llama" else 1) if few_rows else 0)
    assert len(attends) == {"gemma3": 1, "llama": layers}.get(family, 0) * few_rows
    assert len(residuals) == {"llama": 2 * layers}.get(family, 0) * few_rows  # folded blocks with no post-norms
    assert len(gated) == {"gemma3": layers, "llama": layers}.get(family, 0) * few_rows  # fused gate/up products
    # (the prompts' 96 rows go to XLA)


@pytest.mark.parametrize("family", ["gemma3", "llama3-qwen3-window"])  # norm scales around 0 (offset 1) and 1
def test_folded_norms_leave_each_block_the_same_function(family):
    """The layers generation runs (`layer_states`: the pre-norms' gains folded into the next weights, the norm
    scales set to the identity, q/k/v and gate/up each one product) compute what the trained layers compute,
    through the training forward."""
    model = _model(family)
    x_BSD = jax.random.normal(jax.random.key(0), (2, 5, model.blocks.attn.c.dim))
    positions_BS = jnp.broadcast_to(jnp.arange(5), (2, 5))
    nnx.update(model, jax.tree.map(lambda w: w + 0.3, nnx.state(model, nnx.Param)))  # gains away from 1
    (stack, local), start, _ = model.runs[0]
    stacked = nnx.state(getattr(model, stack))
    plain = nnx.merge(nnx.graphdef(getattr(model, stack)), jax.tree.map(lambda w: w[start], stacked))
    folded = dec.layer(model, stack, start)
    assert folded.foldable and hasattr(folded.attn, "qkv") and hasattr(folded.mlp, "gate_up")
    np.testing.assert_array_equal(folded.mlp_norm.gain(), np.ones(model.blocks.attn.c.dim))
    want, _ = plain(x_BSD, positions_BS, local)
    got, _ = folded(x_BSD, positions_BS, local)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * float(jnp.abs(want).max()))


def _counted(calls: list, out):
    """`out`, counted in `calls` unless None (a kernel that left the product to XLA)."""
    if out is not None:
        calls.append(1)
    return out


def _decode_steps_equal_the_whole_sequence(family, kernels):
    model = _model(family)
    rng = np.random.default_rng(0)
    lengths, steps = np.array([3, 9, 17]), 24
    seq = rng.integers(0, 512, (3, 17 + steps)).astype(np.int32)
    full = np.asarray(model(jnp.asarray(seq)))
    prompt = np.where(np.arange(32) < lengths[:, None], seq[:, :32], 0)  # right-padded to a bucket
    graphdef, state = nnx.split(model)
    def run(step, state, *args):
        model = nnx.merge(graphdef, state)
        return step(model, *args, dec.layer_states(model), kernels)
    prefill = jax.jit(lambda state, t, n: run(dec.prefill, state, t, n, 64))
    decode = jax.jit(lambda state, t, p, c: run(dec.decode, state, t, p, c))
    logits, cache = prefill(state, jnp.asarray(prompt), jnp.asarray(lengths))
    rows, scale = np.arange(3), np.abs(full).max()  # within 1e-5 of the logits' scale

    def assert_close(got, want, step):
        error = np.abs(np.asarray(got) - want).max()
        assert error <= 1e-5 * scale, f"step {step}: {error:.2e} against logits up to {scale:.2f}"

    assert_close(logits, full[rows, lengths - 1], "prefill")
    for t in range(steps - 1):
        pos = lengths + t
        logits, cache = decode(state, jnp.asarray(seq[rows, pos][:, None]), jnp.asarray(pos[:, None]), cache)
        assert_close(logits[:, 0], full[rows, pos], t)


@pytest.fixture(scope="module")
def tiny():
    return _model("llama3-qwen3-window")


def test_sampling_is_reproducible_and_its_filters_narrow_it(tiny):
    prompts = [p[:6] for p in PROMPTS]
    greedy = mlm_jax.generate(tiny, prompts, max_new_tokens=8)
    sampled = mlm_jax.generate(tiny, prompts, max_new_tokens=8, temperature=1.0, seed=3)
    assert sampled == mlm_jax.generate(tiny, prompts, max_new_tokens=8, temperature=1.0, seed=3)
    assert sampled != mlm_jax.generate(tiny, prompts, max_new_tokens=8, temperature=1.0, seed=4)
    assert sampled != greedy
    assert mlm_jax.generate(tiny, prompts, max_new_tokens=8, temperature=2.0, top_k=1, seed=5) == greedy
    assert mlm_jax.generate(tiny, prompts, max_new_tokens=8, temperature=2.0, top_p=1e-6, seed=5) == greedy


def test_stop_tokens_end_each_row_where_it_produces_one(tiny):
    greedy = mlm_jax.generate(tiny, PROMPTS, max_new_tokens=12)
    stop = greedy[1][4]
    got = mlm_jax.generate(tiny, PROMPTS, max_new_tokens=12, stop_tokens=[stop])
    for row, full in zip(got, greedy):
        end = full.index(stop) + 1 if stop in full else len(full)
        assert row == full[:end]


def test_lengths_within_a_bucket_share_one_compiled_program(tiny):
    mlm_jax.generate(tiny, [[1, 2, 3], [4, 5]], max_new_tokens=5)
    compiled = _generate._cache_size()
    mlm_jax.generate(tiny, [[1, 2, 3, 4, 5, 6, 7], [8]], max_new_tokens=9)
    mlm_jax.generate(tiny, [[9] * 12, [1, 2, 3, 4]], max_new_tokens=3, stop_tokens=[7])
    assert _generate._cache_size() == compiled


def test_trainer_generates_under_its_layout(tmp_path):
    """An MoE model trained under data x tensor parallelism generates as its weights do on one device."""
    cfg = load_config(None, FAMILIES["qwen3-moe"] + ["model.dtype=float32", "parallel.data=2", "parallel.tensor=2",
                                                     "train.steps=1", f"train.output_dir={tmp_path}",
                                                     "log.progress=never", "train.eval_every=0"])
    trainer = Trainer(cfg, devices=jax.devices()[:4])
    trainer.fit()
    one_device = nnx.merge(trainer.spec.graphdef, jax.device_get(trainer.state.params))
    want = mlm_jax.generate(one_device, PROMPTS, max_new_tokens=8)
    assert trainer.generate(PROMPTS, max_new_tokens=8) == want


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompts=[]), "expected at least one prompt"),
    (dict(prompts=[[1, 2], []]), r"prompts\[1\] is empty"),
    (dict(prompts=[[1, 600]]), r"prompts\[0\] holds token 600, outside the model's vocabulary of 512"),
    (dict(max_new_tokens=0), "max_new_tokens=0: expected an integer >= 1"),
    (dict(temperature=-1.0), "temperature=-1.0"),
    (dict(top_k=0), "top_k=0"),
    (dict(top_p=0.0), r"top_p=0.0: expected a probability in \(0, 1\]"),
    (dict(stop_tokens=[512]), "stop_tokens holds 512"),
])
def test_bad_arguments_are_one_line_errors(tiny, kwargs, message):
    args = {"prompts": [[1, 2, 3]], "max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=message) as e:
        mlm_jax.generate(tiny, **args)
    assert "\n" not in str(e.value)


@pytest.fixture(scope="module")
def with_tokenizer(tmp_path_factory):
    """A converted model with the tokenizer `convert from-hf` keeps beside it."""
    from eval_models import save_family
    return save_family(tmp_path_factory.mktemp("cli"), "llama")[1]


def test_cli_streams_what_generate_returns(with_tokenizer):
    path = with_tokenizer
    proc = subprocess.run([sys.executable, "-m", "mlm_jax.generate", str(path), "--prompt", "The cat",
                           "--max-new-tokens", "12"], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    info = load_tokenizer(path)
    prompt = info.tokenizer.encode("The cat", add_special_tokens=True).tolist()
    new = mlm_jax.generate(load_pretrained(path), [prompt], max_new_tokens=12, stop_tokens=info.eos_ids)[0]
    assert proc.stdout == "The cat" + info.tokenizer.decode(new, skip_special_tokens=True) + "\n"


def test_cli_refuses_bad_input_in_one_line(with_tokenizer, tmp_path, capsys):
    from tokenizers import Tokenizer, models
    big = Tokenizer(models.WordLevel({f"w{i}": i for i in range(1000)}, unk_token="w0"))
    big.save(str(tmp_path / "tokenizer.json"))
    cases = [
        (["--prompt", ""], "--prompt is empty"),
        (["--prompt", "word " * 60], "and the model's context is 48"),
        (["--prompt", "hi", "--tokenizer", str(tmp_path / "tokenizer.json")],
         "has 1000 ids, more than the checkpoint's model.vocab_size="),
        (["--prompt", "hi", "--top-k", "0"], "top_k=0"),
        (["--prompt", "hi", "--max-new-tokens", "x"], "invalid int value: 'x'"),
    ]
    for args, message in cases:
        assert generate_main([str(with_tokenizer), *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1, (args, err)
    assert generate_main([str(tmp_path / "none"), "--prompt", "hi"]) == 2
    assert "no checkpoint there" in capsys.readouterr().err
