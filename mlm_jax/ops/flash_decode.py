"""A decode step's attention over the key/value cache as one Pallas kernel (flash-decoding: the written slots split
among programs, their partial softmaxes combined after) that also scales, rotates and writes the new query, key and
value.

Each program takes one row, one K/V head and one span of slots and walks the span in pipelined blocks with an online
softmax in fp32. At one row the products run on the CUDA cores, with small blocks and few warps to keep many
programs, and so many loads, in flight. From MMA_ROWS rows they run on the tensor cores: a K/V head's G queries
repeated to the 16 rows of a tile (the cache's bytes set the time, not the products), bf16 operands summed in fp32
as in cuDNN's flash kernel; where one span covers a row's cache, each program writes its output itself, otherwise
XLA combines the spans in the fusion that feeds the output projection. What XLA would run as kernels of their own
happens inside: the folded norm's row scale of the new query, key and value, their RoPE, and both cache writes (the
program whose span holds the new slot stores the new key and value, the caches aliased in place); a fused q/k/v
product (`infer.blocks.CachedAttention`) is read as it is, with no slices of it made first, or as the few-row kernel's
partial products (`Product`), which each program sums for its head (XLA's product would split its sum too, then
reduce it in a fusion of its own). llama-1b's decode step on an H200 (RESULTS.md): at one row 0.854 to 0.860 ms
against 0.924 with cuDNN; at 32 rows 1.599 ms of kernel time against 1.644 (its attention 44.3 us a layer against
cuDNN's 44.2, two scatters and a rotation fusion fewer).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from mlm_jax.ops import gemv

PRODUCT = 8192  # elements of a block's [G, block, H] product, in the registers of one program
MAX_BLOCK = 32  # slots a step reads at most
WARPS = 2  # with 32-slot blocks: llama-1b's step at one row 0.909 ms against 0.948 with 4 warps and 64 slots
PROGRAMS = 512  # spans enough for this many programs (about four per SM of an H200)
MMA_ROWS = 2  # from this many rows, products on the tensor cores (llama-1b's attention alone: 12.4 against 14.3 us
# a layer at 2 rows, 9.1 against 10.8 at one; the one-row step was not compared)
MMA_M = 16  # the fewest rows of a tensor-core product
MMA_BLOCK, MMA_WARPS, MMA_STAGES = 32, 2, 3  # llama-1b's decode step at 32 rows: 1.525 and 1.508 ms against 1.560
# and 1.574 with 4 warps (4 stages 1.78, 2 stages 2.10), 2.01 with 8; with 2 warps 4 stages 1.71, 64-slot blocks 1.68
NEG = -1e30  # the running max before any slot: finite, so a span with no written slot adds exp(NEG - max) = 0
# (block_k, block_n, splits) of the fused q/k/v product run as the few-row kernel's partials (`Product`), in place
# of XLA's product, whose split sums took a 2.2 us reduction a layer (llama-1b at 32 rows: 1.530 ms a decode step
# against 1.545 with blocks of 32 x 64)
PRODUCT_BLOCKS = (64, 64, 4)


class Product(NamedTuple):
    """The fused q/k/v product's input and weight ([B, T, D], [D, K, G + 2, H], `infer.blocks.CachedAttention`), for
    `step` to run as the few-row kernel's partial products (`ops.gemv`), which its programs sum themselves."""
    x_BTD: jax.Array
    w_DKJH: jax.Array


def supports(q_shape: tuple[int, ...], cache_shape: tuple[int, ...], rotary_dim: int) -> bool:
    """Shapes the kernel takes (queries [B, T, N, H], a cache [B, C, K, H]): one query per row, power-of-two group
    and head dims (from MMA_ROWS rows a head dim of at least 32: each half of it a tensor-core product's depth), the
    whole head rotated, a block size that divides the cache."""
    B, T, N, H = q_shape
    C, K = cache_shape[1:3]
    G = N // K
    mma, block = _plan(B, G, H)
    return T == 1 and _pow2(G) and H >= (32 if mma else 2) and _pow2(H) and rotary_dim == H and C % block == 0


def step(new, cos_BTR: jax.Array, sin_BTR: jax.Array, k_BCKH: jax.Array, v_BCKH: jax.Array,
         positions_BT: jax.Array, row_scale_BT: jax.Array | None = None, *, scale: float,
         interpret: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One new position a row: the query, key and value (`new`: a tuple (q_BTNH, k_BTKH, v_BTKH), or one array
    [B, 1, K, G + 2, H], each K/V head's G queries, its key, its value: `Attention`'s fused product, read in place,
    or a `Product` to run first) times `row_scale_BT` (fp32, each rounded to its dtype after, as `Linear` does: a
    folded norm's 1 / rms), the query and key rotated by their RoPE tables (`rope.tables`, R = H / 2), the key and
    value written into slot `position mod C` of the cache, the query attending over the written slots (all of which
    it sees: a full cache, or a ring no longer than the window), scores times `scale`; K/V heads may be fewer than
    query heads (GQA).
    Returns (out_BTNH, k_BCKH, v_BCKH), the caches updated in place. Needs `supports`."""
    if isinstance(new, tuple) and not isinstance(new, Product):
        q_BTNH, k_BTKH, v_BTKH = new
        B, _, N, H = q_BTNH.shape
        K = k_BTKH.shape[2]
        G = N // K
        inputs = (q_BTNH.reshape(B, K, G, H), k_BTKH[:, 0], v_BTKH[:, 0])
    else:  # partial products [S, B, 1, K, G + 2, H], summed by the kernel
        partials = _partials(new, interpret) if isinstance(new, Product) else new[None]
        _, B, _, K, J, H = partials.shape
        G = J - 2
        inputs = (partials[:, :, 0],)
    C, dtype = k_BCKH.shape[1], k_BCKH.dtype
    mma, block = _plan(B, G, H)
    blocks = C // block
    per_span = min(blocks, max(1, blocks * B * K // PROGRAMS))  # blocks a program walks
    while blocks % per_span:
        per_span += 1
    spans = blocks // per_span
    slot_B = jnp.mod(positions_BT[:, 0], C).astype(jnp.int32)
    written_B = jnp.minimum(positions_BT[:, 0] + 1, C).astype(jnp.int32)
    row_scale_B = jnp.ones((B,), jnp.float32) if row_scale_BT is None else row_scale_BT[:, 0].astype(jnp.float32)
    if spans == 1:  # the output itself
        out_shape = [jax.ShapeDtypeStruct((B, K, G, H), dtype)]
        out_specs = [pl.BlockSpec((pl.squeezed, pl.squeezed, G, H), lambda b, k, s: (b, k, 0, 0))]
    else:  # each span's running max, sum and weighted values
        out_shape = [jax.ShapeDtypeStruct((B, K, spans, *shape), jnp.float32) for shape in ((G,), (G,), (G, H))]
        out_specs = [_span_spec(shape) for shape in ((G,), (G,), (G, H))]
    operands = (written_B, slot_B, row_scale_B, *inputs, cos_BTR[:, 0], sin_BTR[:, 0], k_BCKH, v_BCKH)
    anywhere = pl.BlockSpec(memory_space=pl.ANY)
    *out, k_BCKH, v_BCKH = pl.pallas_call(
        functools.partial(_span, G=G, new=len(inputs), mma=mma, block=block, per_span=per_span, scale=scale),
        out_shape=[*out_shape, jax.ShapeDtypeStruct(k_BCKH.shape, k_BCKH.dtype),
                   jax.ShapeDtypeStruct(v_BCKH.shape, v_BCKH.dtype)],
        grid=(B, K, spans),
        in_specs=[anywhere] * len(operands),
        out_specs=[*out_specs, anywhere, anywhere],
        input_output_aliases={len(operands) - 2: len(out_shape), len(operands) - 1: len(out_shape) + 1},
        compiler_params=pltriton.CompilerParams(num_warps=MMA_WARPS if mma else WARPS,
                                                num_stages=MMA_STAGES if mma else 3),
        interpret=interpret,
    )(*operands)
    if spans == 1:
        out_BKGH = out[0]
    else:
        max_BKSG, sum_BKSG, acc_BKSGH = out
        weight_BKSG = jnp.exp(max_BKSG - max_BKSG.max(2, keepdims=True))
        out_BKGH = (weight_BKSG[..., None] * acc_BKSGH).sum(2) / (weight_BKSG * sum_BKSG).sum(2)[..., None]
    return out_BKGH.reshape(B, 1, K * G, H).astype(dtype), k_BCKH, v_BCKH


def _span(*refs, G, new, mma, block, per_span, scale):
    """Program (b, k, s): row b, K/V head k, the s-th span of `per_span` blocks of slots. `new`: how many refs hold
    the new query, key and value (one: the fused product)."""
    written_ref, slot_ref, row_scale_ref = refs[:3]
    cos_ref, sin_ref, k_ref, v_ref = refs[3 + new:7 + new]
    out_refs, (k_out_ref, v_out_ref) = refs[7 + new:-2], refs[-2:]
    b, k, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    H = k_ref.shape[-1]
    R = H // 2
    lo, hi = pl.ds(0, R), pl.ds(R, R)
    dtype = k_ref.dtype  # the model's, of the products too
    rounded = lambda x, dtype: x.astype(dtype).astype(jnp.float32)  # noqa: E731
    if new == 1:  # [S, B, K, G + 2, H] partial products: their fp32 sum rounded, as the summed product
        y_ref = refs[3]

        def summed(*at):
            return rounded(sum(y_ref[(s, b, k, *at)].astype(jnp.float32) for s in range(y_ref.shape[0])), dtype)

        q_half, k_half, v_new = (lambda h: summed(pl.ds(0, G), h)), (lambda h: summed(G, h)), summed(G + 1, slice(None))
    else:
        q_ref, k_new_ref, v_new_ref = refs[3:6]
        q_half, k_half = (lambda h: q_ref[b, k, :, h]), (lambda h: k_new_ref[b, k, h])
        v_new = v_new_ref[b, k, :]
    written, slot = written_ref[b], slot_ref[b]
    cos_R, sin_R, row_scale = cos_ref[b, :], sin_ref[b, :], row_scale_ref[b]
    scaled = lambda x: rounded(x.astype(jnp.float32) * row_scale, dtype)  # noqa: E731  (as `Linear`)

    def rotated(x1, x2, dtype):  # as `rope.apply_rope`: in fp32, rounded to the model's dtype
        return rounded(x1 * cos_R - x2 * sin_R, dtype), rounded(x2 * cos_R + x1 * sin_R, dtype)

    q1_GR, q2_GR = rotated(scaled(q_half(lo)), scaled(q_half(hi)), dtype)
    k1_R, k2_R = rotated(scaled(k_half(lo)), scaled(k_half(hi)), dtype)
    v_H = rounded(scaled(v_new), dtype)
    start = s * per_span * block
    steps = jnp.clip((written - start + block - 1) // block, 0, per_span)  # blocks holding written slots
    M = max(G, MMA_M) if mma else G
    operands = dtype if mma else jnp.float32  # the loaded keys and values: the cache's dtype for the tensor cores
    if mma:  # the queries repeated to M rows (row r holds query r // (M / G)), in the cache's dtype for the products
        precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
        q1_MR, q2_MR = (jnp.broadcast_to(x[:, None], (G, M // G, R)).reshape(M, R).astype(dtype)
                        for x in (q1_GR, q2_GR))
    else:
        q1_GR, q2_GR = q1_GR * scale, q2_GR * scale

    def block_step(i, carry):
        m_M, l_M, acc_MH = carry
        first = pl.multiple_of(start + i * block, block)
        slots = pl.ds(first, block)
        index_L1 = first + jax.lax.broadcasted_iota(jnp.int32, (block, 1), 0)
        fresh_L1 = index_L1 == slot  # the new position's slot: its key and value are the new ones
        k1_LR, k2_LR, v_LH = (jnp.where(fresh_L1, x[None].astype(operands), ref[b, slots, k, part].astype(operands))
                              for x, ref, part in ((k1_R, k_ref, lo), (k2_R, k_ref, hi), (v_H, v_ref, slice(None))))
        if mma:
            s_ML = (_dot(q1_MR, k1_LR, 1, precision) + _dot(q2_MR, k2_LR, 1, precision)) * scale
        else:  # products on the CUDA cores
            s_ML = (q1_GR[:, None, :] * k1_LR[None]).sum(-1) + (q2_GR[:, None, :] * k2_LR[None]).sum(-1)
        s_ML = jnp.where(index_L1[:, 0][None] < written, s_ML, -jnp.inf)
        m_new_M = jnp.maximum(m_M, s_ML.max(-1))
        p_ML = jnp.exp(s_ML - m_new_M[:, None])
        alpha_M = jnp.exp(m_M - m_new_M)
        if mma:
            pv_MH = _dot(p_ML.astype(dtype), v_LH, 0, precision)
        else:
            pv_MH = (p_ML[:, :, None] * v_LH[None]).sum(1)
        return m_new_M, l_M * alpha_M + p_ML.sum(-1), acc_MH * alpha_M[:, None] + pv_MH

    init = (jnp.full((M,), NEG, jnp.float32), jnp.zeros((M,), jnp.float32), jnp.zeros((M, H), jnp.float32))
    m_M, l_M, acc_MH = jax.lax.fori_loop(0, steps, block_step, init)
    if M > G:  # each query's first row
        first_M1 = jax.lax.broadcasted_iota(jnp.int32, (M, 1), 0) % (M // G) == 0
        m_M, l_M = (jnp.where(first_M1[:, 0], x, 0.0).reshape(G, M // G).sum(1) for x in (m_M, l_M))
        acc_MH = jnp.where(first_M1, acc_MH, 0.0).reshape(G, M // G, H).sum(1)
    if len(out_refs) == 1:
        out_refs[0][...] = (acc_MH / l_M[:, None]).astype(out_refs[0].dtype)
    else:
        out_refs[0][...], out_refs[1][...], out_refs[2][...] = m_M, l_M, acc_MH

    @pl.when((slot >= start) & (slot < start + per_span * block))
    def _write():
        k_out_ref[b, slot, k, lo] = k1_R.astype(k_out_ref.dtype)
        k_out_ref[b, slot, k, hi] = k2_R.astype(k_out_ref.dtype)
        v_out_ref[b, slot, k, :] = v_H.astype(v_out_ref.dtype)


def _partials(product: Product, interpret: bool) -> jax.Array:
    """The fused q/k/v product as [S, B, T, K, G + 2, H] partials: the few-row kernel's in PRODUCT_BLOCKS where they
    divide the shapes, else XLA's product as the one partial."""
    x_BTD, w_DKJH = product
    (B, T, D), N = x_BTD.shape, w_DKJH[0].size
    if PRODUCT_BLOCKS is None or B * T > gemv.MAX_ROWS:
        return jnp.einsum("btd,dkjh->btkjh", x_BTD, w_DKJH)[None]
    block_k, block_n, splits = PRODUCT_BLOCKS
    if D % (block_k * splits) or N % block_n:
        return jnp.einsum("btd,dkjh->btkjh", x_BTD, w_DKJH)[None]
    y_SMN = gemv.matmul(x_BTD.reshape(B * T, D), w_DKJH.reshape(D, N), block_k=block_k, block_n=block_n,
                        splits=splits, num_stages=4, summed=False, interpret=interpret)
    return y_SMN.reshape(splits, B, T, *w_DKJH.shape[1:])


def _span_spec(shape: tuple[int, ...]) -> pl.BlockSpec:
    """Program (b, k, s)'s block of a [B, K, spans, *shape] output."""
    return pl.BlockSpec((pl.squeezed, pl.squeezed, pl.squeezed, *shape), lambda b, k, s: (b, k, s, *(0,) * len(shape)))


def _plan(B: int, G: int, H: int) -> tuple[bool, int]:
    """(products on the tensor cores, slots a step reads) for B rows of G queries a K/V head."""
    mma = B >= MMA_ROWS
    return mma, MMA_BLOCK if mma else _block(G, H)


def _dot(a: jax.Array, b: jax.Array, b_contracting: int, precision) -> jax.Array:
    """a @ b (b_contracting 0) or a @ b.T (1), summed in fp32 on the tensor cores."""
    return jax.lax.dot_general(a, b, (((1,), (b_contracting,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)


def _block(G: int, H: int) -> int:
    """Slots a step reads: the largest power of two up to MAX_BLOCK whose [G, block, H] product fits PRODUCT, and
    at least 16."""
    return max(16, min(MAX_BLOCK, PRODUCT // (G * H)))


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0
