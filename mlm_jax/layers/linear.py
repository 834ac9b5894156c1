"""Einsum-based dense layer whose kernel carries logical dim names (TP column/row follows from the names)."""
from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from mlm_jax.layers import axes as ax
from mlm_jax.layers.fp8 import HISTORY, delayed_einsum, fp8_einsum


def param(value: jax.Array, names: Sequence[str]) -> nnx.Param:
    """A parameter tagged with logical dim names; the trainer resolves them, layers never see a mesh."""
    return nnx.Param(value, out_sharding=tuple(names), eager_sharding=False)


class Linear(nnx.Module):
    """`y = einsum(equation, x, kernel) [+ bias]`; weights stored in `param_dtype`, operands cast to `dtype`.

    `bias_dims` is how many trailing kernel dims are output dims (and so the bias shape); 0 = no bias.
    `precision`: bf16 multiplies in `dtype`; fp8 in XLA fp8 (`layers/fp8.py`), fp8_delayed likewise with delayed
    scaling over a history of `fp8_history` steps (a weight of the layer, `fp8.HISTORY`); fp8_te through
    Transformer Engine.
    """

    def __init__(self, equation: str, kernel_shape: Sequence[int], names: Sequence[str], *, std: float,
                 dtype, param_dtype, rngs: nnx.Rngs, bias_dims: int = 0, precision: str = "bf16",
                 fp8_history: int = 16):
        self.equation = equation
        self.dtype = dtype
        self.precision = precision
        self.kernel = param(std * jax.random.normal(rngs.params(), tuple(kernel_shape), param_dtype), names)
        if bias_dims:
            self.bias = param(jnp.zeros(tuple(kernel_shape)[-bias_dims:], param_dtype), tuple(names)[-bias_dims:])
        if precision == "fp8_delayed":
            setattr(self, HISTORY, param(jnp.zeros((3, fp8_history), jnp.float32), (None, None)))

    def refit(self, equation: str, kernel: jax.Array, names: Sequence[str | None],
              bias: jax.Array | None = None) -> Linear:
        """This layer over another equation and weights (its dtype and precision): a product formed from others
        (`Attention.fuse_projections`)."""
        self.equation = equation
        self.kernel = param(kernel, names)
        if bias is not None:
            self.bias = param(bias, tuple(names)[kernel.ndim - bias.ndim:])
        elif hasattr(self, "bias"):
            del self.bias
        return self

    def __call__(self, x: jax.Array, row_scale: jax.Array | None = None) -> jax.Array:
        """A bf16 layer multiplies through the kernel installed as `axes.FEW_ROWS` (generation's few-row
        products), if any; a layout that installs `axes.MASTER_EINSUM` (FSDP) gets the master weight itself, to cast
        where it chooses. `row_scale` (fp32, broadcast against the product) multiplies the product before the bias:
        a norm's per-row factor whose per-column gain is folded into the kernel (`Block.fold_norms`)."""
        x = x.astype(self.dtype)
        master = ax.kernel(ax.MASTER_EINSUM)
        if self.precision == "bf16" and master is not None:
            y = master(self.equation, x, self.kernel[...])
        elif self.precision == "fp8":
            y = fp8_einsum(self.equation, x, self.kernel[...].astype(self.dtype))
        elif self.precision == "fp8_delayed":
            y = delayed_einsum(self.equation, x, self.kernel[...].astype(self.dtype), getattr(self, HISTORY)[...])
        elif self.precision == "fp8_te":
            from mlm_jax.layers import te  # optional backend, imported only when chosen
            y = te.einsum(self.equation, x, self.kernel[...].astype(self.dtype))
        else:
            y = (ax.kernel(ax.FEW_ROWS) or jnp.einsum)(self.equation, x, self.kernel[...].astype(self.dtype))
        if row_scale is not None:
            y = (y.astype(jnp.float32) * row_scale).astype(self.dtype)
        return y + self.bias[...].astype(self.dtype) if hasattr(self, "bias") else y

    def partial_sums(self, x: jax.Array) -> jax.Array:
        """`self(x)` as partial products over slices of the contracted dims, [S, *output's shape], whose fp32 sum
        rounded to `dtype` is `self(x)`, for a consumer that sums them itself (`axes.RESIDUAL`): from the kernel
        installed as `axes.FEW_ROWS` (fp32 partials) where the layer multiplies through it, else `self(x)` as the
        one partial."""
        few = ax.kernel(ax.FEW_ROWS)
        if few is None or self.precision != "bf16" or hasattr(self, "bias") or ax.kernel(ax.MASTER_EINSUM):
            return self(x)[None]
        return few(self.equation, x.astype(self.dtype), self.kernel[...].astype(self.dtype), summed=False)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def master_einsum(equation: str, x: jax.Array, master: jax.Array) -> jax.Array:
    """`einsum(equation, x, master.astype(x.dtype))` whose weight gradient is an fp32 product, returned in the
    master's dtype. Under FSDP the master's shard is cast before XLA gathers it (16-bit bytes on the wire) and the
    weight gradient's partial sums cross the data-parallel ranks in fp32, not in x's dtype. The equation contracts
    x's dims with the kernel's into the output's (every `Linear`'s): each gradient is one einsum."""
    return jnp.einsum(equation, x, master.astype(x.dtype))


def _master_fwd(equation, x, master):
    return master_einsum(equation, x, master), (x, master)


def _master_bwd(equation, residuals, dy):
    x, master = residuals
    inputs, out = equation.split("->")
    xs, ks = inputs.split(",")
    dx = jnp.einsum(f"{out},{ks}->{xs}", dy, master.astype(x.dtype))
    dw = jnp.einsum(f"{xs},{out}->{ks}", x, dy, preferred_element_type=jnp.float32)
    return dx.astype(x.dtype), dw.astype(master.dtype)


master_einsum.defvjp(_master_fwd, _master_bwd)
