"""Products of a few rows (decode steps) with a weight matrix, as a Pallas kernel that reads the weight at memory
bandwidth.

XLA rewrites a product whose operands hold fewer than 10M elements into a multiply and a reduction when its left
side has one row, and the reduction over a weight's leading dims reads it at a fraction of the bandwidth (0.5 TB/s
for the attention's output projection on an H200). Here each program multiplies the rows by one tile of the weight
(a slice of the contracted dim by a slice of the output dim), on the tensor cores from 5 rows on (padded to their
tile height), and writes an fp32 partial product; the partials over the contracted dim are summed outside, where XLA
fuses the sum into whatever consumes the product.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

MAX_ROWS = 64  # more rows: XLA's GEMMs are faster
ROW_TILE = 16  # the tensor cores' tile height; from 5 to 15 rows are padded to it (the weight's bytes set the time)
SUM_ROWS = 4  # up to this many rows (rounded up to a power of two), multiplied and summed on the CUDA cores
BLOCKS = {True: (128, 64), False: (256, 128)}  # (block_k, block_n) for up to SUM_ROWS rows or more: measured on
# an H200 for the attention output projection of llama-1b (a 2048 x 2048 bf16 weight: 5.9 us at 1 row, 6.9 at 32)


def einsum(equation: str, x: jax.Array, kernel: jax.Array, *, blocks: tuple[int, int] | None = None,
           interpret: bool = False) -> jax.Array:
    """`jnp.einsum(equation, x, kernel)`, through `matmul` where the equation contracts x's trailing dims with the
    kernel's leading ones (every `layers.linear.Linear`'s does), x has at most MAX_ROWS rows of 16-bit floats (or
    `interpret`, which runs any dtype on any device) and the blocks divide the weight; otherwise XLA's einsum."""
    c = _contracted(equation)
    if c is None or not (interpret or x.dtype in (jnp.bfloat16, jnp.float16)):
        return jnp.einsum(equation, x, kernel)
    lead, out_dims = x.shape[:x.ndim - c], kernel.shape[c:]
    M, K, N = math.prod(lead), math.prod(x.shape[x.ndim - c:]), math.prod(out_dims)
    block_k, block_n = blocks or BLOCKS[M <= SUM_ROWS]
    bk, bn = _block(K, block_k), _block(N, block_n)
    if M > MAX_ROWS or bk is None or bn is None:
        return jnp.einsum(equation, x, kernel)
    y_MN = matmul(x.reshape(M, K), kernel.reshape(K, N), block_k=bk, block_n=bn, interpret=interpret)
    return y_MN.reshape(*lead, *out_dims)


def matmul(x_MK: jax.Array, w_KN: jax.Array, *, block_k: int, block_n: int, num_warps: int = 4,
           interpret: bool = False) -> jax.Array:
    """x @ w in x's dtype, fp32 accumulation; `block_k` and `block_n` (powers of two) divide K and N."""
    M, K = x_MK.shape
    N = w_KN.shape[1]
    rows = pl.next_power_of_2(M)
    rows = rows if rows <= SUM_ROWS else max(rows, ROW_TILE)
    x_RK = jnp.pad(x_MK.astype(w_KN.dtype), ((0, rows - M), (0, 0)))
    S = K // block_k
    partial_SRN = pl.pallas_call(
        _tile_product,
        out_shape=jax.ShapeDtypeStruct((S, rows, N), jnp.float32),
        grid=(N // block_n, S),
        in_specs=[pl.BlockSpec((rows, block_k), lambda n, s: (0, s)),
                  pl.BlockSpec((block_k, block_n), lambda n, s: (s, n))],
        out_specs=pl.BlockSpec((pl.squeezed, rows, block_n), lambda n, s: (s, 0, n)),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
    )(x_RK, w_KN)
    return partial_SRN[:, :M].sum(0).astype(x_MK.dtype)


def _tile_product(x_ref, w_ref, out_ref):
    x_RK, w_KN = x_ref[...], w_ref[...]
    if x_RK.shape[0] <= SUM_ROWS:
        out_ref[...] = jnp.sum(x_RK[:, :, None].astype(jnp.float32) * w_KN[None].astype(jnp.float32), axis=1)
    else:
        out_ref[...] = jnp.dot(x_RK, w_KN, preferred_element_type=jnp.float32)


@functools.cache
def _contracted(equation: str) -> int | None:
    """How many trailing dims of x the equation contracts with the kernel's leading dims, where the output is x's
    other dims then the kernel's (a plain matrix product after reshapes); None for any other equation."""
    inputs, out = equation.replace(" ", "").split("->")
    xs, ks = inputs.split(",")
    c = len(set(xs) & set(ks))
    if c == 0 or len(set(xs + ks)) != len(xs) + len(ks) - c:
        return None
    if xs[len(xs) - c:] != ks[:c] or out != xs[:len(xs) - c] + ks[c:]:
        return None
    return c


def _block(n: int, target: int) -> int | None:
    """The largest power of two up to `target` that divides n, if at least 16 (the tensor cores' tile)."""
    b = math.gcd(n, target) if target & (target - 1) == 0 else None
    return b if b is not None and b >= 16 else None
