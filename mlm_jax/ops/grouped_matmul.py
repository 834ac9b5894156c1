"""Grouped matmuls of dropless experts (`jax.lax.ragged_dot`'s meaning: each group of rows times its own matrix):
`jax.lax.ragged_dot`, or on Hopper the Pallas Mosaic-GPU kernels behind a custom VJP.

`mgpu-compile` is for compiling a step for GPUs this process does not have (the layout planner): the Mosaic kernels
for the product and its input gradient, which lower for a described GPU, and for the weight gradient a dense product
of the same FLOPs and output, since that kernel sizes its grid from the SM count of a GPU the process must hold. It
never runs: its weight gradient is not the grouped one. `jax.lax.ragged_dot` is no stand-in there: XLA computes it
as a dense product over every group, with temporaries of (rows, groups, columns).

Shapes: R rows, G groups, K contracted, N output columns.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

IMPLS = ("ragged", "mgpu")  # `model.moe.impl`'s choices besides auto

GroupedMatmul = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]  # (lhs_RK, rhs_GKN, sizes_G) -> out_RN
_MGPU_BLOCKS = dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=4)


def grouped_matmul(matmul: GroupedMatmul, matmul_t: GroupedMatmul,
                   wgrad: Callable[[jax.Array, jax.Array, jax.Array], jax.Array], padded: bool = True) -> GroupedMatmul:
    """A differentiable grouped matmul with `jax.lax.ragged_dot`'s meaning, from three kernels without autodiff.

    matmul(lhs_RK, rhs_GKN, sizes_G) -> RN; matmul_t(lhs_RN, rhs_GKN, sizes_G) -> RK contracts rhs' N;
    wgrad(lhs_RK, rhs_RN, sizes_G) -> GKN sums each group's rows. With `padded`, rows past the last group are
    zero in the output and in d_lhs, and never reach d_rhs (kernels may leave them undefined); without, the groups
    must cover every row, and no masking pass is spent.
    """
    def valid(x_RX, sizes_G):
        if not padded:
            return x_RX
        return jnp.where((jnp.arange(x_RX.shape[0]) < sizes_G.sum())[:, None], x_RX, 0)

    @jax.custom_vjp
    def gmm(lhs_RK, rhs_GKN, sizes_G):
        return valid(matmul(lhs_RK, rhs_GKN, sizes_G), sizes_G)

    def fwd(lhs_RK, rhs_GKN, sizes_G):
        return gmm(lhs_RK, rhs_GKN, sizes_G), (lhs_RK, rhs_GKN, sizes_G)

    def bwd(res, d_RN):
        lhs_RK, rhs_GKN, sizes_G = res
        d_RN = valid(d_RN, sizes_G)
        d_lhs_RK = valid(matmul_t(d_RN, rhs_GKN, sizes_G), sizes_G)
        return d_lhs_RK, wgrad(valid(lhs_RK, sizes_G), d_RN, sizes_G), None

    gmm.defvjp(fwd, bwd)
    return gmm


@functools.cache
def _mgpu_matmul(padded: bool, compile_only: bool = False) -> GroupedMatmul:
    """Hopper kernels (Pallas Mosaic GPU); imported here since they load only where Mosaic GPU is built.

    Each kernel is jitted so that the layers of an unrolled model share one lowering of it (lowering a Mosaic
    kernel is slow); the block sizes won a sweep on moe-1b's shapes on an H200 (590-650 TFLOP/s; grid_block_n=1
    ran at about 250).
    """
    from jax.experimental.pallas.ops.gpu.ragged_dot_mgpu import ragged_dot
    from jax.experimental.pallas.ops.gpu.transposed_ragged_dot_mgpu import transposed_ragged_dot
    wgrad = _dense_wgrad if compile_only else (
        lambda x, dy, sizes: transposed_ragged_dot(x, dy, group_sizes=sizes, **_MGPU_BLOCKS))
    return grouped_matmul(
        jax.jit(lambda x, w, sizes: ragged_dot(x, w, group_sizes=sizes, **_MGPU_BLOCKS)),
        jax.jit(lambda dy, w, sizes: ragged_dot(dy, w, group_sizes=sizes, transpose_rhs=True, **_MGPU_BLOCKS)),
        jax.jit(wgrad), padded)


def _dense_wgrad(x_RK: jax.Array, dy_RN: jax.Array, sizes_G: jax.Array) -> jax.Array:
    """`mgpu-compile`'s weight gradient: the grouped one's FLOPs (every row once) and its (G, K, N) output, but one
    product over all rows, repeated for each group."""
    kn = jnp.einsum("rk,rn->kn", x_RK, dy_RN, preferred_element_type=jnp.float32).astype(x_RK.dtype)
    return jnp.broadcast_to(kn, (sizes_G.shape[0], *kn.shape))


def mgpu_unavailable(dtype, D: int, F: int, platform: str, device_kind: str) -> str | None:
    """Why the Mosaic-GPU kernels cannot run here, or None: they need bf16, D and F (a tensor rank's slice)
    multiples of their 128-wide tiles, an H100/H200, and a jax built with Mosaic GPU (asked by
    `mlm_jax.validation`, which chooses the kernel)."""
    if platform != "gpu":
        return f"needs a Hopper GPU, and this run has {platform} devices"
    if not any(name in device_kind for name in ("H100", "H200")):
        return f"needs a Hopper GPU (H100/H200), not {device_kind}"
    if jnp.dtype(dtype) != jnp.bfloat16:
        return f"needs model.dtype=bfloat16, not {jnp.dtype(dtype)}"
    if D % 128 or F % 128:
        return f"needs model and (per tensor rank) expert ffn dims divisible by 128, got {D} and {F}"
    try:
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu  # noqa: F401
    except ImportError as e:
        return f"Mosaic GPU does not import ({e})"
    return None


def matmul_for(impl: str, padded: bool = True) -> GroupedMatmul:
    """The grouped matmul `impl` names: `ragged` (`jax.lax.ragged_dot`), `mgpu` (the Mosaic-GPU kernels, which
    `mlm_jax.validation` chose only where they run) or `mgpu-compile` (see the module). `padded`: some rows belong
    to no group (see `grouped_matmul`)."""
    if impl in ("mgpu", "mgpu-compile"):
        return _mgpu_matmul(padded, impl == "mgpu-compile")
    assert impl == "ragged", impl
    return jax.lax.ragged_dot
