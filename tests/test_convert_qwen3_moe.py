"""Hugging Face Qwen3-MoE interop: a model mixing dense and MoE layers (`mlp_only_layers`, `decoder_sparse_step`)
gives transformers' logits with and without renormalised routing weights, and round trips are exact."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_models import VOCAB, assert_round_trip, convert, hf_logits, our_logits, save_random  # noqa: E402
from mlm_jax import load_config  # noqa: E402

TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
            rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False, router_aux_loss_coef=0.002)
SAME_CONFIG = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_parameters",
               "tie_word_embeddings", "num_experts", "num_experts_per_tok", "decoder_sparse_step", "mlp_only_layers",
               "norm_topk_prob", "router_aux_loss_coef", "dtype")


def save_hf(path, dtype=torch.float32, **overrides):
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{**TINY, **overrides}))
    return save_random(model, path, dtype)


@pytest.mark.parametrize("overrides, dense", [
    pytest.param({"mlp_only_layers": [1], "norm_topk_prob": False}, [1], id="mlp-only-layer"),
    pytest.param({"decoder_sparse_step": 2, "norm_topk_prob": True, "tie_word_embeddings": True}, [0, 2],
                 id="sparse-step-2-normalised-tied"),
])
def test_converted_qwen3_moe_logits_match_transformers(tmp_path, overrides, dense):
    hf = save_hf(tmp_path / "hf", **overrides)
    convert("from-hf", tmp_path / "hf", tmp_path / "ours")
    m = load_config(tmp_path / "ours" / "config.yaml").model
    assert [i for i in range(m.num_layers) if not m.moe.is_moe_layer(i)] == dense
    assert m.qk_norm and m.moe.normalize_weights == overrides["norm_topk_prob"]
    assert np.abs(our_logits(tmp_path / "ours") - hf_logits(hf)).max() <= 1e-4


def test_from_hf_then_to_hf_gives_identical_qwen3_moe_tensors(tmp_path):
    save_hf(tmp_path / "hf", dtype=torch.bfloat16, mlp_only_layers=[0, 3], decoder_sparse_step=1)
    assert_round_trip(tmp_path, transformers.Qwen3MoeConfig, SAME_CONFIG)
