"""Products of a few rows (decode steps) with a weight matrix, as a Pallas kernel that reads the weight at memory
bandwidth.

XLA rewrites a product whose operands hold fewer than 10M elements into a multiply and a reduction when its left
side has one row, and the reduction over a weight's leading dims reads it at a fraction of the bandwidth (0.5 TB/s
for the attention's output projection on an H200). Here each program multiplies the rows by one column block of the
weight over one slice of the contracted dim, walking the slice in pipelined steps (on the tensor cores from 5 rows
on, padded to their tile height), and writes an fp32 partial product; the partials over the slices are summed
outside: by XLA, which fuses the sum into whatever consumes the product, or by a consumer that takes them as they are
(`add_residual`, `ops.flash_decode.step`).

`add_residual` is a decode step's residual add, with the sum of a product's partials, in one kernel that also leaves
each block's sum of squares for the next RMSNorm's row factor (`RowFactor`). `gated`, a gated MLP's fused gate and
up product with its activation, finishes that factor itself: every kernel XLA would launch between them costs a
decode step 1 to 2 us. The attention takes XLA's factor (finished inside `ops.flash_decode`, it cost 11 us a
layer).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

MAX_ROWS = 64  # more rows: XLA's GEMMs are faster
ROW_TILE = 16  # the tensor cores' tile height; from 5 to 15 rows are padded to it (the weight's bytes set the time)
RESIDUAL_BLOCK, RESIDUAL_WARPS = 256, 4  # `add_residual`'s columns a program, its warps (one program a row
# walking it took 4.3 us a layer for llama-1b's output projection at 32 rows: 8 partials of 2048 columns)
SUM_ROWS = 4  # up to this many rows (rounded up to a power of two), multiplied and summed on the CUDA cores
# (block_k, block_n, programs) up to SUM_ROWS rows and beyond (None: one step a program), measured on an H200
# (llama-1b's output projection: 3.9 us at one row, 6.9 at 32)
FEW, MANY = (32, 128, 1024), (256, 128, None)
GATED = (64, 64, 4, 4)  # `gated`'s (block_k, block_n, warps, stages): llama-1b's decode step at 32 rows 1.545 ms
# against 1.557 and 1.572 with XLA's product, activation and factor (1.586 with XLA's factor; 64 x 128 1.630)
SPLIT = (32, 64, 16)  # (block_k, block_n, splits) of a product over one contracted dim summed by its consumer
# (llama-1b's down projection at 32 rows: a decode step of 1.540 ms against 1.568 with 8 splits, 1.559 with XLA's)


def einsum(equation: str, x: jax.Array, kernel: jax.Array, *, config: tuple[int, int, int] | None = None,
           summed: bool = True, interpret: bool = False) -> jax.Array:
    """`jnp.einsum(equation, x, kernel)`, through `matmul` where the equation contracts x's trailing dims with the
    kernel's leading ones (every `model.linear.Linear`'s does), x has at most MAX_ROWS rows of 16-bit floats (or
    `interpret`, which runs any dtype on any device) and blocks of at least 16 divide the weight; otherwise XLA's
    einsum. Without a `config` ((block_k, block_n, splits)), a product over one contracted dim stays with XLA:
    alone the kernel is faster at one row (llama-1b's down projection 6.7 against 15.8 us), but in a decode step
    it was not (gate and up 8.4 against 7.5 us each, the output head ten times slower: RESULTS.md).

    `summed=False`: the partial products over slices of the contracted dims, [S, *product's shape], whose fp32 sum
    rounded to x's dtype is the product, for a consumer that sums them itself (`add_residual`). A product over one
    contracted dim then goes to the kernel in SPLIT blocks where they divide it (XLA would split it too, and sum
    in a reduction of its own); where XLA takes the product, it is the one partial."""
    c = _contracted(equation)

    def xla():
        y = jnp.einsum(equation, x, kernel)
        return y if summed else y[None]

    if c is None or not (interpret or x.dtype in (jnp.bfloat16, jnp.float16)):
        return xla()
    lead, out_dims = x.shape[:x.ndim - c], kernel.shape[c:]
    M, K, N = math.prod(lead), math.prod(x.shape[x.ndim - c:]), math.prod(out_dims)
    if config is None and c == 1:
        if summed or SPLIT is None or K % (SPLIT[0] * SPLIT[2]) or N % SPLIT[1]:
            return xla()
        config = SPLIT
    config = config or blocks_for(M, K, N)
    if M > MAX_ROWS or config is None:
        return xla()
    block_k, block_n, splits = config
    y = matmul(x.reshape(M, K), kernel.reshape(K, N), block_k=block_k, block_n=block_n, splits=splits,
               summed=summed, interpret=interpret)
    return y.reshape(*y.shape[:-2], *lead, *out_dims)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["squares"], meta_fields=["dim", "eps"])
@dataclasses.dataclass(frozen=True)
class RowFactor:
    """An RMSNorm's row factor as `add_residual` leaves it: each column block's sum of squares ([..., C], fp32) of
    rows of `dim` columns. A kernel that takes it finishes it (`finish`); `factor` gives it to anything else."""
    squares: jax.Array
    dim: int
    eps: float

    def in_kernel(self) -> bool:
        """Whether a kernel can load a row's sums at once (a power of two of them)."""
        C = self.squares.shape[-1]
        return C & (C - 1) == 0


def factor(row_scale: jax.Array | RowFactor | None) -> jax.Array | None:
    """A row factor [..., 1] (fp32): `row_scale` itself, or a `RowFactor` finished."""
    if not isinstance(row_scale, RowFactor):
        return row_scale
    return finish(row_scale.squares, row_scale.dim, row_scale.eps, keepdims=True)


def finish(squares: jax.Array, dim: int, eps: float, keepdims: bool = False) -> jax.Array:
    """1 / sqrt(mean square + eps) from the sums of squares in the last dim (inside kernels too)."""
    return jax.lax.rsqrt(jnp.sum(squares, -1, keepdims=keepdims) / dim + eps)


def gated(x_BSD: jax.Array, w_D2F: jax.Array, row_scale: jax.Array | RowFactor | None, activation, *,
          interpret: bool = False) -> jax.Array | None:
    """A gated MLP's hidden rows, act(g) * u, from its fused gate/up kernel (`infer.blocks.DecodeMLP`): g and u the
    products of x with w[:, 0] and w[:, 1], each rounded to x's dtype and times the row's factor (rounded again,
    as `Linear` does), the gate's activation (a function: `mlp.GATES`) and product in fp32, rounded once. One
    program a column block of both products walks the whole contracted dim in pipelined steps, so that the
    activation runs on its sums and no XLA kernel stands between this product and the down projection's; a
    `RowFactor` is finished here. None (the caller's XLA product) unless x has at most MAX_ROWS rows of 16-bit
    floats (or `interpret`: any dtype) and GATED's blocks divide D and F."""
    *lead, D = x_BSD.shape
    F = w_D2F.shape[-1]
    M = math.prod(lead)
    if (GATED is None or M > MAX_ROWS or D % GATED[0] or F % GATED[1]
            or not (interpret or x_BSD.dtype in (jnp.bfloat16, jnp.float16))):
        return None
    rows = max(pl.next_power_of_2(M), ROW_TILE)
    block_k, block_n, warps, stages = GATED
    x_RD = jnp.pad(x_BSD.reshape(M, D).astype(w_D2F.dtype), ((0, rows - M), (0, 0)))
    dim = eps = None
    if row_scale is None:
        scale_R = jnp.ones((rows,), jnp.float32)
    elif isinstance(row_scale, RowFactor) and row_scale.in_kernel():
        dim, eps = row_scale.dim, row_scale.eps
        squares_MC = row_scale.squares.reshape(M, -1).astype(jnp.float32)
        scale_R = jnp.pad(squares_MC, ((0, rows - M), (0, 0)))
    else:
        scale_R = jnp.pad(factor(row_scale).reshape(M).astype(jnp.float32), (0, rows - M))
    h_RF = pl.pallas_call(
        functools.partial(_gated, block_k=block_k, block_n=block_n, steps=D // block_k, dim=dim, eps=eps,
                          activation=activation),
        out_shape=jax.ShapeDtypeStruct((rows, F), x_BSD.dtype),
        grid=(F // block_n,),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * 3,
        out_specs=pl.BlockSpec((rows, block_n), lambda n: (0, n)),
        compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
    )(x_RD, w_D2F, scale_R)
    return h_RF[:M].reshape(*lead, F)


def _gated(x_ref, w_ref, scale_ref, out_ref, *, block_k, block_n, steps, dim, eps, activation):
    """Program n: column block n of the gate and up products; `dim` set: `scale_ref` holds sums of squares."""
    columns = pl.ds(pl.multiple_of(pl.program_id(0) * block_n, block_n), block_n)
    dtype = out_ref.dtype

    def step(i, acc):
        g_RN, u_RN = acc
        k = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
        x_RK = x_ref[:, k]
        return (g_RN + jnp.dot(x_RK, w_ref[k, 0, columns], preferred_element_type=jnp.float32),
                u_RN + jnp.dot(x_RK, w_ref[k, 1, columns], preferred_element_type=jnp.float32))

    zeros = jnp.zeros(out_ref.shape, jnp.float32)
    g_RN, u_RN = jax.lax.fori_loop(0, steps, step, (zeros, zeros))
    scale_R1 = (finish(scale_ref[...], dim, eps) if dim is not None else scale_ref[...])[:, None]
    rounded = lambda y: y.astype(dtype).astype(jnp.float32)
    g_RN, u_RN = (rounded(rounded(y) * scale_R1) for y in (g_RN, u_RN))
    out_ref[...] = (activation(g_RN) * u_RN).astype(dtype)


def blocks_for(M: int, K: int, N: int) -> tuple[int, int, int] | None:
    """(block_k, block_n, splits) for an M x K by K x N product (FEW or MANY): the contracted dim split into the
    fewest slices that make the target count of programs, or, for MANY, into single steps; None where no
    power-of-two block of at least 16 divides K or N."""
    target_k, target_n, programs = FEW if M <= SUM_ROWS else MANY
    block_k, block_n = _block(K, target_k), _block(N, target_n)
    if block_k is None or block_n is None:
        return None
    steps = K // block_k
    if programs is None:
        return block_k, block_n, steps
    enough = (d for d in range(1, steps + 1) if steps % d == 0 and (N // block_n) * d >= programs)
    return block_k, block_n, next(enough, steps)


def matmul(x_MK: jax.Array, w_KN: jax.Array, *, block_k: int, block_n: int, splits: int, num_warps: int = 4,
           num_stages: int = 3, summed: bool = True, interpret: bool = False) -> jax.Array:
    """x @ w in x's dtype, fp32 accumulation, as `splits` fp32 partial products over slices of K summed outside
    (`summed=False`: the partials themselves, [splits, M, N]); each program walks its slice in `block_k` steps
    (pipelined loads) for one `block_n` column block. Blocks are powers of two; `block_n` divides N and
    `splits * block_k` divides K."""
    M, K = x_MK.shape
    N = w_KN.shape[1]
    rows = pl.next_power_of_2(M)
    rows = rows if rows <= SUM_ROWS else max(rows, ROW_TILE)
    x_RK = jnp.pad(x_MK.astype(w_KN.dtype), ((0, rows - M), (0, 0)))
    steps = K // (splits * block_k)
    partial_SRN = pl.pallas_call(
        functools.partial(_split_product, block_k=block_k, block_n=block_n, steps=steps),
        out_shape=jax.ShapeDtypeStruct((splits, rows, N), jnp.float32),
        grid=(N // block_n, splits),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((pl.squeezed, rows, block_n), lambda n, s: (s, 0, n)),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
    )(x_RK, w_KN)
    return partial_SRN[:, :M].sum(0).astype(x_MK.dtype) if summed else partial_SRN[:, :M]


def _split_product(x_ref, w_ref, out_ref, *, block_k, block_n, steps):
    n, s = pl.program_id(0), pl.program_id(1)
    rows = out_ref.shape[0]
    columns = pl.ds(pl.multiple_of(n * block_n, block_n), block_n)

    def step(i, acc):
        k = pl.ds(pl.multiple_of((s * steps + i) * block_k, block_k), block_k)
        x_RK, w_KN = x_ref[:, k], w_ref[k, columns]
        if rows <= SUM_ROWS:  # elementwise into a [rows, block_k, block_n] accumulator, summed once at the end
            return acc + x_RK[:, :, None].astype(jnp.float32) * w_KN[None].astype(jnp.float32)
        return acc + jnp.dot(x_RK, w_KN, preferred_element_type=jnp.float32)

    shape = (rows, block_k, block_n) if rows <= SUM_ROWS else (rows, block_n)
    acc = jax.lax.fori_loop(0, steps, step, jnp.zeros(shape, jnp.float32))
    out_ref[...] = acc.sum(1) if rows <= SUM_ROWS else acc


def add_residual(x_BTD: jax.Array, partials_SBTD: jax.Array, eps: float, *,
                 interpret: bool = False) -> tuple[jax.Array, jax.Array | RowFactor]:
    """(x + y, the RMSNorm factor of x + y: 1 / sqrt(mean((x + y)^2) + eps), a `RowFactor`), where y is the
    product whose partials (`einsum(..., summed=False)`) are `partials_SBTD`: their fp32 sum rounded to x's
    dtype, added in fp32 and rounded again, as XLA adds the summed product. One program a row and block of up to
    RESIDUAL_BLOCK columns, which loads the block of every partial at once where their count is a power of two and
    writes its sum of squares. A model dim with no power-of-two block of at least 16 goes to XLA, whose factor is
    an array [B, T, 1]."""
    *lead, D = x_BTD.shape
    M, S = math.prod(lead), partials_SBTD.shape[0]
    block = _block(D, RESIDUAL_BLOCK)
    if block is None:
        x_BTD = x_BTD + partials_SBTD.astype(jnp.float32).sum(0).astype(x_BTD.dtype)
        x32 = x_BTD.astype(jnp.float32)
        return x_BTD, finish(x32 * x32, D, eps, keepdims=True)
    out_MD, squares_MC = pl.pallas_call(
        functools.partial(_residual, block=block),
        out_shape=[jax.ShapeDtypeStruct((M, D), x_BTD.dtype), jax.ShapeDtypeStruct((M, D // block), jnp.float32)],
        grid=(M, D // block),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * 2,
        out_specs=[pl.BlockSpec(memory_space=pl.ANY)] * 2,
        compiler_params=pltriton.CompilerParams(num_warps=RESIDUAL_WARPS, num_stages=1),
        interpret=interpret,
    )(x_BTD.reshape(M, D), partials_SBTD.reshape(S, M, D))
    return out_MD.reshape(x_BTD.shape), RowFactor(squares_MC.reshape(*lead, D // block), D, eps)


def _residual(x_ref, p_ref, out_ref, squares_ref, *, block):
    """Program (m, c): row m, column block c."""
    m, c = pl.program_id(0), pl.program_id(1)
    S = p_ref.shape[0]
    dtype = out_ref.dtype
    cols = pl.ds(pl.multiple_of(c * block, block), block)
    if S & (S - 1) == 0:
        y = p_ref[:, m, cols].astype(jnp.float32).sum(0)
    else:
        y = jax.lax.fori_loop(0, S, lambda s, acc: acc + p_ref[s, m, cols].astype(jnp.float32),
                              jnp.zeros((block,), jnp.float32))
    x = (x_ref[m, cols].astype(jnp.float32) + y.astype(dtype).astype(jnp.float32)).astype(dtype)
    out_ref[m, cols] = x
    x32 = x.astype(jnp.float32)
    squares_ref[m, c] = jnp.sum(x32 * x32)


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
