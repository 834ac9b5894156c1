"""The key/value cache of incremental decoding: per layer, a ring of C slots per batch row.

Shapes: B batch, P prompt (padded), C cache slots, T new positions, K cached heads, H head dim.

Slot s holds the newest position p' with p' = s (mod C) written so far: with C at least the longest sequence a row
reaches, slot s simply holds position s; a sliding-window layer needs only its window, so its C is the window and
the ring overwrites what no query sees any more. Prompts come right-padded (row b holds `lengths[b]` tokens, the
rest padding that causal attention never lets the real tokens see), so every row decodes at its own position.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def slots(length: int, window: int | None) -> int:
    """Cache slots of a layer for sequences of up to `length` positions."""
    return length if window is None else min(window, length)


def fill(x_BPKH: jax.Array, lengths_B: jax.Array, C: int) -> jax.Array:
    """A cache of C slots from a prefill's values: slot s of row b gets position
    (n - 1) - ((n - 1 - s) mod C), n = lengths[b], the newest of the prompt that lands there (clipped into the
    prompt where there is none: such slots are never read before a decode step writes them)."""
    last_B1 = lengths_B[:, None] - 1
    position_BC = last_B1 - jnp.mod(last_B1 - jnp.arange(C), C)
    position_BC = jnp.clip(position_BC, 0, x_BPKH.shape[1] - 1)
    return jnp.take_along_axis(x_BPKH, position_BC.reshape(*position_BC.shape, *(1,) * (x_BPKH.ndim - 2)), axis=1)


def write(cache_BCKH: jax.Array, x_BTKH: jax.Array, positions_BT: jax.Array) -> jax.Array:
    """The cache with the values of the new positions written into their slots."""
    B, T = positions_BT.shape
    rows_BT = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
    slots_BT = jnp.mod(positions_BT, cache_BCKH.shape[1])  # in bounds: no select against the cache's values
    # T consecutive positions of a row land in distinct slots when T <= C
    return cache_BCKH.at[rows_BT, slots_BT].set(x_BTKH.astype(cache_BCKH.dtype), mode="promise_in_bounds",
                                                unique_indices=T <= cache_BCKH.shape[1], wrap_negative_indices=False)


def sees_every_slot(C: int, window: int | None) -> bool:
    """Whether a new query sees every written slot of a C-slot cache: a full cache, or a ring no longer than the
    window."""
    return window is None or C <= window


def visible(positions_BT: jax.Array, C: int, window: int | None) -> jax.Array:
    """[b, t, s]: whether query t of row b sees slot s: the slot's position p' = p - ((p - s) mod C) is not
    negative (written), and, in a sliding-window layer, one of the `window` newest (the query's own included)."""
    p_BT1 = positions_BT[..., None]
    age_BTC = jnp.mod(p_BT1 - jnp.arange(C), C)  # p - p'
    ok = p_BT1 - age_BTC >= 0
    return ok if window is None else ok & (age_BTC < window)


def attend_cached(q_BTNH: jax.Array, k_BCKH: jax.Array, v_BCKH: jax.Array, positions_BT: jax.Array,
                  window: int | None, impl: str = "xla") -> jax.Array:
    """Causal attention of T new queries (already written to the cache) over the cache, bound by reading the
    cache; K/V heads may be fewer than query heads (GQA). One query per row (a decode step) with `impl` cudnn
    runs cuDNN's flash kernel over the written slots (all of which the query sees: the slots of a sliding-window
    layer are its window); otherwise a matrix-vector product per head with the softmax in fp32. (A decode step on
    one GPU takes `ops.flash_decode` instead where it takes the shapes, from `infer.blocks.CachedAttention.decode`.)"""
    B, T, N, H = q_BTNH.shape
    C, K = k_BCKH.shape[1:3]
    if T == 1 and sees_every_slot(C, window) and impl == "cudnn":
        written_B = jnp.minimum(positions_BT[:, 0] + 1, C)
        return jax.nn.dot_product_attention(q_BTNH, k_BCKH, v_BCKH, key_value_seq_lengths=written_B,
                                            implementation="cudnn")
    q_BTKGH = q_BTNH.reshape(B, T, K, N // K, H)
    scores_BKGTC = jnp.einsum("btkgh,bckh->bkgtc", q_BTKGH, k_BCKH, preferred_element_type=jnp.float32)
    scores_BKGTC = scores_BKGTC / jnp.sqrt(jnp.float32(H))
    mask_B11TC = visible(positions_BT, C, window)[:, None, None]
    probs_BKGTC = jax.nn.softmax(jnp.where(mask_B11TC, scores_BKGTC, -jnp.inf), axis=-1)
    out_BTKGH = jnp.einsum("bkgtc,bckh->btkgh", probs_BKGTC.astype(v_BCKH.dtype), v_BCKH)
    return out_BTKGH.reshape(B, T, N, H)
