"""Einsum-based dense layer whose kernel carries logical dim names (TP column/row follows from the names)."""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from mlm_jax.model.kernels import Kernels
from mlm_jax.ops import te
from mlm_jax.ops.fp8 import HISTORY, delayed_einsum, fp8_einsum


# The name a product carries for recompute policies (`model.remat=dots` keeps it): a `Linear`'s and the experts'
# (`experts._grouped_swiglu`, `experts.batched_ffn`). Most run inside a custom VJP (`master_einsum`, `copy_einsum`,
# fp8, the grouped kernels) or with batch dims, which a policy looking for `dot_general` without them never keeps.
PRODUCT = "product"


def param(value: jax.Array, names: Sequence[str]) -> nnx.Param:
    """A parameter tagged with logical dim names; the trainer resolves them, layers never see a mesh."""
    return nnx.Param(value, out_sharding=tuple(names), eager_sharding=False)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class CastWeight:
    """A kernel's fp32 master beside its compute-dtype copy, made once a step rather than once a microbatch (per-layer
    gradient accumulation, `train.step`): the products read the copy, the weight gradient goes to the master."""

    master: jax.Array
    copy: jax.Array


def stand_in(copy: jax.Array) -> CastWeight:
    """`copy` paired with an fp32 stand-in for its master: the product reads `copy` and returns the weight gradient
    as the stand-in's, an fp32 product that XLA adds into an fp32 sum in its epilogue. Only the stand-in's dtype is
    read, so it is never written."""
    return CastWeight(jnp.zeros(copy.shape, jnp.float32), copy)


def for_fp32_sums(w: jax.Array, cast_once: bool, compute_dtype, copy: jax.Array | None = None,
                  fp32: jax.Array | None = None):
    """`w` as a step that sums each microbatch's gradient in fp32 hands it to the model (per-layer accumulation, the
    pipeline executor): a weight of `cast_once` (a kernel, a table) paired with an fp32 array in its master's place,
    with `copy` (its compute-dtype copy made beforehand) where given, else with itself where it is in the compute
    dtype (bf16 masters); a bf16 vector (a norm's scale, a bias) as its fp32 value, which the layers read it as
    anyway or cast back exactly; else as it is, its gradient rounded to its dtype (experts, a router).

    Only the master's dtype is read, so its place is taken by an fp32 array already in memory where there is one:
    the master itself, else `fp32` (the sum its gradient goes into, laid out as the master); zeros (`stand_in`)
    would be a buffer of their own wherever a recomputed layer keeps its inputs, one per shape, whole on every
    device whose weights are sharded."""
    if cast_once and (copy is not None or w.dtype == compute_dtype):
        copy = w if copy is None else copy
        fp32 = w if w.dtype == jnp.float32 else fp32
        return stand_in(copy) if fp32 is None else CastWeight(fp32, copy)
    if w.ndim <= 1 and jnp.issubdtype(w.dtype, jnp.floating) and w.dtype != jnp.float32:
        return w.astype(jnp.float32)
    return w


def master_gradients(grads):
    """A gradient of weights with `CastWeight` pairs as the weights' own tree: each pair's master gradient (its copy
    gets none)."""
    return jax.tree.map(lambda g: g.master if isinstance(g, CastWeight) else g, grads,
                        is_leaf=lambda g: isinstance(g, CastWeight))


class Linear(nnx.Module):
    """`y = einsum(equation, x, kernel) [+ bias]`; weights stored in `param_dtype`, operands cast to `dtype`.

    `bias_dims` is how many trailing kernel dims are output dims (and so the bias shape); 0 = no bias.
    `precision`: bf16 multiplies in `dtype`; fp8 in XLA fp8 (`ops/fp8.py`), fp8_delayed likewise with delayed
    scaling over a history of `fp8_history` steps (a weight of the layer, `fp8.HISTORY`); fp8_te through
    Transformer Engine. `kernels` (`model.kernels`) choose the product of a bf16 layer.
    """

    def __init__(self, equation: str, kernel_shape: Sequence[int], names: Sequence[str], *, std: float,
                 dtype, param_dtype, rngs: nnx.Rngs, bias_dims: int = 0, precision: str = "bf16",
                 fp8_history: int = 16, kernels: Kernels = Kernels()):
        self.equation = equation
        self.dtype = dtype
        self.precision = precision
        self.kernels = kernels
        self.kernel = param(std * jax.random.normal(rngs.params(), tuple(kernel_shape), param_dtype), names)
        if bias_dims:
            self.bias = param(jnp.zeros(tuple(kernel_shape)[-bias_dims:], param_dtype), tuple(names)[-bias_dims:])
        if precision == "fp8_delayed":
            setattr(self, HISTORY, param(jnp.zeros((3, fp8_history), jnp.float32), (None, None)))

    def __call__(self, x: jax.Array, row_scale: jax.Array | None = None) -> jax.Array:
        """A bf16 layer multiplies the master weight through `master_einsum` where its kernels say `master` (FSDP
        casts where it chooses), else through the few-row kernel they name (decode steps), else XLA's einsum.
        `row_scale` (fp32, broadcast against the product) multiplies the product before the bias: a norm's per-row
        factor whose per-column gain is folded into the kernel (decode-time blocks, `mlm_jax.infer`)."""
        x = x.astype(self.dtype)
        if isinstance(weight := self.kernel.get_value(), CastWeight):
            y = copy_einsum(self.equation, x, weight.master, weight.copy)
        elif self.precision == "bf16" and self.kernels.master:
            y = master_einsum(self.equation, x, weight)
        elif self.precision == "fp8":
            y = fp8_einsum(self.equation, x, weight.astype(self.dtype))
        elif self.precision == "fp8_delayed":
            y = delayed_einsum(self.equation, x, weight.astype(self.dtype), getattr(self, HISTORY)[...])
        elif self.precision == "fp8_te":
            y = te.einsum(self.equation, x, weight.astype(self.dtype))
        else:
            y = (self.kernels.few_rows or jnp.einsum)(self.equation, x, weight.astype(self.dtype))
        y = checkpoint_name(y, PRODUCT)
        if row_scale is not None:
            y = (y.astype(jnp.float32) * row_scale).astype(self.dtype)
        return y + self.bias[...].astype(self.dtype) if hasattr(self, "bias") else y


def path_names(path) -> tuple[str, ...]:
    """A pytree path as the names `master_kernels` gives (what pairs a kernel with its `CastWeight`)."""
    return tuple(str(getattr(k, "key", k)) for k in path)


def master_kernels(module: nnx.Module) -> frozenset[tuple[str, ...]]:
    """The paths of the kernels in `module` that `master_einsum` multiplies (bf16 `Linear`s with master kernels)."""
    return frozenset((*map(str, path), "kernel") for path, m in nnx.iter_modules(module)
                     if isinstance(m, Linear) and m.precision == "bf16" and m.kernels.master)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def master_einsum(equation: str, x: jax.Array, master: jax.Array) -> jax.Array:
    """`einsum(equation, x, master.astype(x.dtype))` whose weight gradient is an fp32 product, returned in the
    master's dtype. Under FSDP the master's shard is cast before XLA gathers it (16-bit bytes on the wire) and the
    weight gradient's partial sums cross the data-parallel ranks in fp32, not in x's dtype. The equation contracts
    x's dims with the kernel's into the output's (every `Linear`'s): each gradient is one einsum."""
    return jnp.einsum(equation, x, master.astype(x.dtype))


def _master_fwd(equation, x, master):
    return master_einsum(equation, x, master), (x, master)


def _gradients(equation, x, w, dy, master_dtype):
    """(dx in x's dtype from the compute weight `w`, dw as an fp32 product in the master's dtype).

    dw's operands pass an optimization barrier of their own: products that share x (q, k and v; gate and up) would
    otherwise be merged by XLA into one product whose fp32 output is sliced and added into each weight's gradient
    sum in passes of their own, where each product by itself adds into its sum in the GEMM's epilogue (per-layer
    accumulation, `train.step`)."""
    inputs, out = equation.split("->")
    xs, ks = inputs.split(",")
    dx = jnp.einsum(f"{out},{ks}->{xs}", dy, w)
    x, dy = jax.lax.optimization_barrier((x, dy))
    dw = jnp.einsum(f"{xs},{out}->{ks}", x, dy, preferred_element_type=jnp.float32)
    return dx.astype(x.dtype), dw.astype(master_dtype)


def _master_bwd(equation, residuals, dy):
    x, master = residuals
    return _gradients(equation, x, master.astype(x.dtype), dy, master.dtype)


master_einsum.defvjp(_master_fwd, _master_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def copy_einsum(equation: str, x: jax.Array, master: jax.Array, copy: jax.Array) -> jax.Array:
    """`master_einsum` from a copy of the master in x's dtype made beforehand (`CastWeight`): the products read the
    copy, the weight gradient is an fp32 product returned for the master; the copy gets none (a zero), as it is
    made outside what is differentiated.

    The operands pass an optimization barrier of their own, as the weight gradient's do (`_gradients`): products
    that share x (q, k and v; gate and up) would otherwise be merged by XLA into one whose weights are concatenated
    and whose output is sliced apart in passes of their own, once per microbatch (the weights are loop-invariant, the
    concatenation is not hoisted out of the microbatch loop)."""
    x, copy = jax.lax.optimization_barrier((x, copy))
    return jnp.einsum(equation, x, copy)


def _copy_fwd(equation, x, master, copy):
    return copy_einsum(equation, x, master, copy), (x, master, copy)


def _copy_bwd(equation, residuals, dy):
    x, master, copy = residuals
    dx, dw = _gradients(equation, x, copy, dy, master.dtype)
    return dx, dw, jnp.zeros_like(copy)


copy_einsum.defvjp(_copy_fwd, _copy_bwd)
