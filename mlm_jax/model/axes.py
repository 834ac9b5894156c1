"""Logical axis names, the only names layers may attach to parameters and activations, and `constrain`, which lays
an activation out by its names.

Parameters and activations carry separate names: FSDP shards a weight's `embed` dim but never an activation's.
`constrain(x, names)` applies whatever layout the caller installed for the trace (`layout`, built from the mesh and
the rules table by `parallel.sharding.activation_layout`), so layers stay free of meshes; with none installed it is
the identity (one device, notebooks, tests). The implementations a layer runs are not found here: they are passed to
it when it is built (`model.kernels.Kernels`).

This module imports nothing (no jax): the rules table and the config checks read its names without loading jax.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Sequence
from typing import Any

# Parameter dims.
VOCAB = "vocab"  # vocabulary dim of the embedding and the output head
EMBED = "embed"  # model dim of a weight (FSDP shards this one)
HEADS = "heads"  # query heads of a weight
KV_HEADS = "kv_heads"  # key/value heads of a weight
HEAD_DIM = "head_dim"  # per-head dim, never sharded
MLP = "mlp"  # FFN hidden dim of a weight
EXPERTS = "experts"  # expert dim of MoE weights
LAYERS = "layers"  # stacked-layer dim of scanned weights
NORM = "norm"  # the single dim of a norm's scale or bias

# Activation dims.
ACT_BATCH = "act_batch"  # batch of activations (the data-parallel axes)
ACT_SEQ = "act_seq"  # sequence inside attention and the MLP
ACT_SEQ_SP = "act_seq_sp"  # sequence in the norm/residual regions (sequence parallelism shards it)
ACT_EMBED = "act_embed"  # model dim of activations
ACT_HEADS = "act_heads"  # query heads of activations
ACT_KV_HEADS = "act_kv_heads"  # key/value heads of activations
ACT_MLP = "act_mlp"  # FFN hidden dim of activations
ACT_VOCAB = "act_vocab"  # vocabulary dim of logits

PARAM_AXES = (VOCAB, EMBED, HEADS, KV_HEADS, HEAD_DIM, MLP, EXPERTS, LAYERS, NORM)
ACTIVATION_AXES = (ACT_BATCH, ACT_SEQ, ACT_SEQ_SP, ACT_EMBED, ACT_HEADS, ACT_KV_HEADS, ACT_MLP, ACT_VOCAB)

Names = Sequence[str | None]
Layout = Callable[[Any, Names], Any]  # (x, names) -> x pinned to the layout its names resolve to
_layout: contextvars.ContextVar[Layout | None] = contextvars.ContextVar("mlm_jax_activation_layout", default=None)


@contextlib.contextmanager
def layout(apply: Layout):
    """Install `apply(x, names)` for `constrain` while tracing inside this context."""
    token = _layout.set(apply)
    try:
        yield
    finally:
        _layout.reset(token)


def constrain(x, names: Names):
    """Pin activation `x` to the layout its logical dim names resolve to (identity without an installed layout)."""
    apply = _layout.get()
    if apply is None:
        return x
    assert len(names) == x.ndim, (names, x.shape)
    return apply(x, names)
