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
    """Microbatches per step, M: global batch = micro batch x data-parallel degree x M.

    `train.micro_batch_size` and `train.num_microbatches` describe the same split; without either, M is 1 (or the
    pipeline depth, the fewest microbatches that fill a pipeline).
    """
    t = cfg.train
    dp = data_parallel_degree(degrees)
    B, micro, M = t.global_batch_size, t.micro_batch_size, t.num_microbatches
    if micro and M and micro * dp * M != B:
        raise ConfigError(f"train.micro_batch_size={micro} x data-parallel degree {dp} x train.num_microbatches={M} "
                          f"!= train.global_batch_size={B}")
    if not micro:
        M = M or (degrees["stage"] if degrees["stage"] > 1 else 1)
        if B % (dp * M):
            what = f"train.num_microbatches={M} x " if M > 1 else ""
            raise ConfigError(f"train.global_batch_size={B} is not divisible by {what}data-parallel degree {dp} "
                              f"(data x fsdp x expert)")
        return M
    if B % (dp * micro):
        raise ConfigError(f"train.global_batch_size={B} is not divisible by train.micro_batch_size={micro} x "
                          f"data-parallel degree {dp} (data x fsdp x expert)")
    return B // (dp * micro)


def _check_layout(cfg: Config, d: dict[str, int]) -> None:
    m, t = cfg.model, cfg.train
    P, V = d["stage"], cfg.parallel.virtual_stages
    if V > 1 and P == 1:
        raise ConfigError(f"parallel.virtual_stages={V} needs pipeline stages (parallel.stage > 1)")
    if m.num_layers % (P * V):
        what = f"parallel.stage={P}" + (f" x parallel.virtual_stages={V}" if V > 1 else "")
        raise ConfigError(f"model.num_layers={m.num_layers} is not divisible by {what}")
    if m.num_heads % d["tensor"]:
        raise ConfigError(f"model.num_heads={m.num_heads} is not divisible by parallel.tensor={d['tensor']}")
    if m.kv_heads % d["tensor"]:
        raise ConfigError(f"model.num_kv_heads={m.kv_heads} is not divisible by parallel.tensor={d['tensor']}")
    if t.seq_len % d["context"]:
        raise ConfigError(f"train.seq_len={t.seq_len} is not divisible by parallel.context={d['context']}")
    M = accumulation_steps(cfg, d)
    if P > 1 and M < P:
        raise ConfigError(f"{M} microbatch(es) cannot fill parallel.stage={P} pipeline stages: set "
                          f"train.num_microbatches >= {P}")
    if P > 1 and V > 1 and M % P:
        raise ConfigError(f"train.num_microbatches={M} must be a multiple of parallel.stage={P} with "
                          f"parallel.virtual_stages={V}")


def build_mesh(degrees: dict[str, int], devices=None) -> Mesh:
    """Mesh over all (or the given) devices, axes outer to inner as in MESH_AXES, all automatic (GSPMD)."""
    shape = tuple(degrees[a] for a in MESH_AXES)
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                         devices=devices if devices is not None else jax.devices())
