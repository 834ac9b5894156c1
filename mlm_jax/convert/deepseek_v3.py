"""DeepSeek-V3 in Hugging Face terms (`DeepseekV3ForCausalLM`): latent attention with a mixture of experts.

Its own entries on the shared machinery of `format`. Multi-head latent attention is
`model.mla` (`model.mla`); HF lays each RoPE part out as interleaved pairs (`rope_interleave`), ours pairs dims
(i, i + E/2), so the RoPE columns of `q_b_proj` (or `q_proj`) and `kv_a_proj_with_mqa` are permuted on the way in
and back (`Entry.rope_tail`): the same function, exact round trips. The first `first_k_dense_replace` layers keep a
dense MLP (`intermediate_size`); the others route with sigmoid scores plus `e_score_correction_bias` (our router
bias), grouped top-k (`n_group`, `topk_group`), `norm_topk_prob` and `routed_scaling_factor`, beside
`n_shared_experts` always-on experts. The softmax scale takes YaRN's mscale^2 when `mscale_all_dim` is set.
Multi-token prediction layers (`num_nextn_predict_layers`, stored as layers past `num_hidden_layers`) are not
imported.
"""
from __future__ import annotations

import math
import re

from mlm_jax.config import MLAConfig, ModelConfig, MoEConfig
from mlm_jax.convert import ConvertError, format

ARCHITECTURE = "DeepseekV3ForCausalLM"
_layer = format.per_layer


def _entries(m: ModelConfig) -> tuple[format.Entry, ...]:
    e = m.mla.qk_rope_head_dim

    def attn(path, name, *rest, rope=False):
        return _layer(f"attn/{path}", f"self_attn.{name}", *rest)._replace(rope_tail=e if rope else 0)

    def moe(path, name, kind="linear"):
        return format.Entry(("blocks", "moe", *path.split("/")), f"model.layers.{{i}}.mlp.{name}", kind)

    return (
        format.Entry(("embed", "embedding"), "model.embed_tokens.weight"),
        _layer("attn_norm/scale", "input_layernorm.weight"),
        attn("q/kernel", "q_proj.weight", "linear", rope=True),
        attn("q_a/kernel", "q_a_proj.weight", "linear"),
        attn("q_a_norm/scale", "q_a_layernorm.weight"),
        attn("q_b/kernel", "q_b_proj.weight", "linear", rope=True),
        attn("kv_a/kernel", "kv_a_proj_with_mqa.weight", "linear", rope=True),
        attn("kv_a_norm/scale", "kv_a_layernorm.weight"),
        attn("kv_b/kernel", "kv_b_proj.weight", "linear"),
        attn("o/kernel", "o_proj.weight", "linear", 2),
        _layer("mlp_norm/scale", "post_attention_layernorm.weight"),
        _layer("mlp/gate/kernel", "mlp.gate_proj.weight", "linear"),
        _layer("mlp/up/kernel", "mlp.up_proj.weight", "linear"),
        _layer("mlp/down/kernel", "mlp.down_proj.weight", "linear"),
        moe("router/kernel", "gate.weight"),
        moe("router/bias", "gate.e_score_correction_bias", "same"),
        moe("experts/gate", "experts.{j}.gate_proj.weight"),
        moe("experts/up", "experts.{j}.up_proj.weight"),
        moe("experts/down", "experts.{j}.down_proj.weight"),
        moe("shared/gate/kernel", "shared_experts.gate_proj.weight"),
        moe("shared/up/kernel", "shared_experts.up_proj.weight"),
        moe("shared/down/kernel", "shared_experts.down_proj.weight"),
        format.Entry(("final_norm", "scale"), "model.norm.weight"),
        format.Entry(("head", "kernel"), "lm_head.weight", "linear"),
    )


def _yarn_mscale(scale: float, mscale: float) -> float:
    """YaRN's attention-temperature factor (the one `model.rope` applies; here without importing jax)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def layout(m: ModelConfig, shapes: dict) -> list[tuple[format.Entry, tuple[int, ...]]]:
    return format.layout(m, shapes, _entries(m), "DeepSeek-V3")


def ignored(m: ModelConfig, name: str) -> bool:
    """The multi-token prediction layers, stored after the model's own."""
    layer = re.match(r"model\.layers\.(\d+)\.", name)
    return layer is not None and int(layer.group(1)) >= m.num_layers


def model_config(hf: dict) -> ModelConfig:
    """Our model section for a DeepSeek-V3 `config.json`; what we would compute differently is refused."""
    keys = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
            "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    missing = [k for k in keys if hf.get(k) is None]
    if missing:
        raise ConvertError(f"config.json lacks {', '.join(missing)}")
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ConvertError(f"hidden_act={hf['hidden_act']!r} is not supported (only silu, i.e. SwiGLU)")
    if hf.get("attention_bias"):
        raise ConvertError("attention_bias=true is not supported")
    if not hf.get("rope_interleave", True):
        raise ConvertError("rope_interleave=false is not supported (DeepSeek-V3 checkpoints interleave)")
    for key, allowed in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if hf.get(key, allowed) != allowed:
            raise ConvertError(f"{key}={hf[key]!r} is not supported ({allowed} only)")
    experts = hf.get("n_routed_experts", hf.get("num_local_experts"))
    heads = hf["num_attention_heads"]
    if (hf.get("num_key_value_heads") or heads) != heads:
        raise ConvertError(f"num_key_value_heads={hf['num_key_value_heads']} differs from num_attention_heads="
                           f"{heads} (latent attention expands keys and values to every head)")
    rotary = format.rope({**hf, "partial_rotary_factor": None})
    rope_params = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    qk = hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"]
    scale = None
    if rope_params.get("rope_type", rope_params.get("type", "default")) != "default" and rope_params.get(
            "mscale_all_dim"):
        scale = qk ** -0.5 * _yarn_mscale(rotary["rope_scaling"].factor, rope_params["mscale_all_dim"]) ** 2
    moe = MoEConfig(num_experts=experts, top_k=hf.get("num_experts_per_tok", 8),
                    expert_ffn_size=hf["moe_intermediate_size"], capacity_factor=None, router="sigmoid",
                    router_bias_update=0.001, aux_loss_coef=0.0001, z_loss_coef=0.0,
                    shared_experts=hf.get("n_shared_experts") or 0, every_n_layers=hf.get("moe_layer_freq", 1),
                    first_dense_layers=hf.get("first_k_dense_replace", 0),
                    normalize_weights=bool(hf.get("norm_topk_prob", True)), num_groups=hf.get("n_group") or 1,
                    top_groups=hf.get("topk_group") or 1,
                    routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)))
    mla = MLAConfig(kv_lora_rank=hf["kv_lora_rank"], q_lora_rank=hf.get("q_lora_rank"),
                    qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
                    v_head_dim=hf["v_head_dim"])
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
        num_heads=heads, ffn_size=hf["intermediate_size"], norm="rmsnorm",
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), activation="swiglu",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), attention_scale=scale, moe=moe, mla=mla,
        **{**rotary, "partial_rotary_factor": 1.0})


def hf_config(m: ModelConfig, dtype: str, carried: dict) -> dict:
    """`config.json` (DeepseekV3ForCausalLM) for `m`, which must have DeepSeek-V3's shape."""
    moe, a = m.moe, m.mla
    dense_prefix = all(moe.is_moe_layer(i) == (i >= moe.first_dense_layers) for i in range(m.num_layers))
    for unsupported, what in ((moe.router != "sigmoid", f"model.moe.router={moe.router}"),
                              (not dense_prefix, "dense layers other than the first ones"),
                              (m.qk_norm or m.qkv_bias, "QK-norm or q/k/v biases"),
                              (m.norm != "rmsnorm" or m.activation != "swiglu", "a norm or FFN other than RMSNorm "
                                                                                "and SwiGLU")):
        if unsupported:
            raise ConvertError(f"{what} cannot be exported as DeepSeek-V3")
    scaling = format.hf_rope(m)
    config = {
        "architectures": [ARCHITECTURE], "model_type": "deepseek_v3", "vocab_size": m.vocab_size,
        "hidden_size": m.hidden_size, "intermediate_size": m.ffn_size, "moe_intermediate_size": m.expert_ffn,
        "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_heads,
        "n_routed_experts": moe.num_experts, "num_experts_per_tok": moe.top_k, "n_shared_experts": moe.shared_experts,
        "n_group": moe.num_groups, "topk_group": moe.top_groups, "routed_scaling_factor": moe.routed_scaling_factor,
        "norm_topk_prob": moe.normalize_weights, "first_k_dense_replace": moe.first_dense_layers,
        "kv_lora_rank": a.kv_lora_rank, "q_lora_rank": a.q_lora_rank, "qk_nope_head_dim": a.qk_nope_head_dim,
        "qk_rope_head_dim": a.qk_rope_head_dim, "v_head_dim": a.v_head_dim, "rope_interleave": True,
        "hidden_act": "silu", "rms_norm_eps": m.norm_eps, "attention_bias": False,
        "tie_word_embeddings": m.tie_embeddings, "num_nextn_predict_layers": 0, "torch_dtype": dtype, **scaling}
    return {**config, **carried}
