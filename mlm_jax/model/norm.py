"""RMSNorm and LayerNorm over the last dim, statistics in fp32."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mlm_jax.model import axes as ax
from mlm_jax.model.linear import param


class Norm(nnx.Module):
    """`kind` is 'rmsnorm' (scale only, Llama) or 'layernorm' (scale and bias, GPT-2). The normalised values are
    multiplied by `offset + scale`, the scale starting at `1 - offset` (Gemma stores scales around 0, offset 1)."""

    def __init__(self, dim: int, *, kind: str, eps: float, dtype, param_dtype, offset: float = 0.0):
        self.kind, self.eps, self.dtype, self.offset = kind, eps, dtype, offset
        self.scale = param(jnp.full((dim,), 1.0 - offset, param_dtype), (ax.NORM,))
        if kind == "layernorm":
            self.bias = param(jnp.zeros((dim,), param_dtype), (ax.NORM,))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        if self.kind == "layernorm":
            x32 = x32 - x32.mean(-1, keepdims=True)
        y = x32 * self.factor(x32) * self.gain()
        if self.kind == "layernorm":
            y = y + self.bias[...].astype(jnp.float32)
        return y.astype(self.dtype)

    def factor(self, x: jax.Array) -> jax.Array:
        """Each row's fp32 factor 1 / rms (an RMSNorm's output is x times it times `gain()`), with a last dim of 1."""
        x32 = x.astype(jnp.float32)
        return jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + self.eps)

    def gain(self) -> jax.Array:
        """The fp32 per-column multiplier, `offset + scale`."""
        return self.offset + self.scale[...].astype(jnp.float32)
