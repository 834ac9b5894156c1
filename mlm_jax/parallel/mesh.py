"""Parallel degrees -> device mesh, and every check that needs the device count.

Across hosts (DCN), `parallel.dcn_<axis>` multiplies the in-host degree `parallel.<axis>` of the three outer axes:
the axis' total degree is their product, and the host (slice or process) index is the outer part of its index,
so only that axis' collectives cross the slow links.
"""
from __future__ import annotations

import math

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from mlm_jax.config import Config, ConfigError
from mlm_jax.parallel.rules import DATA_AXES, MESH_AXES


DCN_AXES = ("data", "stage", "fsdp")  # the axes that may span hosts: the outer ones, with the least traffic


def dcn_degrees(cfg: Config) -> dict[str, int]:
    """Across-host degree of every mesh axis (`parallel.dcn_<axis>`; 1 for the axes that stay inside a host)."""
    return {a: getattr(cfg.parallel, f"dcn_{a}") if a in DCN_AXES else 1 for a in MESH_AXES}


def resolve_degrees(cfg: Config, num_devices: int) -> dict[str, int]:
    """Total degrees of every mesh axis (in-host x DCN), the one -1 filled in, checked against the device count
    and the model."""
    p, dcn = cfg.parallel, dcn_degrees(cfg)
    hosts = math.prod(dcn.values())
    if num_devices % hosts:
        raise ConfigError(f"{_shown(dcn, 'dcn_')} multiply to {hosts}, which does not divide the {num_devices} devices")
    per_host = num_devices // hosts
    where = f"{per_host} devices" + (f" per DCN group ({_shown(dcn, 'dcn_')})" if hosts > 1 else "")
    degrees = {a: getattr(p, a) for a in MESH_AXES}
    known = math.prod(v for v in degrees.values() if v != -1)
    rest = [a for a, v in degrees.items() if v == -1]
    if rest:
        if per_host % known:
            raise ConfigError(
                f"parallel.{rest[0]}=-1: the other degrees multiply to {known}, which does not divide "
                f"the {where}")
        degrees[rest[0]] = per_host // known
    product = math.prod(degrees.values())
    if product != per_host:
        raise ConfigError(f"parallel degrees ({_shown(degrees, '')}) multiply to {product}, but {where} are present")
    degrees = {a: degrees[a] * dcn[a] for a in MESH_AXES}
    _check_layout(cfg, degrees)
    return degrees


def _shown(degrees: dict[str, int], prefix: str) -> str:
    return " x ".join(f"parallel.{prefix}{a}={v}" for a, v in degrees.items() if v != 1) or "all 1"


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
    cp = d["context"]
    if cp > 1 and t.seq_len % (2 * cp):
        raise ConfigError(f"train.seq_len={t.seq_len} is not divisible by 2 x parallel.context={cp} (causal load "
                          f"balancing cuts the sequence into 2 x context chunks)")
    if cp > 1 and P > 1 and cfg.parallel.context_strategy == "ring":
        raise ConfigError("parallel.context_strategy=ring cannot run inside pipeline stages (parallel.stage > 1): "
                          "its collective-permutes sit in stage-dependent branches, which XLA's collective-permute "
                          "rendezvous over all devices cannot serve; use parallel.context_strategy=allgather")
    if cp > 1 and m.attention_impl == "te":
        raise ConfigError("model.attention_impl=te cannot serve parallel.context > 1: context-parallel attention "
                          "runs cudnn (GPU) or xla blocks; use model.attention_impl=auto")
    moe = m.moe
    if moe.enabled and moe.num_experts % d["expert"]:
        raise ConfigError(f"model.moe.num_experts={moe.num_experts} is not divisible by parallel.expert={d['expert']}")
    if moe.enabled and P > 1:
        raise ConfigError(f"model.moe.num_experts={moe.num_experts} with parallel.stage={P}: MoE models do not run "
                          f"in the pipeline yet; use expert, fsdp, tensor or data parallelism")
    M = accumulation_steps(cfg, d)
    if P > 1 and M < P:
        raise ConfigError(f"{M} microbatch(es) cannot fill parallel.stage={P} pipeline stages: set "
                          f"train.num_microbatches >= {P}")
    if P > 1 and V > 1 and M % P:
        raise ConfigError(f"train.num_microbatches={M} must be a multiple of parallel.stage={P} with "
                          f"parallel.virtual_stages={V}")


def build_mesh(degrees: dict[str, int], devices=None, dcn: dict[str, int] | None = None) -> Mesh:
    """Mesh over all (or the given) devices, axes outer to inner as in MESH_AXES, all automatic (GSPMD).

    `degrees` are totals; with DCN degrees (`dcn_degrees`) above 1 the mesh is hybrid: each slice (the devices'
    `slice_index`) or, where devices report none or only one, each process holds one block of `degrees / dcn`.
    """
    devices = list(devices) if devices is not None else jax.devices()
    axis_types = (AxisType.Auto,) * len(MESH_AXES)
    if dcn is None or math.prod(dcn.values()) == 1:
        return jax.make_mesh(tuple(degrees[a] for a in MESH_AXES), MESH_AXES, axis_types=axis_types, devices=devices)
    slices = {getattr(d, "slice_index", None) for d in devices}
    by_process = None in slices or len(slices) == 1
    groups = len({d.process_index for d in devices}) if by_process else len(slices)
    hosts = math.prod(dcn.values())
    if hosts != groups:
        raise ConfigError(f"{_shown(dcn, 'dcn_')} multiply to {hosts}, but the devices span {groups} "
                          f"{'process(es)' if by_process else 'slices'}")
    ici_shape = tuple(degrees[a] // dcn[a] for a in MESH_AXES)
    try:
        grid = mesh_utils.create_hybrid_device_mesh(ici_shape, tuple(dcn[a] for a in MESH_AXES), devices,
                                                    process_is_granule=by_process)
    except ValueError as e:  # e.g. processes with unequal device counts
        raise ConfigError(f"cannot build the DCN mesh: {str(e).splitlines()[0]}") from None
    return Mesh(np.asarray(grid), MESH_AXES, axis_types=axis_types)
