"""Expert parallelism: the experts' leading dim split over the mesh axis `expert`, tokens sent to them and back.

Everything runs in one `shard_map`, manual over the axes that split tokens (data, fsdp, expert on the batch dim,
context on the sequence dim) and over `tensor` (and over the idle size-1 axes, see the comment at the call);
inside a pipeline stage's `shard_map` over `stage` this one nests in it. Each device sorts only its own
T tokens' assignments and holds E/P experts, P the expert-parallel degree. It ranks its T*K assignments by
destination (rank expert // (E/P)), packs one buffer per destination, swaps them with `all_to_all` over `expert`,
runs its local experts on what it received with `model.experts`, swaps the outputs back, and weights and sums
over K. `tensor` is manual so that each rank runs the (non-partitionable) grouped-matmul kernel on its own slice
of F, and the partial sums are reduced once, on the (T, D) output, rather than on every expert row.

- Dropless: each destination's buffer has room for all T*K assignments, the worst case (every token choosing
  that rank's experts), so nothing is ever dropped and shapes stay static, at the price of buffers (and the
  grouped matmuls' rows) P times the average load. Received rows carry their local expert id, padding rows the
  id E/P, which sorts them past every group of the grouped matmul: they are computed by no expert and return
  zero. (`jax.lax.ragged_all_to_all` would send only the filled rows on GPU; it is not used here.)
- Capacity: counted per group of `capacity_group_rows` consecutive batch rows, as on one device. Data-parallel
  shards are contiguous blocks of rows, so a device whose rows are a multiple of the group holds whole groups and
  ranks them exactly as one device would: one device and every layout drop the same assignments. Expert e has C
  slots for each of the source's G groups, so the per-source buffer (E, G*C) splits along E into P equal
  per-destination parts. Capacity is refused when tokens split over `context` (a group's tokens would be spread
  over devices, in load-balanced order).

Shapes: B batch, S sequence, T tokens per device, D model, F expert ffn, E experts (global), K experts per
token, A = T*K assignments, P expert-parallel ranks, R = P*A received rows, G capacity groups per device.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from mlm_jax.model import experts as ex
from mlm_jax.ops.grouped_matmul import GroupedMatmul, matmul_for
from mlm_jax.parallel.rules import DATA_AXES

EXPERT = "expert"
TENSOR = "tensor"
SEQ = "context"


def _exchange(a: jax.Array) -> jax.Array:
    """Part p of the leading dim goes to expert rank p; part p of the result came from rank p."""
    return jax.lax.all_to_all(a, EXPERT, 0, 0)


def _dropless(x_TD, experts_TK, gate_EDF, up_EDF, down_EFD, *, P: int, matmul: GroupedMatmul) -> jax.Array:
    """Dropless outputs per assignment (A, D): worst-case (P, A) buffers, a grouped matmul over the R rows."""
    T, K = experts_TK.shape
    A, D, E_local = T * K, x_TD.shape[1], gate_EDF.shape[0]
    experts_A = experts_TK.reshape(-1)
    dest_A = experts_A // E_local
    slot_A = dest_A * A + ex.group_ranks(dest_A, P)
    local_N = jnp.full(P * A, E_local, jnp.int32).at[slot_A].set(experts_A % E_local)
    x_RD = _exchange(ex.dispatch(x_TD, slot_A, K, P * A).reshape(P, A, D)).reshape(P * A, D)
    local_R = _exchange(local_N.reshape(P, A)).reshape(P * A)
    rows_R = jnp.arange(P * A, dtype=jnp.int32)
    out_RD = ex.sorted_ffn(x_RD, rows_R, local_R, gate_EDF, up_EDF, down_EFD, matmul)
    return _exchange(out_RD.reshape(P, A, D)).reshape(P * A, D)[slot_A]


def expert_parallel_ffn(x_BSD: jax.Array, experts_BSK: jax.Array, weights_BSK: jax.Array, gate_EDF: jax.Array,
                        up_EDF: jax.Array, down_EFD: jax.Array, *, mesh: Mesh | AbstractMesh,
                        capacity_factor: float | None, capacity_group_rows: int = 1,
                        impl: str = "ragged") -> tuple[jax.Array, jax.Array]:
    """`model.experts.expert_ffn` on global arrays inside `jit`, with the experts split over `expert` (E % P == 0),
    their F dim over `tensor`, and tokens over the data axes (data, fsdp, expert) and `context`.

    Returns y and the global count of dropped assignments, the same as `expert_ffn` on one device computes.
    """
    context, first = jax.sharding.get_abstract_mesh(), 0
    if not context.empty and context.manual_axes:  # inside another shard_map (pipeline stages): nest in its mesh
        mesh, first = context, 1 + max(context.axis_names.index(a) for a in context.manual_axes)
    size = dict(mesh.shape)
    P, tp = size.get(EXPERT, 1), size.get(TENSOR, 1)
    E, D, F = gate_EDF.shape
    if E % P:
        raise ValueError(f"{E} experts cannot be split over expert-parallel degree {P}")
    if F % tp:
        raise ValueError(f"expert ffn dim {F} cannot be split over tensor-parallel degree {tp}")
    # jax 0.11 aborts on nested manual axes that precede the outer ones in mesh order ("Manual axes must be
    # sorted"): none do in the trainer's mesh (`stage` first), but such axes would stay automatic.
    token_axes = tuple(a for a in (*DATA_AXES, SEQ) if size.get(a, 1) > 1 and mesh.axis_names.index(a) >= first)
    cap = dict(capacity_factor=capacity_factor, capacity_group_rows=capacity_group_rows)
    if not token_axes and tp == 1:
        return ex.expert_ffn(x_BSD, experts_BSK, weights_BSK, gate_EDF, up_EDF, down_EFD, **cap, impl=impl)
    batch_axes = tuple(a for a in token_axes if a != SEQ) or None
    if capacity_factor is not None:  # internal asserts: the config validation refuses these layouts
        rows = x_BSD.shape[0] // math.prod(size[a] for a in batch_axes or ())
        if SEQ in token_axes or rows % capacity_group_rows:
            raise ValueError(f"capacity groups of {capacity_group_rows} rows do not line up with the token shards "
                             f"({rows} rows per device{', sequence split over context' * (SEQ in token_axes)})")
    tokens = PartitionSpec(batch_axes, SEQ if SEQ in token_axes else None)
    e_axis, f_axis = EXPERT if P > 1 else None, TENSOR if tp > 1 else None
    in_EDF, in_EFD = PartitionSpec(e_axis, None, f_axis), PartitionSpec(e_axis, f_axis, None)

    def local(x_BSD, experts_BSK, weights_BSK, gate_EDF, up_EDF, down_EFD):
        if P == 1:
            y_BSD, dropped = ex.expert_ffn(x_BSD, experts_BSK, weights_BSK, gate_EDF, up_EDF, down_EFD, **cap,
                                           impl=impl)
        else:
            y_BSD, dropped = _expert_parallel(x_BSD, experts_BSK, weights_BSK, gate_EDF, up_EDF, down_EFD,
                                              P=P, E=E, **cap, impl=impl)
        if f_axis:  # each tensor rank summed over its slice of F only
            y_BSD = jax.lax.psum(y_BSD, f_axis)
        if capacity_factor is not None and token_axes:
            dropped = jax.lax.psum(dropped, token_axes)
        return y_BSD, dropped

    # Manual over every axis it may take, the idle size-1 ones too: under a partly manual mesh jax roots each
    # all-reduce's reduction (the psums below, and the implicit ones summing the cotangents of inputs replicated
    # over manual axes: the weights over the token axes, the tokens over `tensor`) in a sharding custom call,
    # which XLA CPU's AllReducePromotion (bf16 -> f32) cannot clone: the process aborts in bf16. Fully manual, jax
    # emits a plain add.
    return jax.shard_map(local, mesh=mesh, in_specs=(tokens, tokens, tokens, in_EDF, in_EDF, in_EFD),
                         out_specs=(tokens, PartitionSpec()), axis_names=set(mesh.axis_names[first:]),
                         check_vma=False)(x_BSD, experts_BSK, weights_BSK, gate_EDF, up_EDF, down_EFD)


def _expert_parallel(x_BSD, experts_BSK, weights_BSK, gate_EDF, up_EDF, down_EFD, *, P: int, E: int,
                     capacity_factor: float | None, capacity_group_rows: int, impl: str) -> tuple[jax.Array, jax.Array]:
    """One device's part: its tokens (whole capacity groups) through all E experts, of which it holds E/P."""
    B, S, D = x_BSD.shape
    K = experts_BSK.shape[-1]
    x_TD, experts_TK = x_BSD.reshape(B * S, D), experts_BSK.reshape(B * S, K)
    if capacity_factor is None:
        matmul = matmul_for(impl)
        out_AD = _dropless(x_TD, experts_TK, gate_EDF, up_EDF, down_EFD, P=P, matmul=matmul)
        dropped = jnp.zeros((), jnp.int32)
    else:
        C = ex.capacity(capacity_group_rows * S, K, E, capacity_factor)
        out_AD, dropped = ex.capacity_ffn(x_TD, experts_TK, gate_EDF, up_EDF, down_EFD, num_experts=E, C=C,
                                          group_tokens=capacity_group_rows * S, exchange=_exchange)
    return ex.combine(out_AD, weights_BSK.reshape(B * S, K)).reshape(B, S, D), dropped
