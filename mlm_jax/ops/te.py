"""Optional Transformer Engine backend: `model.attention_impl=te` (TE's fused cuDNN attention) and
`model.precision=fp8_te` (TE's fp8 GEMMs with current scaling).

Written against Transformer Engine 2.x's functional JAX API (`attention.fused_attn`, `dense.dense`,
`quantize.QuantizerFactory`) and not run here: its JAX extension is a CUDA source build. Nothing else imports this
module unless one of the two options is chosen; `missing()` lets the trainer refuse them with one line.
"""
from __future__ import annotations

import math

import jax

from mlm_jax.ops.fp8 import operands


def missing() -> str | None:
    """Why Transformer Engine cannot be used here, or None when `transformer_engine.jax` imports."""
    try:
        import transformer_engine.jax  # noqa: F401
    except Exception as e:  # noqa: BLE001  (ImportError, or a broken CUDA extension)
        return f"{type(e).__name__}: {e}"
    return None


def attend(q_BSNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array) -> jax.Array:
    """Causal attention, separate Q/K/V in BSHD layout; GQA through fewer K/V heads."""
    from transformer_engine.jax.attention import AttnBiasType, AttnMaskType, QKVLayout, fused_attn

    return fused_attn((q_BSNH, k_BSKH, v_BSKH), None, None, None, attn_bias_type=AttnBiasType.NO_BIAS,
                      attn_mask_type=AttnMaskType.CAUSAL_MASK, qkv_layout=QKVLayout.BSHD_BSHD_BSHD,
                      scaling_factor=1.0 / math.sqrt(q_BSNH.shape[-1]), dropout_probability=0.0, is_training=True)


def einsum(equation: str, x: jax.Array, kernel: jax.Array) -> jax.Array:
    """`einsum(equation, x, kernel)` as a TE fp8 dense: in every Linear equation x's trailing dims contract with the
    kernel's leading dims and the output is x's kept dims then the kernel's."""
    from transformer_engine.common.recipe import Float8CurrentScaling
    from transformer_engine.jax import fp8_autocast
    from transformer_engine.jax.dense import dense
    from transformer_engine.jax.quantize import QuantizerFactory

    x_dims, k_dims, _ = operands(equation)
    n = len(set(x_dims) & set(k_dims))
    with fp8_autocast(enabled=True, fp8_recipe=Float8CurrentScaling()):
        quantizers = QuantizerFactory.create_set()
    return dense(x, kernel, contracting_dims=(tuple(range(x.ndim - n, x.ndim)), tuple(range(n))),
                 quantizer_set=quantizers)
