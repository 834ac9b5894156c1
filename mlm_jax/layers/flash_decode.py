"""A decode step's attention at one row, as one Pallas kernel (flash-decoding: the written slots split among many
programs, their partial softmaxes combined after) that also scales, rotates and writes the new query, key and value.

At one query per row, cuDNN's flash kernel runs a 16-row query tile and a split reduction of its own: 8.8 us a
layer to read llama-1b's 5.2 MB cache at one row (RESULTS.md). Here each program takes one row, one K/V head and one
span of slots, walks the span in pipelined blocks with an online softmax in fp32 (products on the CUDA cores: a
K/V head's G queries are too few rows for the tensor cores), and writes its running max, sum and weighted values;
XLA combines the spans in the fusion that feeds the output projection. Small blocks and few warps keep many
programs, and so many loads, in flight. What XLA would run as kernels of their own happens inside: the folded
norm's row scale of the new query, key and value, their RoPE, and both cache writes (the program whose span holds
the new slot stores the new key and value, the caches aliased in place). llama-1b's decode step at one row on an
H200: 0.854 to 0.860 ms against 0.924 with cuDNN; from two rows on cuDNN is faster (RESULTS.md), so the kernel takes
one, though it computes any number.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

MAX_ROWS = 1  # llama-1b's step on an H200, cuDNN against this kernel: 0.97 against 1.00 ms at 2 rows, 1.00 against 1.10 at 4
PRODUCT = 8192  # elements of a block's [G, block, H] product, in the registers of one program
MAX_BLOCK = 32  # slots a step reads at most
WARPS = 2  # with 32-slot blocks: llama-1b's step at one row 0.909 ms against 0.948 with 4 warps and 64 slots
PROGRAMS = 512  # spans enough for this many programs (about four per SM of an H200)
NEG = -1e30  # the running max before any slot: finite, so a span with no written slot adds exp(NEG - max) = 0


def supports(q_shape: tuple[int, ...], cache_shape: tuple[int, ...], rotary_dim: int) -> bool:
    """Shapes the kernel takes (queries [B, T, N, H], a cache [B, C, K, H]): one query per row, at most MAX_ROWS
    rows, power-of-two group and head dims, the whole head rotated, a block size that divides the cache."""
    B, T, N, H = q_shape
    C, K = cache_shape[1:3]
    G = N // K
    return (T == 1 and B <= MAX_ROWS and _pow2(G) and H >= 2 and _pow2(H) and rotary_dim == H
            and C % _block(G, H) == 0)


def step(q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array, cos_BTR: jax.Array, sin_BTR: jax.Array,
         k_BCKH: jax.Array, v_BCKH: jax.Array, positions_BT: jax.Array, row_scale_BT: jax.Array | None = None, *,
         scale: float, interpret: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One new position a row: the query, key and value times `row_scale_BT` (fp32, each rounded to its dtype
    after, as `Linear` does: a folded norm's 1 / rms), the query and key rotated by their RoPE tables
    (`rope.tables`, R = H / 2), the key and value written into slot `position mod C` of the cache, the query
    attending over the written slots (all of which it sees: a full cache, or a ring no longer than the window),
    scores times `scale`; K/V heads may be fewer than query heads (GQA). Returns (out_BTNH, k_BCKH, v_BCKH), the
    caches updated in place. Needs `supports`."""
    B, _, N, H = q_BTNH.shape
    C, K = k_BCKH.shape[1:3]
    G = N // K
    block = _block(G, H)
    blocks = C // block
    per_span = min(blocks, max(1, blocks * B * K // PROGRAMS))  # blocks a program walks
    while blocks % per_span:
        per_span += 1
    spans = blocks // per_span
    slot_B = jnp.mod(positions_BT[:, 0], C).astype(jnp.int32)
    written_B = jnp.minimum(positions_BT[:, 0] + 1, C).astype(jnp.int32)
    row_scale_B = jnp.ones((B,), jnp.float32) if row_scale_BT is None else row_scale_BT[:, 0].astype(jnp.float32)
    new = (row_scale_B, q_BTNH.reshape(B, K, G, H), k_BTKH[:, 0], v_BTKH[:, 0], cos_BTR[:, 0], sin_BTR[:, 0])
    out_shape = [jax.ShapeDtypeStruct((B, K, spans, *shape), jnp.float32) for shape in ((G,), (G,), (G, H))]
    spec = lambda *shape: pl.BlockSpec((pl.squeezed, pl.squeezed, pl.squeezed, *shape),  # noqa: E731
                                       lambda b, k, s: (b, k, s, *(0,) * len(shape)))
    anywhere = pl.BlockSpec(memory_space=pl.ANY)
    max_BKSG, sum_BKSG, acc_BKSGH, k_BCKH, v_BCKH = pl.pallas_call(
        functools.partial(_span, block=block, per_span=per_span, scale=scale),
        out_shape=[*out_shape, jax.ShapeDtypeStruct(k_BCKH.shape, k_BCKH.dtype),
                   jax.ShapeDtypeStruct(v_BCKH.shape, v_BCKH.dtype)],
        grid=(B, K, spans),
        in_specs=[anywhere] * 10,
        out_specs=[spec(G), spec(G), spec(G, H), anywhere, anywhere],
        input_output_aliases={8: 3, 9: 4},
        compiler_params=pltriton.CompilerParams(num_warps=WARPS, num_stages=3),
        interpret=interpret,
    )(written_B, slot_B, *new, k_BCKH, v_BCKH)
    weight_BKSG = jnp.exp(max_BKSG - max_BKSG.max(2, keepdims=True))
    out_BKGH = (weight_BKSG[..., None] * acc_BKSGH).sum(2) / (weight_BKSG * sum_BKSG).sum(2)[..., None]
    return out_BKGH.reshape(B, 1, N, H).astype(q_BTNH.dtype), k_BCKH, v_BCKH


def _span(written_ref, slot_ref, row_scale_ref, q_ref, k_new_ref, v_new_ref, cos_ref, sin_ref, k_ref, v_ref,
          max_ref, sum_ref, acc_ref, k_out_ref, v_out_ref, *, block, per_span, scale):
    b, k, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    G, H = acc_ref.shape
    R = H // 2
    lo, hi = pl.ds(0, R), pl.ds(R, R)
    written, slot = written_ref[b], slot_ref[b]
    cos_R, sin_R, row_scale = cos_ref[b, :], sin_ref[b, :], row_scale_ref[b]
    rounded = lambda x, dtype: x.astype(dtype).astype(jnp.float32)  # noqa: E731
    scaled = lambda x: rounded(x.astype(jnp.float32) * row_scale, x.dtype)  # noqa: E731  (as `Linear`)

    def rotated(x1, x2, dtype):  # as `rope.apply_rope`: in fp32, rounded to the model's dtype
        return rounded(x1 * cos_R - x2 * sin_R, dtype), rounded(x2 * cos_R + x1 * sin_R, dtype)

    q1_GR, q2_GR = rotated(scaled(q_ref[b, k, :, lo]), scaled(q_ref[b, k, :, hi]), q_ref.dtype)
    q1_GR, q2_GR = q1_GR * scale, q2_GR * scale
    k1_R, k2_R = rotated(scaled(k_new_ref[b, k, lo]), scaled(k_new_ref[b, k, hi]), k_ref.dtype)
    v_H = rounded(scaled(v_new_ref[b, k, :]), v_ref.dtype)
    start = s * per_span * block
    steps = jnp.clip((written - start + block - 1) // block, 0, per_span)  # blocks holding written slots

    def block_step(i, carry):
        m_G, l_G, acc_GH = carry
        first = pl.multiple_of(start + i * block, block)
        slots = pl.ds(first, block)
        index_L1 = first + jax.lax.broadcasted_iota(jnp.int32, (block, 1), 0)
        fresh_L1 = index_L1 == slot  # the new position's slot: its key and value are the new ones
        k1_LR = jnp.where(fresh_L1, k1_R[None], k_ref[b, slots, k, lo].astype(jnp.float32))
        k2_LR = jnp.where(fresh_L1, k2_R[None], k_ref[b, slots, k, hi].astype(jnp.float32))
        v_LH = jnp.where(fresh_L1, v_H[None], v_ref[b, slots, k, :].astype(jnp.float32))
        s_GL = (q1_GR[:, None, :] * k1_LR[None]).sum(-1) + (q2_GR[:, None, :] * k2_LR[None]).sum(-1)
        s_GL = jnp.where(index_L1[:, 0][None] < written, s_GL, -jnp.inf)
        m_new_G = jnp.maximum(m_G, s_GL.max(-1))
        p_GL = jnp.exp(s_GL - m_new_G[:, None])
        alpha_G = jnp.exp(m_G - m_new_G)
        acc_GH = acc_GH * alpha_G[:, None] + (p_GL[:, :, None] * v_LH[None]).sum(1)
        return m_new_G, l_G * alpha_G + p_GL.sum(-1), acc_GH

    init = (jnp.full((G,), NEG, jnp.float32), jnp.zeros((G,), jnp.float32), jnp.zeros((G, H), jnp.float32))
    m_G, l_G, acc_GH = jax.lax.fori_loop(0, steps, block_step, init)
    max_ref[...], sum_ref[...], acc_ref[...] = m_G, l_G, acc_GH

    @pl.when((slot >= start) & (slot < start + per_span * block))
    def _write():
        k_out_ref[b, slot, k, lo] = k1_R.astype(k_out_ref.dtype)
        k_out_ref[b, slot, k, hi] = k2_R.astype(k_out_ref.dtype)
        v_out_ref[b, slot, k, :] = v_H.astype(v_out_ref.dtype)


def _block(G: int, H: int) -> int:
    """Slots a step reads: the largest power of two up to MAX_BLOCK whose [G, block, H] product fits PRODUCT, and
    at least 16."""
    return max(16, min(MAX_BLOCK, PRODUCT // (G * H)))


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0
