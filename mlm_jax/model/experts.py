"""The expert FFNs of a Mixture-of-Experts layer: y[t] = sum_k weights[t,k] * FFN_{experts[t,k]}(x[t]).

The router has already chosen K experts and their combine weights per token; this module moves token rows to
their experts and back. Every expert is a SwiGLU, (silu(x @ gate_e) * (x @ up_e)) @ down_e. Two modes:

- Dropless (`capacity_factor=None`): the T*K assignments are sorted by expert (stable argsort), their token rows
  gathered into one (A, D) matrix in which each expert's rows are one contiguous group, and each projection is
  one grouped matmul over the per-expert group sizes. Shapes are static (always A rows), whatever the routing.
- Capacity (`capacity_factor=c`): capacity is counted per group of `group_rows` consecutive batch rows (GShard's
  groups; 1 = per sequence), so that it does not depend on how the batch is split over devices as long as each
  device holds whole groups. Each expert takes at most C = ceil(group_rows*S*K/E * c) assignments of each group:
  an assignment's rank is its rank among its group's assignments to its expert, counting the group's first
  choices (k=0) in token order, then its second choices, ...: a token loses its later choices before any token of
  its group loses its first. Ranks >= C are dropped (they contribute zero). The G groups fill an (E, G*C, D)
  buffer, group g in slots [g*C, (g+1)*C) of each expert, and the FFNs are batched einsums. The buffer is filled
  by scattering token indices and gathering rows, O(E*G*C*D) memory rather than a (T, E, C) one-hot.

The grouped matmul is `jax.lax.ragged_dot`, or on Hopper the Pallas Mosaic-GPU kernels (`ops.grouped_matmul`), as
the layer's kernels name it. The pieces below also serve expert parallelism (`parallel/expert.py`), which adds only the
all-to-alls between them.

Shapes: B batch, S sequence, T = B*S tokens, D model, F expert ffn, E experts, K experts per token,
A = T*K assignments (index t*K + k), C capacity slots per expert and group, R rows of a grouped matmul, G groups
(of a grouped matmul, or of capacity), N rows of a buffer, P expert-parallel ranks.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from mlm_jax.model.linear import PRODUCT
from mlm_jax.ops.grouped_matmul import GroupedMatmul, matmul_for


def group_ranks(groups_A: jax.Array, num_groups: int) -> jax.Array:
    """Rank of each element among the elements of its group, counted in array order (a stable sort by group)."""
    A = groups_A.shape[0]
    order_A = jnp.argsort(groups_A, stable=True)
    counts_G = jnp.zeros(num_groups, jnp.int32).at[groups_A].add(1)
    starts_G = jnp.cumsum(counts_G) - counts_G
    ranks = jnp.arange(A, dtype=jnp.int32) - starts_G[groups_A[order_A]]
    return jnp.zeros(A, jnp.int32).at[order_A].set(ranks)


def gather_rows(x_ND: jax.Array, rows_R: jax.Array) -> jax.Array:
    """x_ND[rows_R], zero where a row index is out of range (N marks "no row")."""
    return jnp.take(x_ND, rows_R, axis=0, mode="fill", fill_value=0)


def dispatch(x_TD: jax.Array, slot_A: jax.Array, K: int, num_slots: int) -> jax.Array:
    """A (num_slots, D) buffer whose row slot_A[a] is token a // K's row; unfilled rows are zero, slots past the
    buffer (dropped assignments) go nowhere."""
    token_N = jnp.full(num_slots, x_TD.shape[0], jnp.int32).at[slot_A].set(
        jnp.arange(slot_A.shape[0], dtype=jnp.int32) // K, mode="drop")
    return gather_rows(x_TD, token_N)


def combine(out_AD: jax.Array, weights_TK: jax.Array) -> jax.Array:
    """y[t] = sum_k weights[t,k] * out[t*K + k], in the outputs' dtype."""
    T, K = weights_TK.shape
    return jnp.einsum("tkd,tk->td", out_AD.reshape(T, K, -1), weights_TK.astype(out_AD.dtype))


def _inverse(order_R: jax.Array) -> jax.Array:
    return jnp.zeros_like(order_R).at[order_R].set(jnp.arange(order_R.shape[0], dtype=order_R.dtype))


@jax.custom_vjp
def _permute_rows(x_RD: jax.Array, order_R: jax.Array, inverse_R: jax.Array) -> jax.Array:
    """x_RD[order_R] for a permutation; its gradient is the gather by the inverse permutation, not a scatter-add,
    which a GPU runs several times faster."""
    return jnp.take(x_RD, order_R, axis=0)


_permute_rows.defvjp(lambda x, o, i: (jnp.take(x, o, axis=0), (o, i)),
                     lambda res, d: (jnp.take(d, res[1], axis=0), None, None))


@jax.custom_vjp
def _take_tokens(x_TD: jax.Array, token_A: jax.Array, copies_TK: jax.Array) -> jax.Array:
    """x_TD[token_A], where every token fills K rows and copies_TK[t, k] is the row of its k-th copy: the gradient
    is then a gather and a sum over K rather than a scatter-add."""
    return jnp.take(x_TD, token_A, axis=0)


_take_tokens.defvjp(lambda x, t, c: (jnp.take(x, t, axis=0), c),
                    lambda copies_TK, d_AD: (jnp.sum(jnp.take(d_AD, copies_TK, axis=0), axis=1), None, None))


def _grouped_swiglu(x_RD: jax.Array, sizes_E: jax.Array, gate_EDF: jax.Array, up_EDF: jax.Array,
                    down_EFD: jax.Array, matmul: GroupedMatmul) -> jax.Array:
    """Each expert's SwiGLU on its group of the expert-sorted rows; gate and up as one grouped matmul over their
    concatenated columns (one pass over the rows, and one input-gradient product over 2F instead of two and an add:
    moe-1b 1.01x on an H200)."""
    F = gate_EDF.shape[-1]
    gate_up_R2F = checkpoint_name(matmul(x_RD, jnp.concatenate([gate_EDF, up_EDF], axis=-1), sizes_E), PRODUCT)
    h_RF = jax.nn.silu(gate_up_R2F[:, :F]) * gate_up_R2F[:, F:]
    return checkpoint_name(matmul(h_RF, down_EFD, sizes_E), PRODUCT)


def sorted_ffn(x_ND: jax.Array, rows_R: jax.Array, experts_R: jax.Array, gate_EDF: jax.Array, up_EDF: jax.Array,
               down_EFD: jax.Array, matmul: GroupedMatmul) -> jax.Array:
    """out[r] = FFN_{experts_R[r]}(x_ND[rows_R[r]]), zero where experts_R[r] >= E (padding rows).

    The rows are sorted by expert so each expert's rows form one group of the grouped matmuls; padding rows sort
    past every group, where the matmul leaves them zero.
    """
    order_R = jnp.argsort(experts_R, stable=True)
    sizes_E = jnp.zeros(gate_EDF.shape[0], jnp.int32).at[experts_R].add(1, mode="drop")
    out_RD = _grouped_swiglu(gather_rows(x_ND, rows_R[order_R]), sizes_E, gate_EDF, up_EDF, down_EFD, matmul)
    return _permute_rows(out_RD, _inverse(order_R), order_R)


def dropless_ffn(x_TD: jax.Array, experts_TK: jax.Array, gate_EDF: jax.Array, up_EDF: jax.Array,
                 down_EFD: jax.Array, matmul: GroupedMatmul) -> jax.Array:
    """Every assignment's FFN output (A, D), assignment t*K + k at row t*K + k; no row is padding, so the token
    rows are taken and put back with gather-only gradients."""
    T, K = experts_TK.shape
    experts_A = experts_TK.reshape(-1)
    order_A = jnp.argsort(experts_A, stable=True)  # sorted row -> assignment
    inverse_A = _inverse(order_A)
    sizes_E = jnp.zeros(gate_EDF.shape[0], jnp.int32).at[experts_A].add(1)
    x_AD = _take_tokens(x_TD, order_A // K, inverse_A.reshape(T, K))
    out_AD = _grouped_swiglu(x_AD, sizes_E, gate_EDF, up_EDF, down_EFD, matmul)
    return _permute_rows(out_AD, inverse_A, order_A)


def batched_ffn(x_PECD: jax.Array, gate_EDF: jax.Array, up_EDF: jax.Array, down_EFD: jax.Array) -> jax.Array:
    """Every expert's FFN on its C slots from each of P sources, as batched einsums."""
    h_PECF = (jax.nn.silu(checkpoint_name(jnp.einsum("pecd,edf->pecf", x_PECD, gate_EDF), PRODUCT))
              * checkpoint_name(jnp.einsum("pecd,edf->pecf", x_PECD, up_EDF), PRODUCT))
    return checkpoint_name(jnp.einsum("pecf,efd->pecd", h_PECF, down_EFD), PRODUCT)


def capacity(group_tokens: int, K: int, E: int, capacity_factor: float) -> int:
    """Slots per expert and group: a group's average load per expert, group_tokens*K/E, times the factor, rounded
    up."""
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor={capacity_factor}: expected a positive number (or None: dropless)")
    return math.ceil(group_tokens * K / E * capacity_factor)


def capacity_slots(experts_TK: jax.Array, E: int, C: int, group_tokens: int) -> tuple[jax.Array, jax.Array]:
    """Slot of each assignment in a flat (E*G*C) buffer, expert*G*C + group*C + rank, the rank counted within its
    group with first choices first, or E*G*C (past the buffer) when dropped; and the int32 count dropped.

    Groups are consecutive runs of `group_tokens` tokens (whole batch rows)."""
    T, K = experts_TK.shape
    if T % group_tokens:
        raise ValueError(f"{T} tokens do not split into capacity groups of {group_tokens}")
    G = T // group_tokens
    experts_GKT = experts_TK.reshape(G, group_tokens, K).transpose(0, 2, 1)  # rank order: group, choice, token
    group_GKT = jnp.broadcast_to(jnp.arange(G, dtype=experts_TK.dtype)[:, None, None], experts_GKT.shape)
    rank_GKT = group_ranks((group_GKT * E + experts_GKT).reshape(-1), G * E).reshape(experts_GKT.shape)
    slot_GKT = jnp.where(rank_GKT < C, (experts_GKT * G + group_GKT) * C + rank_GKT, E * G * C)
    return slot_GKT.transpose(0, 2, 1).reshape(-1), jnp.sum(rank_GKT >= C, dtype=jnp.int32)


def capacity_ffn(x_TD: jax.Array, experts_TK: jax.Array, gate_EDF: jax.Array, up_EDF: jax.Array,
                 down_EFD: jax.Array, *, num_experts: int, C: int, group_tokens: int,
                 exchange: Callable[[jax.Array], jax.Array] = lambda a: a) -> tuple[jax.Array, jax.Array]:
    """Capacity-mode outputs per assignment (A, D) and the count dropped, C slots per expert and group of
    `group_tokens` tokens.

    The weights may hold a contiguous 1/P of the `num_experts`; `exchange` then swaps the (P, E/P, G*C, D)
    buffer's leading dim between the P holders (an all-to-all) before and after the FFNs.
    """
    T, K = experts_TK.shape
    E_local, D = gate_EDF.shape[:2]
    N = num_experts * (T // group_tokens) * C
    slot_A, dropped = capacity_slots(experts_TK, num_experts, C, group_tokens)
    x_PECD = dispatch(x_TD, slot_A, K, N).reshape(num_experts // E_local, E_local, -1, D)
    out_PECD = exchange(batched_ffn(exchange(x_PECD), gate_EDF, up_EDF, down_EFD))
    return gather_rows(out_PECD.reshape(N, D), slot_A), dropped


def expert_ffn(x_BSD: jax.Array, experts_BSK: jax.Array, weights_BSK: jax.Array, gate_EDF: jax.Array,
               up_EDF: jax.Array, down_EFD: jax.Array, *, capacity_factor: float | None, capacity_group_rows: int = 1,
               impl: str = "ragged") -> tuple[jax.Array, jax.Array]:
    """sum_k weights[..., k] * FFN_{experts[..., k]}(x) on one device, and the int32 count of dropped assignments.

    Capacity mode counts capacity per group of `capacity_group_rows` consecutive rows of the batch (B must be a
    multiple). `impl` names the dropless grouped matmul (`ops.grouped_matmul.IMPLS`).
    """
    B, S, D = x_BSD.shape
    K = experts_BSK.shape[-1]
    E, _, F = gate_EDF.shape
    x_TD, experts_TK = x_BSD.reshape(B * S, D), experts_BSK.reshape(B * S, K)
    if capacity_factor is None:
        matmul = matmul_for(impl, padded=False)
        out_AD = dropless_ffn(x_TD, experts_TK, gate_EDF, up_EDF, down_EFD, matmul)
        dropped = jnp.zeros((), jnp.int32)
    else:
        if B % capacity_group_rows:
            raise ValueError(f"{B} batch rows do not split into capacity groups of {capacity_group_rows} rows")
        C = capacity(capacity_group_rows * S, K, E, capacity_factor)
        out_AD, dropped = capacity_ffn(x_TD, experts_TK, gate_EDF, up_EDF, down_EFD, num_experts=E, C=C,
                                       group_tokens=capacity_group_rows * S)
    return combine(out_AD, weights_BSK.reshape(B * S, K)).reshape(B, S, D), dropped
