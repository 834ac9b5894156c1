"""Logical axis names, the only names layers may attach to parameters and activations.

Parameters and activations carry separate names: FSDP shards a weight's `embed` dim but never an activation's.
`constrain(x, names)` resolves names with whatever resolver the trainer installed (`activation_resolver`), so
layers stay free of meshes; with none installed it is the identity (one device, notebooks, tests).

The few computations that need explicit collectives (context-parallel attention, expert-parallel dispatch) are
likewise swapped in by the trainer through `kernels(...)`; a layer asks `kernel(name)` and computes locally when
none is installed.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Sequence

import jax

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

# Kernel names for `kernels`/`kernel`.
ATTENTION = "attention"  # (q_BSNH, k_BSKH, v_BSKH) -> out_BSNH, causal
EXPERT_FFN = "expert_ffn"  # layers.experts.expert_ffn's signature, minus `impl`-independent arguments
MASTER_EINSUM = "master_einsum"  # layers.linear.master_einsum's signature: Linear's product from the master weight
FEW_ROWS = "few_rows"  # (equation, x, kernel) -> jnp.einsum(...): a bf16 `Linear`'s product (decode steps)
CACHED_ATTENTION = "cached_attention"  # layers.flash_decode.step: a decode step's attention over the cache
RESIDUAL = "residual"  # layers.gemv.add_residual: a decode step's residual add and the next RMSNorm's factor
GATED = "gated"  # layers.gemv.gated: a gated MLP's fused gate/up product and activation (decode steps), or None

Names = Sequence[str | None]
_kernels: contextvars.ContextVar[dict[str, Callable]] = contextvars.ContextVar("mlm_jax_kernels", default={})
_resolver: contextvars.ContextVar[Callable[[Names, tuple[int, ...]], jax.sharding.Sharding] | None] = contextvars.ContextVar(
    "mlm_jax_activation_resolver", default=None)


@contextlib.contextmanager
def activation_resolver(resolve: Callable[[Names, tuple[int, ...]], jax.sharding.Sharding]):
    """Install `resolve(names, shape) -> Sharding` for `constrain` while tracing inside this context."""
    token = _resolver.set(resolve)
    try:
        yield
    finally:
        _resolver.reset(token)


def constrain(x: jax.Array, names: Names) -> jax.Array:
    """Pin activation `x` to the sharding its logical dim names resolve to (identity without a resolver)."""
    resolve = _resolver.get()
    if resolve is None:
        return x
    assert len(names) == x.ndim, (names, x.shape)
    return jax.lax.with_sharding_constraint(x, resolve(names, x.shape))


@contextlib.contextmanager
def kernels(**fns: Callable):
    """Install replacement kernels by name (`ATTENTION`, `EXPERT_FFN`) while tracing inside this context."""
    token = _kernels.set({**_kernels.get(), **fns})
    try:
        yield
    finally:
        _kernels.reset(token)


def kernel(name: str) -> Callable | None:
    """The kernel the trainer installed under `name`, or None (compute locally)."""
    return _kernels.get().get(name)
