"""A decode step's attention over the cache for a few rows, as a Pallas kernel (flash-decoding: the written slots
split among many programs, their partial softmaxes combined after).

At one query per row, cuDNN's flash kernel runs a 16-row query tile and a split reduction of its own: 8.8 us a
layer to read llama-1b's 5.2 MB cache at one row (RESULTS.md). Here each program takes one row, one K/V head and one
span of slots, walks the span in pipelined blocks with an online softmax in fp32 (products on the CUDA cores: a
K/V head's G queries are too few rows for the tensor cores), and writes its running max, sum and weighted values;
XLA combines the spans in the fusion that feeds the output projection. Small blocks and few warps keep many
programs, and so many loads, in flight (llama-1b's decode step at one row: 0.909 ms against 0.954 with cuDNN).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

MAX_ROWS = 4  # more rows: cuDNN reads the cache at bandwidth (3.96 TB/s at 32 rows on an H200)
PRODUCT = 8192  # elements of a block's [G, block, H] product, in the registers of one program
MAX_BLOCK = 32  # slots a step reads at most
WARPS = 2  # with 32-slot blocks: 0.909 ms a step against 0.948 with 4 warps and 64 (llama-1b at one row)
PROGRAMS = 512  # spans enough for this many programs (about four per SM of an H200)
NEG = -1e30  # the running max before any slot: finite, so a span with no written slot adds exp(NEG - max) = 0


def supports(q_BTNH: jax.Array, k_BCKH: jax.Array) -> bool:
    """Shapes the kernel takes: one query per row, at most MAX_ROWS rows, power-of-two group and head dims, a block
    size that divides the cache."""
    B, T, N, H = q_BTNH.shape
    C, K = k_BCKH.shape[1:3]
    G = N // K
    return T == 1 and B <= MAX_ROWS and _pow2(G) and _pow2(H) and C % _block(G, H) == 0


def attend(q_BTNH: jax.Array, k_BCKH: jax.Array, v_BCKH: jax.Array, written_B: jax.Array, *,
           interpret: bool = False) -> jax.Array:
    """Attention of one query per row over the first `written_B[b]` slots of row b (all of which it sees), scaled
    by 1/sqrt(H); K/V heads may be fewer than query heads (GQA). Needs `supports`."""
    B, _, N, H = q_BTNH.shape
    C, K = k_BCKH.shape[1:3]
    G = N // K
    block = _block(G, H)
    blocks = C // block
    per_span = min(blocks, max(1, blocks * B * K // PROGRAMS))  # blocks a program walks
    while blocks % per_span:
        per_span += 1
    spans = blocks // per_span
    q_BKGH = q_BTNH.reshape(B, K, G, H)
    out_shape = [jax.ShapeDtypeStruct((B, K, spans, *shape), jnp.float32) for shape in ((G,), (G,), (G, H))]
    spec = lambda *shape: pl.BlockSpec((pl.squeezed, pl.squeezed, pl.squeezed, *shape),  # noqa: E731
                                       lambda b, k, s: (b, k, s, *(0,) * len(shape)))
    max_BKSG, sum_BKSG, acc_BKSGH = pl.pallas_call(
        functools.partial(_span, block=block, per_span=per_span, scale=1 / math.sqrt(H)),
        out_shape=out_shape,
        grid=(B, K, spans),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * 4,
        out_specs=[spec(G), spec(G), spec(G, H)],
        compiler_params=pltriton.CompilerParams(num_warps=WARPS, num_stages=3),
        interpret=interpret,
    )(written_B.astype(jnp.int32), q_BKGH, k_BCKH, v_BCKH)
    weight_BKSG = jnp.exp(max_BKSG - max_BKSG.max(2, keepdims=True))
    out_BKGH = (weight_BKSG[..., None] * acc_BKSGH).sum(2) / (weight_BKSG * sum_BKSG).sum(2)[..., None]
    return out_BKGH.reshape(B, 1, N, H).astype(q_BTNH.dtype)


def _span(written_ref, q_ref, k_ref, v_ref, max_ref, sum_ref, acc_ref, *, block, per_span, scale):
    b, k, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    G, H = acc_ref.shape
    written = written_ref[b]
    start = s * per_span * block
    steps = jnp.clip((written - start + block - 1) // block, 0, per_span)  # blocks holding written slots
    q_GH = q_ref[b, k].astype(jnp.float32) * scale

    def step(i, carry):
        m_G, l_G, acc_GH = carry
        first = pl.multiple_of(start + i * block, block)
        slots = pl.ds(first, block)
        k_LH, v_LH = k_ref[b, slots, k].astype(jnp.float32), v_ref[b, slots, k].astype(jnp.float32)
        s_GL = (q_GH[:, None, :] * k_LH[None]).sum(-1)
        s_GL = jnp.where(first + jax.lax.broadcasted_iota(jnp.int32, s_GL.shape, 1) < written, s_GL, -jnp.inf)
        m_new_G = jnp.maximum(m_G, s_GL.max(-1))
        p_GL = jnp.exp(s_GL - m_new_G[:, None])
        alpha_G = jnp.exp(m_G - m_new_G)
        acc_GH = acc_GH * alpha_G[:, None] + (p_GL[:, :, None] * v_LH[None]).sum(1)
        return m_new_G, l_G * alpha_G + p_GL.sum(-1), acc_GH

    init = (jnp.full((G,), NEG, jnp.float32), jnp.zeros((G,), jnp.float32), jnp.zeros((G, H), jnp.float32))
    m_G, l_G, acc_GH = jax.lax.fori_loop(0, steps, step, init)
    max_ref[...], sum_ref[...], acc_ref[...] = m_G, l_G, acc_GH


def _block(G: int, H: int) -> int:
    """Slots a step reads: the largest power of two up to MAX_BLOCK whose [G, block, H] product fits PRODUCT, and
    at least 16."""
    return max(16, min(MAX_BLOCK, PRODUCT // (G * H)))


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0
