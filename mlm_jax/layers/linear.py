"""Einsum-based dense layer whose kernel carries logical dim names (TP column/row follows from the names)."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from mlm_jax.layers.fp8 import fp8_einsum


def param(value: jax.Array, names: Sequence[str]) -> nnx.Param:
    """A parameter tagged with logical dim names; the trainer resolves them, layers never see a mesh."""
    return nnx.Param(value, out_sharding=tuple(names), eager_sharding=False)


class Linear(nnx.Module):
    """`y = einsum(equation, x, kernel) [+ bias]`; weights stored in `param_dtype`, operands cast to `dtype`.

    `bias_dims` is how many trailing kernel dims are output dims (and so the bias shape); 0 = no bias.
    `precision`: bf16 multiplies in `dtype`; fp8 in XLA fp8 (`layers/fp8.py`); fp8_te through Transformer Engine.
    """

    def __init__(self, equation: str, kernel_shape: Sequence[int], names: Sequence[str], *, std: float,
                 dtype, param_dtype, rngs: nnx.Rngs, bias_dims: int = 0, precision: str = "bf16"):
        self.equation = equation
        self.dtype = dtype
        self.precision = precision
        self.kernel = param(std * jax.random.normal(rngs.params(), tuple(kernel_shape), param_dtype), names)
        if bias_dims:
            self.bias = param(jnp.zeros(tuple(kernel_shape)[-bias_dims:], param_dtype), tuple(names)[-bias_dims:])

    def __call__(self, x: jax.Array, einsum: Callable = jnp.einsum) -> jax.Array:
        """`einsum`: how a bf16 layer multiplies (a kernel for the caller's shapes)."""
        x, kernel = x.astype(self.dtype), self.kernel[...].astype(self.dtype)
        if self.precision == "fp8":
            y = fp8_einsum(self.equation, x, kernel)
        elif self.precision == "fp8_te":
            from mlm_jax.layers import te  # optional backend, imported only when chosen
            y = te.einsum(self.equation, x, kernel)
        else:
            y = einsum(self.equation, x, kernel)
        return y + self.bias[...].astype(self.dtype) if hasattr(self, "bias") else y
