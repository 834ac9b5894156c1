"""The explicit-collective kernels a layout needs, for `train.step` to install (`layers.axes.kernels`).

Context parallelism replaces attention with `context.context_attention` and permutes every batch once into the
load-balanced order (rank r holds chunks r and 2*cp-1-r), with the RoPE positions travelling with the tokens; the
loss is a mean over tokens, so the permutation leaves it unchanged. Expert parallelism replaces the experts'
computation with `expert.expert_parallel_ffn` whenever tokens are split over devices (with `expert` = 1 too: each
device then sorts and multiplies only its own tokens, and the Hopper grouped GEMM is never partitioned by XLA).
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import jax.numpy as jnp
from jax.sharding import Mesh

from mlm_jax.config import Config
from mlm_jax.layers import axes as ax
from mlm_jax.parallel.context import context_attention, load_balance_order
from mlm_jax.parallel.expert import expert_parallel_ffn


def parallel_kernels(cfg: Config, mesh: Mesh, degrees: dict[str, int]) -> tuple[dict[str, Callable], Callable | None]:
    """(kernels by name, batch preparation or None) for this layout."""
    kernels, prepare = {}, None
    cp = degrees["context"]
    if cp > 1:
        kernels[ax.ATTENTION] = functools.partial(context_attention, mesh=mesh,
                                                  strategy=cfg.parallel.context_strategy)
        prepare = functools.partial(load_balance, perm=jnp.asarray(load_balance_order(cfg.train.seq_len, cp)))
    if cfg.model.moe.enabled and any(degrees[a] > 1 for a in ("data", "fsdp", "context", "expert", "tensor")):
        kernels[ax.EXPERT_FFN] = functools.partial(expert_parallel_ffn, mesh=mesh)
    return kernels, prepare


def load_balance(batch: dict, perm) -> dict:
    """The batch with its sequence in load-balanced order, plus the positions of its tokens."""
    out = {k: ax.constrain(v[:, perm], (ax.ACT_BATCH, ax.ACT_SEQ)) for k, v in batch.items()}
    out["positions"] = ax.constrain(jnp.broadcast_to(perm, batch["inputs"].shape), (ax.ACT_BATCH, ax.ACT_SEQ))
    return out
