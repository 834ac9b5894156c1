"""The explicit-collective kernels a layout needs (`layout_kernels`), added to the model's `Kernels` when it is
built for that layout (training, generation on a mesh).

Pipeline stages (without context parallelism) run attention in `stage_attention`, a `shard_map` manual over every
axis the stages' own is not: custom-partitioned kernels (cuDNN attention's partitioner) fail inside a partially
manual `shard_map`, and a fully manual one calls them as plain kernels on each device's shard. Context parallelism
replaces attention with `context.context_attention` and permutes every batch once into the
load-balanced order (rank r holds chunks r and 2*cp-1-r), with the RoPE positions travelling with the tokens; the
loss is a mean over tokens, so the permutation leaves it unchanged. Expert parallelism replaces the experts'
computation with `expert.expert_parallel_ffn` whenever tokens are split over devices (with `expert` = 1 too: each
device then sorts and multiplies only its own tokens, and the Hopper grouped GEMM is never partitioned by XLA).
With fewer K/V heads than tensor ranks, attention gets each K/V head repeated once per rank that reads it
(`repeated_kv_heads`), in front of whichever attention kernel the layout runs.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from mlm_jax.model import axes as ax
from mlm_jax.model.attention import local_attention
from mlm_jax.model.kernels import Kernels
from mlm_jax.model.transformer import default_positions, segment_positions
from mlm_jax.parallel.context import context_attention, load_balance_order
from mlm_jax.parallel.expert import expert_parallel_ffn


def layout_kernels(kernels: Kernels, mesh: Mesh, degrees: dict[str, int], *, resolver: Callable,
                   kv_heads: int | None, moe: bool, context_strategy: str = "allgather",
                   seq_len: int | None = None) -> tuple[Kernels, Callable | None]:
    """(`kernels` with this layout's replacements, batch preparation or None): `degrees` of the mesh's axes (a
    training layout's; generation passes those of the model's mesh without stages or context), `kv_heads` (None for
    latent attention), `moe` whether the model has experts; `resolver` lays out activations by the rules table
    (`sharding.activation_resolver`); `seq_len` orders a context-parallel batch."""
    attend, expert_ffn, prepare = None, None, None
    cp = degrees["context"]
    if degrees["stage"] > 1 and cp == 1:
        attend = functools.partial(stage_attention, resolver=resolver)
    if cp > 1:
        attend = functools.partial(context_attention, mesh=mesh, strategy=context_strategy)
        prepare = functools.partial(load_balance, perm=jnp.asarray(load_balance_order(seq_len, cp)))
    if moe and any(degrees[a] > 1 for a in ("data", "fsdp", "context", "expert", "tensor")):
        expert_ffn = functools.partial(expert_parallel_ffn, mesh=mesh)
    t = degrees["tensor"]
    if kv_heads and kv_heads % t:
        attend = functools.partial(repeated_kv_heads, repeat=t // kv_heads, attention=attend or local_attention)
    return dataclasses.replace(kernels, attend=attend, expert_ffn=expert_ffn), prepare


def repeated_kv_heads(q_BSNH, k_BSKH, v_BSKH, *, impl: str, repeat: int, attention: Callable,
                      window: int | None = None, local: bool | jax.Array = True,
                      segment_ids: jax.Array | None = None, **packed) -> jax.Array:
    """Fewer K/V heads than tensor ranks (`tensor` a multiple of K): each head repeated `repeat` times, so every
    rank holds one copy of the head its query heads read, as Megatron replicates them. Query head n reads
    repeated head n // (N / (K * repeat)) = original head n // (N / K): the same function. The K/V weights stay
    whole on every tensor rank (their `kv_heads` dim does not divide), and only these activations repeat; `packed`
    (the packed layout's bound, where the plan set one) passes through."""
    k_BSTH, v_BSTH = (ax.constrain(jnp.repeat(x, repeat, axis=2), (ax.ACT_BATCH, ax.ACT_SEQ, ax.ACT_KV_HEADS, None))
                      for x in (k_BSKH, v_BSKH))
    return attention(q_BSNH, k_BSTH, v_BSTH, impl=impl, window=window, local=local, segment_ids=segment_ids,
                     **packed)


def load_balance(batch: dict, perm) -> dict:
    """The batch with its sequence in load-balanced order, with the positions of its tokens (their places in the
    row, or the positions the batch gives: within each token's document) and any segment ids travelling along."""
    if "positions" not in batch:
        positions_BS = (default_positions(batch["inputs"]) if "segment_ids" not in batch
                        else segment_positions(batch["segment_ids"]))
        batch = {**batch, "positions": positions_BS}
    return {k: ax.constrain(v[:, perm], (ax.ACT_BATCH, ax.ACT_SEQ)) for k, v in batch.items()}


def stage_attention(q_BSNH, k_BSKH, v_BSKH, *, impl: str, resolver: Callable, window: int | None = None,
                    local: bool | jax.Array = True, segment_ids: jax.Array | None = None,
                    packed_segments: int = 0) -> jax.Array:
    """Causal attention inside a pipeline stage, in a `shard_map` manual over the axes the stage's is not.

    Batch and heads are split as the rules table lays out attention's activations (`resolver`), the sequence never
    (each device needs all of its rows' keys); K/V heads take the query heads' axes, so each device keeps whole
    GQA groups, or stay whole with them. A traced `local` enters the manual region as an operand, so that the
    choice of window is a `lax.cond` with no collective inside.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not mesh.manual_axes:
        return local_attention(q_BSNH, k_BSKH, v_BSKH, impl=impl, window=window, local=local,
                               segment_ids=segment_ids, packed_segments=packed_segments)
    free = [a for a in mesh.axis_names if a not in mesh.manual_axes]

    def axes(names, shape, dim):
        spec = resolver(names, shape).spec
        entry = spec[dim] if dim < len(spec) else None
        kept = tuple(a for a in ((entry,) if isinstance(entry, str) else entry or ()) if a in free)
        return kept or None

    batch = axes((ax.ACT_BATCH, ax.ACT_SEQ, ax.ACT_HEADS, None), q_BSNH.shape, 0)
    heads = axes((ax.ACT_BATCH, ax.ACT_SEQ, ax.ACT_HEADS, None), q_BSNH.shape, 2)
    if heads is not None and k_BSKH.shape[2] % math.prod(mesh.shape[a] for a in heads):
        heads = None
    spec = PartitionSpec(batch, None, heads, None)
    extra, extra_specs = {}, {}  # the traced window flag and the segment ids enter as operands
    if not isinstance(local, bool):
        extra["local"], extra_specs["local"] = local, PartitionSpec()
    if segment_ids is not None:
        extra["segment_ids"], extra_specs["segment_ids"] = segment_ids, PartitionSpec(batch, None)

    def attend(q_BSNH, k_BSKH, v_BSKH, extra):
        return local_attention(q_BSNH, k_BSKH, v_BSKH, impl=impl, window=window, local=extra.get("local", local),
                               segment_ids=extra.get("segment_ids"), packed_segments=packed_segments)
    return jax.shard_map(attend, mesh=mesh, in_specs=(spec, spec, spec, extra_specs), out_specs=spec,
                         axis_names=set(free), check_vma=False)(q_BSNH, k_BSKH, v_BSKH, extra)
