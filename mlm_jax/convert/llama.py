"""The Llama family (Llama 2 and 3, Mistral, Qwen2, Qwen3) in Hugging Face terms: config keys, tensor names and layouts.

Shapes: D model, N query heads, K kv heads, H head dim, F ffn, V vocabulary, L layers. Both HF and we use
rotate-half RoPE, so q/k need no permutation. Mixtral and Qwen3-MoE build on this family.
"""
from __future__ import annotations

from mlm_jax.config import ModelConfig
from mlm_jax.convert import ConvertError, format

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")

_layer = format.per_layer
ENTRIES = (
    format.Entry(("embed", "embedding"), "model.embed_tokens.weight"),
    _layer("attn_norm/scale", "input_layernorm.weight"),
    _layer("attn/q/kernel", "self_attn.q_proj.weight", "linear"),
    _layer("attn/k/kernel", "self_attn.k_proj.weight", "linear"),
    _layer("attn/v/kernel", "self_attn.v_proj.weight", "linear"),
    _layer("attn/q/bias", "self_attn.q_proj.bias", "flat"),
    _layer("attn/k/bias", "self_attn.k_proj.bias", "flat"),
    _layer("attn/v/bias", "self_attn.v_proj.bias", "flat"),
    _layer("attn/o/kernel", "self_attn.o_proj.weight", "linear", 2),
    _layer("attn/q_norm/scale", "self_attn.q_norm.weight"),
    _layer("attn/k_norm/scale", "self_attn.k_norm.weight"),
    _layer("mlp_norm/scale", "post_attention_layernorm.weight"),
    _layer("mlp/gate/kernel", "mlp.gate_proj.weight", "linear"),
    _layer("mlp/up/kernel", "mlp.up_proj.weight", "linear"),
    _layer("mlp/down/kernel", "mlp.down_proj.weight", "linear"),
    format.Entry(("final_norm", "scale"), "model.norm.weight"),
    format.Entry(("head", "kernel"), "lm_head.weight", "linear"),
)


def layout(m: ModelConfig, shapes: dict) -> list[tuple[format.Entry, tuple[int, ...]]]:
    return format.layout(m, shapes, ENTRIES, "Llama")


def model_config(hf: dict) -> ModelConfig:
    """Our model section for an HF `config.json`; anything we would compute differently is refused."""
    arch = hf["architectures"][0]
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if hf.get(k) is None]
    if missing:
        raise ConvertError(f"config.json lacks {', '.join(missing)}")
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ConvertError(f"hidden_act={hf['hidden_act']!r} is not supported (only silu, i.e. SwiGLU)")
    rotary = format.rope(hf)
    if rotary["partial_rotary_factor"] != 1:
        raise ConvertError(f"partial_rotary_factor={rotary['partial_rotary_factor']}: {arch} rotates whole heads")
    window, layer_types = _sliding_window(hf, arch)
    if arch != "Qwen2ForCausalLM" and hf.get("attention_bias"):  # Qwen3's also adds one to o_proj
        raise ConvertError("attention_bias=true is not supported (it adds an o_proj bias, which mlm_jax lacks)")
    if hf.get("mlp_bias"):
        raise ConvertError("mlp_bias=true is not supported")
    heads, dim = hf["num_attention_heads"], hf["hidden_size"]
    head_dim = hf.get("head_dim") or dim // heads
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=dim, num_layers=hf["num_hidden_layers"], num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads, head_dim=None if head_dim * heads == dim else head_dim,
        ffn_size=hf["intermediate_size"], norm="rmsnorm", norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        activation="swiglu", tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=arch == "Qwen2ForCausalLM", qk_norm=arch == "Qwen3ForCausalLM", sliding_window=window,
        layer_types=layer_types, **rotary)


def _sliding_window(hf: dict, arch: str) -> tuple[int | None, list | None]:
    """(window, per-layer types or None for every layer) of an HF config: Mistral windows every layer, Qwen2 and
    Qwen3 (with `use_sliding_window`) the layers `layer_types` marks, by default those from `max_window_layers`."""
    window = hf.get("sliding_window")
    if arch == "MistralForCausalLM" or window is None:
        return window, None
    if arch not in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") or not hf.get("use_sliding_window"):
        return None, None
    n = hf["num_hidden_layers"]
    types_ = hf.get("layer_types") or ["sliding_attention" if i >= hf.get("max_window_layers", n) else
                                       "full_attention" for i in range(n)]
    if len(types_) != n or not set(types_) <= {"sliding_attention", "full_attention"}:
        raise ConvertError(f"layer_types={types_}: expected num_hidden_layers={n} entries of sliding_attention or "
                           f"full_attention")
    if "sliding_attention" not in types_:
        return None, None
    return window, None if set(types_) == {"sliding_attention"} else list(types_)


def hf_sliding_window(m: ModelConfig, arch: str) -> dict:
    """Our sliding window as `config.json` keys of `arch` (the way back of `_sliding_window`)."""
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        if m.sliding_window is None:
            return {"use_sliding_window": False}
        types_ = ["sliding_attention" if m.is_local(i) else "full_attention" for i in range(m.num_layers)]
        return {"use_sliding_window": True, "sliding_window": m.sliding_window, "layer_types": types_,
                "max_window_layers": types_.index("sliding_attention")}
    if m.layer_types is not None and m.sliding_window is not None:
        raise ConvertError(f"model.layer_types mixing sliding and full layers cannot be exported as {arch} (it "
                           f"windows every layer or none); Qwen2 and Qwen3 can")
    return {"sliding_window": m.sliding_window} if m.sliding_window is not None else {}


def hf_config(m: ModelConfig, dtype: str, carried: dict) -> dict:
    """`config.json` for `m`: Qwen3ForCausalLM with QK-norm, Qwen2ForCausalLM with q/k/v biases, else
    LlamaForCausalLM."""
    for unsupported, what in ((m.norm != "rmsnorm", f"model.norm={m.norm}"),
                              (m.activation != "swiglu", f"model.activation={m.activation}"),
                              (m.qk_norm and m.qkv_bias, "model.qk_norm=true with model.qkv_bias=true"),
                              (m.norm_scale_offset != 0, f"model.norm_scale_offset={m.norm_scale_offset}"),
                              (m.scale_embeddings, "model.scale_embeddings=true"),
                              (m.attention_scale is not None, f"model.attention_scale={m.attention_scale}"),
                              (m.final_logit_softcap is not None, f"model.final_logit_softcap={m.final_logit_softcap}"),
                              (m.local_rope_theta is not None, f"model.local_rope_theta={m.local_rope_theta}"),
                              (m.partial_rotary_factor != 1, f"model.partial_rotary_factor={m.partial_rotary_factor}")):
        if unsupported:
            raise ConvertError(f"{what} cannot be exported (Llama, Mistral, Qwen2 and Qwen3 use RMSNorm, SwiGLU, "
                               f"whole-head RoPE and either q/k/v biases (Qwen2) or QK-norm (Qwen3))")
    arch = "Qwen3ForCausalLM" if m.qk_norm else "Qwen2ForCausalLM" if m.qkv_bias else "LlamaForCausalLM"
    if arch == "LlamaForCausalLM" and m.sliding_window is not None:  # Mistral is Llama with a window
        arch = "MistralForCausalLM"
    config = {
        "architectures": [arch], "model_type": arch.removesuffix("ForCausalLM").lower(),
        "vocab_size": m.vocab_size, "hidden_size": m.hidden_size, "intermediate_size": m.ffn_size,
        "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.kv_heads, "head_dim": m.dim_per_head, "hidden_act": "silu",
        "rms_norm_eps": m.norm_eps, **format.hf_rope(m),
        "tie_word_embeddings": m.tie_embeddings, "torch_dtype": dtype,
        **hf_sliding_window(m, arch), **({"mlp_bias": False} if arch == "LlamaForCausalLM" else {}),
        **({"attention_bias": False} if arch in ("LlamaForCausalLM", "Qwen3ForCausalLM") else {}),
    }
    return {**config, **carried}
