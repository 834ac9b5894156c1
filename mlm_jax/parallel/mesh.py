"""Parallel degrees -> device mesh, and every check that needs the device count."""
from __future__ import annotations

import math

import jax
from jax.sharding import AxisType, Mesh

from mlm_jax.config import Config, ConfigError
from mlm_jax.parallel.rules import DATA_AXES, MESH_AXES


def resolve_degrees(cfg: Config, num_devices: int) -> dict[str, int]:
    """Degrees of every mesh axis, the one -1 filled in, checked against the device count and the model."""
    p = cfg.parallel
    degrees = {a: getattr(p, a) for a in MESH_AXES}
    known = math.prod(v for v in degrees.values() if v != -1)
    rest = [a for a, v in degrees.items() if v == -1]
    if rest:
        if num_devices % known:
            raise ConfigError(
                f"parallel.{rest[0]}=-1: the other degrees multiply to {known}, which does not divide "
                f"the {num_devices} devices")
        degrees[rest[0]] = num_devices // known
    product = math.prod(degrees.values())
    if product != num_devices:
        shown = " x ".join(f"parallel.{a}={v}" for a, v in degrees.items() if v != 1) or "all 1"
        raise ConfigError(f"parallel degrees ({shown}) multiply to {product}, but {num_devices} devices are present")
    _check_layout(cfg, degrees)
    return degrees


def data_parallel_degree(degrees: dict[str, int]) -> int:
    return math.prod(degrees[a] for a in DATA_AXES)


def accumulation_steps(cfg: Config, degrees: dict[str, int]) -> int:
    """Microbatches per step: global batch / (micro batch x data-parallel degree), 1 without a micro batch."""
    t = cfg.train
    dp = data_parallel_degree(degrees)
    micro = t.micro_batch_size or max(t.global_batch_size // dp, 1)
    if t.global_batch_size % (dp * micro):
        what = f"train.micro_batch_size={t.micro_batch_size} x " if t.micro_batch_size else ""
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} is not divisible by {what}data-parallel degree {dp} "
            f"(data x fsdp x expert)")
    return t.global_batch_size // (dp * micro)


def _check_layout(cfg: Config, d: dict[str, int]) -> None:
    m, t = cfg.model, cfg.train
    if d["stage"] > 1:
        if m.num_layers % d["stage"]:
            raise ConfigError(f"model.num_layers={m.num_layers} is not divisible by parallel.stage={d['stage']}")
        raise ConfigError(f"parallel.stage={d['stage']}: pipeline parallelism is not available yet; use stage=1")
    if m.num_heads % d["tensor"]:
        raise ConfigError(f"model.num_heads={m.num_heads} is not divisible by parallel.tensor={d['tensor']}")
    if m.kv_heads % d["tensor"]:
        raise ConfigError(f"model.num_kv_heads={m.kv_heads} is not divisible by parallel.tensor={d['tensor']}")
    if t.seq_len % d["context"]:
        raise ConfigError(f"train.seq_len={t.seq_len} is not divisible by parallel.context={d['context']}")
    accumulation_steps(cfg, d)


def build_mesh(degrees: dict[str, int], devices=None) -> Mesh:
    """Mesh over all (or the given) devices, axes outer to inner as in MESH_AXES, all automatic (GSPMD)."""
    shape = tuple(degrees[a] for a in MESH_AXES)
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                         devices=devices if devices is not None else jax.devices())
