"""Documents packed in a row kept apart by cuDNN's packed ("ragged") layout on Hopper GPUs: each row's segments are
handed to the flash kernel as their lengths and offsets, so blocks of one document never meet another's, where a
segment mask would turn into a [B, 1, S, S] bias read by every head and skip nothing.

JAX exposes the layout only in its private cuDNN module (`jax._src.cudnn.fused_attention_stablehlo`,
`dot_product_attention` with `q_seqlen`/`kv_seqlen` [B, M] and `q_offsets`/`kv_offsets` [B, M + 1], present in
jax 0.10 and 0.11); `SIGNATURE` pins the keywords used here and a test checks them. M, the segments a row may
hold, is static: a step whose fullest row has more runs the masked kernel instead (`lax.cond`), the same function.
A segment is a run of equal ids (the data's documents and packed examples are contiguous).
"""
from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax._src.cudnn import fused_attention_stablehlo as cudnn

SIGNATURE = ("q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets", "scale", "mask_type", "qkv_layout",
             "sliding_window_length")


def segment_layout(segment_ids_BS: jax.Array, max_segments: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(lengths [B, M], offsets [B, M + 1], segments per row [B]) of each row's runs of equal ids, in cuDNN's
    packed form: a row's segments first, -1 after them. Rows with more than M segments are cut short: the caller
    checks the count."""
    B, S = segment_ids_BS.shape
    starts_BS = jnp.concatenate([jnp.ones((B, 1), bool), segment_ids_BS[:, 1:] != segment_ids_BS[:, :-1]], axis=1)
    ordinal_BS = jnp.cumsum(starts_BS, axis=1, dtype=jnp.int32) - 1  # each token's segment, counted in its row
    rows_B1 = jnp.arange(B)[:, None]
    lengths_BM = jnp.zeros((B, max_segments), jnp.int32).at[rows_B1, ordinal_BS].add(1, mode="drop")
    lengths_BM = jnp.where(lengths_BM > 0, lengths_BM, -1)
    slot_BS = jnp.where(starts_BS, ordinal_BS, max_segments + 1)  # out of range: dropped
    index_BS = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    offsets_BM1 = jnp.full((B, max_segments + 1), -1, jnp.int32).at[rows_B1, slot_BS].set(index_BS, mode="drop")
    return lengths_BM, offsets_BM1, ordinal_BS[:, -1] + 1


def attend(q_BSNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, segment_ids_BS: jax.Array, *,
           max_segments: int, window: int | None, masked: Callable) -> jax.Array:
    """Causal attention within each segment (and a sliding `window`), through the packed layout while every row
    holds at most `max_segments` segments, else through `masked(q, k, v, segment_ids)` (recomputed in the backward
    pass rather than keeping its mask)."""
    lengths_BM, offsets_BM1, count_B = segment_layout(segment_ids_BS, max_segments)

    def packed(q_BSNH, k_BSKH, v_BSKH, segment_ids_BS):
        return cudnn.dot_product_attention(
            q_BSNH, k_BSKH, v_BSKH, q_seqlen=lengths_BM, kv_seqlen=lengths_BM, q_offsets=offsets_BM1,
            kv_offsets=offsets_BM1, scale=1 / math.sqrt(q_BSNH.shape[-1]), mask_type=cudnn.MaskType.PADDING_CAUSAL,
            qkv_layout="BTNH", sliding_window_length=window)
    return jax.lax.cond(jnp.max(count_B) <= max_segments, packed, jax.checkpoint(masked),
                        q_BSNH, k_BSKH, v_BSKH, segment_ids_BS)
