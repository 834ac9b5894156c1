"""Gemma 3 text models in Hugging Face terms (`Gemma3ForCausalLM`): our transformer with Gemma's switches on.

Its own entries on the shared machinery of `format`. Gemma 3 is: norms before and
after attention and the MLP (HF's `post_attention_layernorm` is our `attn_post_norm`, `pre_feedforward_layernorm`
our `mlp_norm`), RMSNorms that multiply by 1 + weight (`norm_scale_offset: 1`, the stored weights unchanged),
QK-norm, a GeGLU MLP with the tanh GELU, embeddings times sqrt(hidden), a tied head, a softmax scale of
`query_pre_attn_scalar`^-1/2, and sliding-window layers (`layer_types`, by default 5 of every 6) with their own
RoPE base beside the full layers' (possibly scaled) RoPE. Gemma 2's final logit soft-capping imports too; its
attention soft-capping and bidirectional attention are refused.
"""
from __future__ import annotations

from mlm_jax.config import ModelConfig
from mlm_jax.convert import ConvertError, format

ARCHITECTURE = "Gemma3ForCausalLM"
_layer = format.per_layer
ENTRIES = (
    format.Entry(("embed", "embedding"), "model.embed_tokens.weight"),
    _layer("attn_norm/scale", "input_layernorm.weight"),
    _layer("attn/q/kernel", "self_attn.q_proj.weight", "linear"),
    _layer("attn/k/kernel", "self_attn.k_proj.weight", "linear"),
    _layer("attn/v/kernel", "self_attn.v_proj.weight", "linear"),
    _layer("attn/o/kernel", "self_attn.o_proj.weight", "linear", 2),
    _layer("attn/q_norm/scale", "self_attn.q_norm.weight"),
    _layer("attn/k_norm/scale", "self_attn.k_norm.weight"),
    _layer("attn_post_norm/scale", "post_attention_layernorm.weight"),
    _layer("mlp_norm/scale", "pre_feedforward_layernorm.weight"),
    _layer("mlp/gate/kernel", "mlp.gate_proj.weight", "linear"),
    _layer("mlp/up/kernel", "mlp.up_proj.weight", "linear"),
    _layer("mlp/down/kernel", "mlp.down_proj.weight", "linear"),
    _layer("mlp_post_norm/scale", "post_feedforward_layernorm.weight"),
    format.Entry(("final_norm", "scale"), "model.norm.weight"),
    format.Entry(("head", "kernel"), "lm_head.weight", "linear"),
)
DEFAULTS = {"query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6,
            "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0}  # Gemma3TextConfig's


def layout(m: ModelConfig, shapes: dict) -> list[tuple[format.Entry, tuple[int, ...]]]:
    return format.layout(m, shapes, ENTRIES, "Gemma 3")


def _ropes(hf: dict) -> tuple[dict, float]:
    """(the full layers' RoPE as our model fields, the sliding layers' base): transformers 5 nests
    `rope_parameters` by layer type; 4 wrote `rope_theta`, `rope_scaling` and `rope_local_base_freq`."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
    else:
        full = {**(hf.get("rope_scaling") or params), "rope_theta": hf.get("rope_theta", DEFAULTS["rope_theta"])}
        local = {"rope_type": "default", "rope_theta": hf.get("rope_local_base_freq", DEFAULTS["rope_local_base_freq"])}
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise ConvertError(f"sliding_attention rope_type {local.get('rope_type')!r} is not supported (default only)")
    full.setdefault("rope_theta", DEFAULTS["rope_theta"])
    return format.rope({"max_position_embeddings": hf.get("max_position_embeddings"), "rope_scaling": full}), float(
        local.get("rope_theta", DEFAULTS["rope_local_base_freq"]))


def model_config(hf: dict) -> ModelConfig:
    """Our model section for a Gemma 3 text `config.json`; what we would compute differently is refused."""
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if hf.get(k) is None]
    if missing:
        raise ConvertError(f"config.json lacks {', '.join(missing)}")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ConvertError(f"hidden_activation={act!r} is not supported (only gelu_pytorch_tanh, i.e. GeGLU)")
    for key in ("attn_logit_softcapping", "use_bidirectional_attention", "attention_bias"):
        if hf.get(key):
            raise ConvertError(f"{key}={hf[key]!r} is not supported")
    n, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    pattern = hf.get("sliding_window_pattern", DEFAULTS["sliding_window_pattern"])
    types_ = hf.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                       for i in range(n)]
    if len(types_) != n or not set(types_) <= {"sliding_attention", "full_attention"}:
        raise ConvertError(f"layer_types={types_}: expected num_hidden_layers={n} entries of sliding_attention or "
                           f"full_attention")
    window = hf.get("sliding_window", DEFAULTS["sliding_window"])
    if "sliding_attention" in types_ and window is None:
        raise ConvertError("layer_types has sliding_attention layers but sliding_window is null")
    scalar = hf.get("query_pre_attn_scalar", DEFAULTS["query_pre_attn_scalar"])
    rotary, local_theta = _ropes(hf)
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=n, num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads, head_dim=head_dim, ffn_size=hf["intermediate_size"],
        norm="rmsnorm", norm_eps=float(hf.get("rms_norm_eps", 1e-6)), norm_scale_offset=1.0, post_norms=True,
        activation="geglu", tie_embeddings=bool(hf.get("tie_word_embeddings", True)), scale_embeddings=True,
        attention_scale=None if scalar == head_dim else float(scalar) ** -0.5,
        final_logit_softcap=None if hf.get("final_logit_softcapping") is None else float(
            hf["final_logit_softcapping"]),
        qk_norm=True, sliding_window=window if "sliding_attention" in types_ else None,
        layer_types=None if set(types_) == {"sliding_attention"} else list(types_), local_rope_theta=local_theta,
        **rotary)


def hf_config(m: ModelConfig, dtype: str, carried: dict) -> dict:
    """`config.json` (Gemma3ForCausalLM) for `m`, which must have Gemma 3's shape."""
    for unsupported, what in (
            (m.norm != "rmsnorm" or m.norm_scale_offset != 1.0, f"model.norm={m.norm} with norm_scale_offset="
                                                                f"{m.norm_scale_offset}"),
            (not m.post_norms, "model.post_norms=false"), (not m.qk_norm, "model.qk_norm=false"),
            (m.activation != "geglu", f"model.activation={m.activation}"),
            (not m.scale_embeddings, "model.scale_embeddings=false"), (m.qkv_bias, "model.qkv_bias=true"),
            (m.moe.enabled, "a mixture of experts")):
        if unsupported:
            raise ConvertError(f"{what} cannot be exported as Gemma 3 (RMSNorm times 1 + weight before and after "
                               f"each sublayer, QK-norm, GeGLU, scaled embeddings, no biases, dense)")
    types_ = ["sliding_attention" if m.is_local(i) else "full_attention" for i in range(m.num_layers)]
    scaling = format.hf_rope(m)
    full = {"rope_type": m.rope_scaling.rope_type, "rope_theta": m.rope_theta, **(scaling["rope_scaling"] or {})}
    scale = m.attention_scale
    return {
        "architectures": [ARCHITECTURE], "model_type": "gemma3_text", "vocab_size": m.vocab_size,
        "hidden_size": m.hidden_size, "intermediate_size": m.ffn_size, "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads, "num_key_value_heads": m.kv_heads, "head_dim": m.dim_per_head,
        "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": m.norm_eps,
        "query_pre_attn_scalar": m.dim_per_head if scale is None else _whole(scale ** -2),
        "sliding_window": m.sliding_window, "layer_types": types_,
        "rope_parameters": {"full_attention": full, "sliding_attention": {
            "rope_type": "default", "rope_theta": m.local_rope_theta or m.rope_theta}},
        "final_logit_softcapping": m.final_logit_softcap, "attn_logit_softcapping": None,
        "tie_word_embeddings": m.tie_embeddings, "attention_bias": False, "torch_dtype": dtype, **carried}


def _whole(x: float) -> int | float:
    """`x` as the integer it rounds to, when it is one (HF's config types it as an int)."""
    return round(x) if abs(x - round(x)) < 1e-6 * max(1.0, abs(x)) else x
