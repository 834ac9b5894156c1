"""Hugging Face DeepSeek-V3 interop: latent attention (with and without the query latent, YaRN with its softmax
mscale), a dense first layer, sigmoid routing with the correction bias, grouped top-k, a shared expert and the
routed scaling factor give transformers' logits; round trips are exact."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_models import VOCAB, assert_round_trip, convert, hf_logits, our_logits, save_random  # noqa: E402
from mlm_jax import load_config  # noqa: E402

TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
            topk_group=2, first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5, q_lora_rank=48,
            kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, rms_norm_eps=1e-6,
            tie_word_embeddings=False, max_position_embeddings=64)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}


def save_hf(path, dtype=torch.float32, **overrides):
    """A random DeepSeek-V3, every weight perturbed and the routers' correction biases (buffers) drawn too."""
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**TINY, **overrides}))
    with torch.no_grad():
        for layer in model.model.layers[TINY["first_k_dense_replace"]:]:
            layer.mlp.gate.e_score_correction_bias.copy_(0.1 * torch.randn(TINY["n_routed_experts"]))
    return save_random(model, path, dtype)


@pytest.mark.parametrize("overrides", [
    pytest.param({}, id="mla-grouped-shared-dense-first"),
    pytest.param({"q_lora_rank": None, "rope_parameters": YARN, "norm_topk_prob": False}, id="no-q-latent-yarn"),
])
def test_converted_deepseek_v3_logits_match_transformers(tmp_path, overrides):
    hf = save_hf(tmp_path / "hf", **overrides)
    convert("from-hf", tmp_path / "hf", tmp_path / "ours")
    m = load_config(tmp_path / "ours" / "config.yaml").model
    assert (m.mla.kv_lora_rank, m.moe.num_groups, m.moe.first_dense_layers, m.moe.shared_experts) == (32, 4, 1, 1)
    assert np.abs(our_logits(tmp_path / "ours") - hf_logits(hf)).max() <= 1e-4


def test_from_hf_then_to_hf_gives_identical_deepseek_v3_tensors(tmp_path):
    save_hf(tmp_path / "hf", dtype=torch.bfloat16)
    keys = [k for k in TINY if k != "max_position_embeddings"] + ["rope_parameters", "norm_topk_prob", "dtype"]
    assert_round_trip(tmp_path, transformers.DeepseekV3Config, keys)
