"""Rotary position embeddings, rotate-half convention (the Hugging Face Llama layout, so weights load as is)."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def apply_rope(x_BSNH: jax.Array, positions_BS: jax.Array, theta: float) -> jax.Array:
    """Rotate pairs (i, i + H/2) of each head by position-dependent angles; computed in fp32."""
    half = x_BSNH.shape[-1] // 2
    inv_freq_K = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) / half))
    angles_BSK = positions_BS.astype(jnp.float32)[..., None] * inv_freq_K
    cos_BS1K, sin_BS1K = jnp.cos(angles_BSK)[:, :, None], jnp.sin(angles_BSK)[:, :, None]
    x = x_BSNH.astype(jnp.float32)
    x1, x2 = x[..., :half], x[..., half:]
    out = jnp.concatenate([x1 * cos_BS1K - x2 * sin_BS1K, x2 * cos_BS1K + x1 * sin_BS1K], axis=-1)
    return out.astype(x_BSNH.dtype)
