"""The rules table: logical dim names -> mesh axes, with presets and a first-match resolver.

A table is an ordered tuple of `(logical, mesh_axes)`. For each dim the first rule naming it wins; mesh axes of
size 1, axes that do not divide the dim, and axes already used by an earlier dim of the same tensor are dropped,
so one table serves every layout (`parallel.sharding.resolve`).

This module imports no jax: the config checks parse `parallel.rules` with it before jax loads.
"""
from __future__ import annotations

from collections.abc import Sequence

from mlm_jax.config import ConfigError
from mlm_jax.model import axes as ax

# Outer (slow links) to inner (fast). `stage` is outermost: pipeline stages are a shard_map manual over it, and the
# kernels nested inside them (expert and context parallelism) go manual over every other axis, which jax (0.11)
# allows only for axes that follow the outer manual ones in mesh order.
MESH_AXES = ("stage", "data", "fsdp", "context", "expert", "tensor")
DATA_AXES = ("data", "fsdp", "expert")  # the axes a batch is split over

Rules = tuple[tuple[str, tuple[str, ...]], ...]

_PARAMS: Rules = (
    (ax.VOCAB, ("tensor",)),
    (ax.EMBED, ("fsdp",)),
    (ax.HEADS, ("tensor",)),
    (ax.KV_HEADS, ("tensor",)),
    (ax.MLP, ("tensor",)),
    (ax.EXPERTS, ("expert",)),
    (ax.HEAD_DIM, ()),
    (ax.LAYERS, ("stage",)),  # pipeline stages hold their own layers
    (ax.NORM, ()),
)
_ACTIVATIONS: Rules = (
    (ax.ACT_BATCH, DATA_AXES),
    (ax.ACT_SEQ, ("context",)),
    (ax.ACT_SEQ_SP, ("context",)),
    (ax.ACT_EMBED, ()),
    (ax.ACT_HEADS, ("tensor",)),
    (ax.ACT_KV_HEADS, ("tensor",)),
    (ax.ACT_MLP, ("tensor",)),
    (ax.ACT_VOCAB, ("tensor",)),
)
_SP: Rules = ((ax.ACT_SEQ_SP, ("context", "tensor")),)

PRESETS: dict[str, Rules] = {
    # Megatron TP on `tensor`, FSDP (ZeRO-3) on `fsdp`, batch over data/fsdp/expert, sequence over `context`.
    "default": _PARAMS + _ACTIVATIONS,
    # default plus Megatron sequence parallelism: norm/residual activations split over `tensor` too.
    "tp_sp": _SP + _PARAMS + _ACTIVATIONS,
    # weights sharded over every data-parallel axis (no replica groups), not only `fsdp`.
    "fsdp_full": ((ax.EMBED, ("fsdp", "data", "expert")),) + _PARAMS + _ACTIVATIONS,
    # weights whole on every device (activations keep their rules): a debugging baseline.
    "replicated": tuple((name, ()) for name in ax.PARAM_AXES) + _ACTIVATIONS,
}


def make_rules(rules: str | Sequence, sequence_parallel: bool) -> Rules:
    """`parallel.rules` (a preset name, or a list of `[logical, mesh_axes]` overrides on top of `default`)."""
    if isinstance(rules, str):
        if rules not in PRESETS:
            raise ConfigError(f"parallel.rules={rules!r}: expected one of {', '.join(PRESETS)} or a list of rules")
        table = PRESETS[rules]
    elif isinstance(rules, (list, tuple)):
        table = tuple(_parse_rule(r) for r in rules) + PRESETS["default"]
    else:
        raise ConfigError(f"parallel.rules={rules!r}: expected a preset name or a list of [logical, mesh_axes]")
    return (_SP + table) if sequence_parallel else table


def _parse_rule(rule) -> tuple[str, tuple[str, ...]]:
    if not (isinstance(rule, (list, tuple)) and len(rule) == 2 and isinstance(rule[0], str)):
        raise ConfigError(f"parallel.rules entry {rule!r}: expected [logical_name, mesh_axes]")
    logical, mesh_axes = rule
    if logical not in ax.PARAM_AXES + ax.ACTIVATION_AXES:
        allowed = ", ".join(ax.PARAM_AXES + ax.ACTIVATION_AXES)
        raise ConfigError(f"parallel.rules entry {rule!r}: unknown logical name {logical!r} (one of {allowed})")
    mesh_axes = () if mesh_axes is None else (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)
    if len(set(mesh_axes)) != len(mesh_axes):
        raise ConfigError(f"parallel.rules entry {rule!r}: a mesh axis appears twice")
    for a in mesh_axes:
        if a not in MESH_AXES:
            raise ConfigError(f"parallel.rules entry {rule!r}: unknown mesh axis {a!r} (one of {', '.join(MESH_AXES)})")
    return logical, mesh_axes
