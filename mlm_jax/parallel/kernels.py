"""The explicit-collective kernels a layout needs, for `train.step` to install (`layers.axes.kernels`).

Pipeline stages (without context parallelism) run attention in `stage_attention`, a `shard_map` manual over every
axis the stages' own is not: custom-partitioned kernels (cuDNN attention's partitioner) fail inside a partially
manual `shard_map`, and a fully manual one calls them as plain kernels on each device's shard. Context parallelism
replaces attention with `context.context_attention` and permutes every batch once into the
load-balanced order (rank r holds chunks r and 2*cp-1-r), with the RoPE positions travelling with the tokens; the
loss is a mean over tokens, so the permutation leaves it unchanged. Expert parallelism replaces the experts'
computation with `expert.expert_parallel_ffn` whenever tokens are split over devices (with `expert` = 1 too: each
device then sorts and multiplies only its own tokens, and the Hopper grouped GEMM is never partitioned by XLA).
With fewer K/V heads than tensor ranks, attention gets each K/V head repeated once per rank that reads it
(`repeated_kv_heads`), in front of whichever attention kernel the layout runs. FSDP hands each dense layer its
master weight (`linear.master_einsum`): cast on its shard before the gather, weight gradient reduced in fp32.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from mlm_jax.config import Config
from mlm_jax.layers import axes as ax
from mlm_jax.layers.attention import local_attention
from mlm_jax.layers.linear import master_einsum
from mlm_jax.parallel.context import context_attention, load_balance_order
from mlm_jax.parallel.expert import expert_parallel_ffn


def parallel_kernels(cfg: Config, mesh: Mesh, degrees: dict[str, int],
                     resolver: Callable) -> tuple[dict[str, Callable], Callable | None]:
    """(kernels by name, batch preparation or None) for this layout; `resolver` lays out activations by the rules
    table (`sharding.activation_resolver`)."""
    kernels, prepare = {}, None
    cp = degrees["context"]
    if degrees["stage"] > 1 and cp == 1:
        kernels[ax.ATTENTION] = functools.partial(stage_attention, resolver=resolver)
    if cp > 1:
        kernels[ax.ATTENTION] = functools.partial(context_attention, mesh=mesh,
                                                  strategy=cfg.parallel.context_strategy)
        prepare = functools.partial(load_balance, perm=jnp.asarray(load_balance_order(cfg.train.seq_len, cp)))
    if cfg.model.moe.enabled and any(degrees[a] > 1 for a in ("data", "fsdp", "context", "expert", "tensor")):
        kernels[ax.EXPERT_FFN] = functools.partial(expert_parallel_ffn, mesh=mesh)
    if degrees["fsdp"] > 1:  # weights gathered in the compute dtype, their gradients reduced in fp32
        kernels[ax.MASTER_EINSUM] = master_einsum
    t, kv = degrees["tensor"], cfg.model.kv_heads
    if kv % t:
        kernels[ax.ATTENTION] = functools.partial(repeated_kv_heads, repeat=t // kv,
                                                  attention=kernels.get(ax.ATTENTION, local_attention))
    return kernels, prepare


def repeated_kv_heads(q_BSNH, k_BSKH, v_BSKH, *, impl: str, repeat: int, attention: Callable,
                      window: int | None = None, local: bool | jax.Array = True) -> jax.Array:
    """Fewer K/V heads than tensor ranks (`tensor` a multiple of K): each head repeated `repeat` times, so every
    rank holds one copy of the head its query heads read, as Megatron replicates them. Query head n reads
    repeated head n // (N / (K * repeat)) = original head n // (N / K): the same function. The K/V weights stay
    whole on every tensor rank (their `kv_heads` dim does not divide), and only these activations repeat."""
    k_BSTH, v_BSTH = (ax.constrain(jnp.repeat(x, repeat, axis=2), (ax.ACT_BATCH, ax.ACT_SEQ, ax.ACT_KV_HEADS, None))
                      for x in (k_BSKH, v_BSKH))
    return attention(q_BSNH, k_BSTH, v_BSTH, impl=impl, window=window, local=local)


def load_balance(batch: dict, perm) -> dict:
    """The batch with its sequence in load-balanced order, plus the positions of its tokens."""
    out = {k: ax.constrain(v[:, perm], (ax.ACT_BATCH, ax.ACT_SEQ)) for k, v in batch.items()}
    out["positions"] = ax.constrain(jnp.broadcast_to(perm, batch["inputs"].shape), (ax.ACT_BATCH, ax.ACT_SEQ))
    return out


def stage_attention(q_BSNH, k_BSKH, v_BSKH, *, impl: str, resolver: Callable, window: int | None = None,
                    local: bool | jax.Array = True) -> jax.Array:
    """Causal attention inside a pipeline stage, in a `shard_map` manual over the axes the stage's is not.

    Batch and heads are split as the rules table lays out attention's activations (`resolver`), the sequence never
    (each device needs all of its rows' keys); K/V heads take the query heads' axes, so each device keeps whole
    GQA groups, or stay whole with them. A traced `local` enters the manual region as an operand, so that the
    choice of window is a `lax.cond` with no collective inside.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not mesh.manual_axes:
        return local_attention(q_BSNH, k_BSKH, v_BSKH, impl=impl, window=window, local=local)
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
    flag = () if isinstance(local, bool) else (local,)

    def attend(q_BSNH, k_BSKH, v_BSKH, *flag):
        return local_attention(q_BSNH, k_BSKH, v_BSKH, impl=impl, window=window, local=flag[0] if flag else local)
    return jax.shard_map(attend, mesh=mesh, in_specs=(spec, spec, spec) + (PartitionSpec(),) * len(flag),
                         out_specs=spec, axis_names=set(free), check_vma=False)(q_BSNH, k_BSKH, v_BSKH, *flag)
