"""Parallel degrees -> device mesh (the degrees are resolved and checked by `mlm_jax.validation`).

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


def data_parallel_degree(degrees: dict[str, int]) -> int:
    return math.prod(degrees[a] for a in DATA_AXES)


def device_groups(devices) -> tuple[bool, int]:
    """(grouped by process rather than by slice, number of groups): what DCN degrees must multiply to."""
    slices = {getattr(d, "slice_index", None) for d in devices}
    by_process = None in slices or len(slices) == 1
    return by_process, len({d.process_index for d in devices}) if by_process else len(slices)


def build_mesh(degrees: dict[str, int], devices=None, dcn: dict[str, int] | None = None) -> Mesh:
    """Mesh over all (or the given) devices, axes outer to inner as in MESH_AXES, all automatic (GSPMD).

    `degrees` are totals; with DCN degrees (`dcn_degrees`) above 1 the mesh is hybrid: each slice (the devices'
    `slice_index`) or, where devices report none or only one, each process holds one block of `degrees / dcn`.
    """
    devices = list(devices) if devices is not None else jax.devices()
    axis_types = (AxisType.Auto,) * len(MESH_AXES)
    if dcn is None or math.prod(dcn.values()) == 1:
        return jax.make_mesh(tuple(degrees[a] for a in MESH_AXES), MESH_AXES, axis_types=axis_types, devices=devices)
    by_process, _ = device_groups(devices)
    ici_shape = tuple(degrees[a] // dcn[a] for a in MESH_AXES)
    try:
        grid = mesh_utils.create_hybrid_device_mesh(ici_shape, tuple(dcn[a] for a in MESH_AXES), devices,
                                                    process_is_granule=by_process)
    except ValueError as e:  # e.g. processes with unequal device counts
        raise ConfigError(f"cannot build the DCN mesh: {str(e).splitlines()[0]}") from None
    return Mesh(np.asarray(grid), MESH_AXES, axis_types=axis_types)
