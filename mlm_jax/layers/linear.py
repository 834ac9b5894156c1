"""Einsum-based dense layer whose kernel carries logical dim names (TP column/row follows from the names)."""
from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx


def param(value: jax.Array, names: Sequence[str]) -> nnx.Param:
    """A parameter tagged with logical dim names; the trainer resolves them, layers never see a mesh."""
    return nnx.Param(value, out_sharding=tuple(names), eager_sharding=False)


class Linear(nnx.Module):
    """`y = einsum(equation, x, kernel)`; kernel stored in `param_dtype`, both operands cast to `dtype`."""

    def __init__(self, equation: str, kernel_shape: Sequence[int], names: Sequence[str], *, std: float,
                 dtype, param_dtype, rngs: nnx.Rngs):
        self.equation = equation
        self.dtype = dtype
        self.kernel = param(std * jax.random.normal(rngs.params(), tuple(kernel_shape), param_dtype), names)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.einsum(self.equation, x.astype(self.dtype), self.kernel[...].astype(self.dtype))
