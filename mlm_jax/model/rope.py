"""Rotary position embeddings, rotate-half convention (the Hugging Face Llama layout, so weights load as is).

The frequencies follow Hugging Face's `rope_type`s: default, linear (positions interpolated by `factor`), llama3
(long wavelengths divided by `factor`, a smooth ramp between `low_freq_factor` and `high_freq_factor` of the
original context) and yarn (NTK-by-parts interpolation between `beta_fast` and `beta_slow` rotations, cos and sin
scaled by an attention factor). A fraction `rotary_dim / head_dim` of each head may rotate (partial rotary), the
rest passes through.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rotary_dim: int  # the leading dims of a head that rotate (the head dim unless partial)
    kind: str = "default"  # default | linear | llama3 | yarn
    factor: float = 1.0
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    original_context: int | None = None  # llama3, yarn: the pretraining context
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    attention_factor: float | None = None  # yarn: overrides the factor derived from `factor` and the mscales
    truncate: bool = True  # yarn: round the ramp's ends to whole dims


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def frequencies(c: RopeConfig) -> tuple[np.ndarray, float]:
    """The inverse frequency of each rotated pair (float32, `rotary_dim // 2` of them) and the factor cos and sin
    are scaled by. Host constants, so no transcendental runs per step."""
    dim = c.rotary_dim
    exponent = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    inv_freq = (1.0 / np.float32(c.theta) ** exponent).astype(np.float32)
    if c.kind == "linear":
        return inv_freq / np.float32(c.factor), 1.0
    if c.kind == "llama3":
        low_wavelen = c.original_context / c.low_freq_factor
        high_wavelen = c.original_context / c.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / np.float32(c.factor), inv_freq)
        smooth = (c.original_context / wavelen - c.low_freq_factor) / (c.high_freq_factor - c.low_freq_factor)
        smoothed = (1 - smooth) * scaled / c.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32), 1.0
    if c.kind == "yarn":
        if c.attention_factor is not None:
            attention = c.attention_factor
        elif c.mscale and c.mscale_all_dim:
            attention = _yarn_mscale(c.factor, c.mscale) / _yarn_mscale(c.factor, c.mscale_all_dim)
        else:
            attention = _yarn_mscale(c.factor)

        def correction_dim(rotations: float) -> float:
            return dim * math.log(c.original_context / (rotations * 2 * math.pi)) / (2 * math.log(c.theta))

        low, high = correction_dim(c.beta_fast), correction_dim(c.beta_slow)
        if c.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        high = high + 0.001 if low == high else high
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
        extrapolate = (1 - ramp).astype(np.float32)  # high-frequency pairs keep their frequency
        interpolated = inv_freq / np.float32(c.factor)
        return (interpolated * (1 - extrapolate) + inv_freq * extrapolate).astype(np.float32), float(attention)
    return inv_freq, 1.0


def tables(positions_BS: jax.Array, c: RopeConfig) -> tuple[jax.Array, jax.Array]:
    """cos and sin of each position's angles, [B, S, rotary_dim // 2] in fp32, scaled by the attention factor."""
    inv_freq_K, scale = frequencies(c)
    angles_BSK = positions_BS.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq_K)
    cos_BSK, sin_BSK = jnp.cos(angles_BSK), jnp.sin(angles_BSK)
    if scale != 1.0:
        cos_BSK, sin_BSK = cos_BSK * scale, sin_BSK * scale
    return cos_BSK, sin_BSK


def apply_rope(x_BSNH: jax.Array, positions_BS: jax.Array, c: RopeConfig) -> jax.Array:
    """Rotate pairs (i, i + R/2) of each head's first R = `rotary_dim` dims by position-dependent angles; fp32."""
    half = c.rotary_dim // 2
    cos_BSK, sin_BSK = tables(positions_BS, c)
    cos_BS1K, sin_BS1K = cos_BSK[:, :, None], sin_BSK[:, :, None]
    x = x_BSNH.astype(jnp.float32)
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    out = jnp.concatenate([x1 * cos_BS1K - x2 * sin_BS1K, x2 * cos_BS1K + x1 * sin_BS1K, rest], axis=-1)
    return out.astype(x_BSNH.dtype)
