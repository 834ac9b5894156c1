"""Hugging Face interop: logits match transformers, round trips are exact, trained sharded checkpoints export,
and every unsupported source is one `error: ...` line with exit code 2."""
import dataclasses
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

from hf_models import (TOKENS_BS, VOCAB, assert_round_trip, convert, hf_logits, hf_tensors, our_logits,  # noqa: E402
                       save_random)

from mlm_jax import Trainer, load_config  # noqa: E402
from mlm_jax.config import Config, ModelConfig  # noqa: E402
from mlm_jax.checkpoint import weights as store  # noqa: E402
from mlm_jax.convert import format as hf_format  # noqa: E402
from mlm_jax.model.transformer import model_spec  # noqa: E402
from mlm_jax.train.state import init_params  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rope_theta=10000, rms_norm_eps=1e-6, tie_word_embeddings=False)
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": None}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {}),
}
# Llama 3.2's RoPE, its original context shorter than the test sequence (TOKENS_BS) and the head dim's wavelengths
# spanning the low, smooth and high frequency bands.
LLAMA3 = {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}
SAME_CONFIG = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "rms_norm_eps", "rope_parameters", "tie_word_embeddings",
               "max_position_embeddings", "bos_token_id", "eos_token_id", "dtype", "sliding_window", "layer_types",
               "use_sliding_window")


def save_hf(path, family, dtype=torch.float32, max_shard_size="5GB", **overrides):
    """A random model of `family`, every weight perturbed (`hf_models.save_random`)."""
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    return save_random(model_cls(config_cls(**{**TINY, **extra, **overrides})), path, dtype, max_shard_size)


@pytest.mark.parametrize("family, overrides", [
    pytest.param("llama", {}, id="llama-gqa"),
    pytest.param("llama", {"tie_word_embeddings": True}, id="llama-tied"),
    pytest.param("qwen2", {"rope_theta": 1e6}, id="qwen2-qkv-bias"),
    pytest.param("mistral", {"head_dim": 8}, id="mistral-head-dim"),
    pytest.param("llama", {**LLAMA3, "tie_word_embeddings": True}, id="llama3.2-rope-scaling-tied"),
    pytest.param("qwen3", {"head_dim": 32, "rope_theta": 1e6}, id="qwen3-qk-norm-head-dim"),
    # windows shorter than the 24 test tokens: every layer (Mistral), the layers from max_window_layers (Qwen2)
    pytest.param("mistral", {"sliding_window": 8}, id="mistral-sliding-window"),
    pytest.param("qwen2", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1},
                 id="qwen2-sliding-window-from-layer-1"),
    pytest.param("llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}, id="llama-linear-rope"),
    pytest.param("qwen2", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8},
                           "rope_theta": 1e6}, id="qwen2-yarn-rope"),
])
def test_converted_model_logits_match_transformers(tmp_path, family, overrides):
    hf = save_hf(tmp_path / "hf", family, max_shard_size="100KB", **overrides)  # sharded source, with an index
    convert("from-hf", tmp_path / "hf", tmp_path / "ours")
    cfg = load_config(tmp_path / "ours" / "config.yaml")
    assert cfg.model.qkv_bias == (family == "qwen2") and cfg.model.qk_norm == (family == "qwen3")
    assert cfg.model.tie_embeddings == overrides.get("tie_word_embeddings", False)
    assert np.abs(our_logits(tmp_path / "ours") - hf_logits(hf)).max() <= 1e-4


@pytest.mark.parametrize("family, dtype, overrides, shard", [
    pytest.param("llama", "float32", {}, "100KB", id="llama-fp32-sharded"),
    pytest.param("qwen2", "bfloat16", {"tie_word_embeddings": True, "rope_theta": 1e6}, "2GB", id="qwen2-bf16-tied"),
    pytest.param("llama", "bfloat16", {**LLAMA3, "tie_word_embeddings": True}, "2GB", id="llama3.2-bf16-tied"),
    pytest.param("qwen3", "float32", {"head_dim": 32, "tie_word_embeddings": True}, "2GB", id="qwen3-tied"),
    pytest.param("qwen3", "float32", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1},
                 "2GB", id="qwen3-sliding-window"),
    pytest.param("mistral", "float32", {"sliding_window": 8}, "2GB", id="mistral-sliding-window"),
])
def test_from_hf_then_to_hf_gives_identical_tensors(tmp_path, family, dtype, overrides, shard):
    save_hf(tmp_path / "hf", family, dtype=getattr(torch, dtype), **overrides)
    convert("from-hf", tmp_path / "hf", tmp_path / "ours")
    convert("to-hf", tmp_path / "ours" / "checkpoints", tmp_path / "back", "--dtype", dtype, "--max-shard-size", shard)
    original, back = hf_tensors(tmp_path / "hf"), hf_tensors(tmp_path / "back")
    assert sorted(back) == sorted(original)
    assert all(back[k].dtype == original[k].dtype and torch.equal(back[k], original[k]) for k in original)
    assert (tmp_path / "back" / "model.safetensors.index.json").exists() == (shard == "100KB")
    before, after = (transformers.AutoConfig.from_pretrained(tmp_path / d) for d in ("hf", "back"))
    assert type(after) is type(before)
    assert {k: getattr(after, k, None) for k in SAME_CONFIG} == {k: getattr(before, k, None) for k in SAME_CONFIG}


def test_checkpoint_trained_under_fsdp_tp_dp_exports_to_transformers(tmp_path):
    hf = save_hf(tmp_path / "hf", "llama")
    convert("from-hf", tmp_path / "hf", tmp_path / "ours")
    run = tmp_path / "run"
    cfg = load_config(tmp_path / "ours" / "config.yaml", [
        f"checkpoint.init_from={tmp_path / 'ours' / 'checkpoints'}", f"train.output_dir={run}", "train.steps=2",
        "parallel.data=2", "parallel.fsdp=2", "parallel.tensor=2", "train.global_batch_size=8", "train.seq_len=32",
        "train.eval_every=0", "log.progress=never", "data.max_bytes=2000000", "model.dtype=float32",
        "optim.warmup_steps=0"])
    trainer = Trainer(cfg)
    start_BSV = np.asarray(trainer.model(jnp.asarray(TOKENS_BS)))
    assert np.abs(start_BSV - hf_logits(hf)).max() <= 1e-4  # init_from read the converted weights, sharded
    trainer.fit()
    convert("to-hf", run, tmp_path / "export")
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    trained_BSV = our_logits(run)
    assert np.abs(trained_BSV - start_BSV).max() > 1e-3  # the two steps changed the weights
    assert np.abs(hf_logits(exported) - trained_BSV).max() <= 1e-4


def test_checkpoint_with_fp8_delayed_histories_exports_the_same_tensors(tmp_path):
    """The histories are training state: the export of weights that carry them equals the export without."""
    plain = ModelConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=2, ffn_size=64)
    delayed = dataclasses.replace(plain, precision="fp8_delayed")
    params = init_params(delayed, 0, None)
    assert any(p[-1] == "amax_history" for p, _ in hf_format._leaves(params))
    for name, m, weights in (("plain", plain, _without_histories(params)), ("delayed", delayed, params)):
        store.save_weights(str(tmp_path / name / "checkpoints"), jax.tree.map(np.asarray, weights),
                           {"step": 0, "config": Config(model=m).to_dict()})
        convert("to-hf", tmp_path / name, tmp_path / f"{name}-hf")
    ours, theirs = hf_tensors(tmp_path / "delayed-hf"), hf_tensors(tmp_path / "plain-hf")
    assert ours.keys() == theirs.keys()
    assert all(np.array_equal(ours[k], theirs[k]) for k in ours)


def _without_histories(node: dict) -> dict:
    return {k: _without_histories(v) if isinstance(v, dict) else v for k, v in node.items() if k != "amax_history"}


def _config_only(tmp_path, **changes):
    """A folder with a valid Llama config.json, edited, and no weights (config checks come first)."""
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
              "max_position_embeddings": 2048, **TINY, **changes}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def _layernorm_checkpoint(tmp_path):
    m = ModelConfig(vocab_size=256, hidden_size=32, num_layers=1, num_heads=2, ffn_size=64, norm="layernorm")
    zeros = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), model_spec(m).shapes)
    store.save_weights(str(tmp_path / "checkpoints"), zeros, {"step": 0, "config": Config(model=m).to_dict()})
    return tmp_path / "checkpoints"


ERRORS = {
    "unknown-architecture": (lambda t: ["from-hf", _config_only(t, architectures=["GPT2LMHeadModel"]), t / "o"],
                             ["architecture 'GPT2LMHeadModel'", "LlamaForCausalLM"]),
    "rope-scaling": (lambda t: ["from-hf", _config_only(t, rope_scaling={"rope_type": "longrope", "factor": 8.0}),
                                t / "o"], ["rope_scaling 'longrope'", "llama3, yarn"]),
    "bad-layer-types": (lambda t: ["from-hf", _config_only(
        t, architectures=["Qwen2ForCausalLM"], use_sliding_window=True, sliding_window=4,
        layer_types=["sliding_attention"]), t / "o"], ["layer_types=['sliding_attention']", "num_hidden_layers="]),
    "gelu": (lambda t: ["from-hf", _config_only(t, hidden_act="gelu"), t / "o"], ["hidden_act='gelu'"]),
    "no-config-json": (lambda t: ["from-hf", t, t / "o"], ["config.json: no such file"]),
    "no-safetensors": (lambda t: ["from-hf", _config_only(t), t / "o"], ["no *.safetensors"]),
    "no-checkpoint": (lambda t: ["to-hf", t, t / "o"], ["no checkpoint there"]),
    "layernorm-export": (lambda t: ["to-hf", _layernorm_checkpoint(t), t / "o"],
                         ["model.norm=layernorm cannot be exported"]),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_cli_rejects_unsupported_input_with_one_line(tmp_path, case):
    make_args, expected = ERRORS[case]
    args = [str(a) for a in make_args(tmp_path)]
    result = subprocess.run([sys.executable, "-m", "mlm_jax.convert", *args], cwd=REPO, env=dict(os.environ),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert all(s in lines[0] for s in expected), lines[0]


GEMMA3 = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=24, sliding_window=6, rms_norm_eps=1e-6,
              layer_types=["sliding_attention", "full_attention", "sliding_attention"],
              rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})


@pytest.mark.parametrize("overrides", [
    pytest.param({}, id="gemma3-local-global-mqa"),
    pytest.param({"final_logit_softcapping": 30.0, "tie_word_embeddings": False}, id="gemma3-softcap-untied"),
])
def test_converted_gemma3_logits_match_transformers(tmp_path, overrides):
    """A window shorter than the 24 test tokens, a local and a global layer with their own RoPE, one KV head, a
    softmax scale other than head_dim^-1/2."""
    torch.manual_seed(0)
    hf = save_random(transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**{**GEMMA3, **overrides})),
                     tmp_path / "hf")
    convert("from-hf", tmp_path / "hf", tmp_path / "ours")
    m = load_config(tmp_path / "ours" / "config.yaml").model
    assert (m.post_norms, m.activation, m.sliding_window, m.local_rope_theta) == (True, "geglu", 6, 1e4)
    assert np.abs(our_logits(tmp_path / "ours") - hf_logits(hf)).max() <= 1e-4


def test_from_hf_then_to_hf_gives_identical_gemma3_tensors(tmp_path):
    torch.manual_seed(0)
    save_random(transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**GEMMA3)), tmp_path / "hf",
                torch.bfloat16)
    assert_round_trip(tmp_path, transformers.Gemma3TextConfig,
                      [*GEMMA3, "tie_word_embeddings", "final_logit_softcapping", "dtype"])
