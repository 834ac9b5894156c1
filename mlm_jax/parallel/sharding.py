"""Shardings of parameters, optimizer state and activations, and the start-up sharding report."""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mlm_jax.parallel.rules import DATA_AXES, Rules


def resolve(names: Sequence[str | None], rules: Rules, mesh_shape: Mapping[str, int],
            shape: Sequence[int] | None = None) -> PartitionSpec:
    """PartitionSpec for a tensor whose dims carry `names` (None = unnamed, replicated)."""
    used: set[str] = set()
    spec = []
    for i, name in enumerate(names):
        kept: list[str] = []
        if name is not None:
            mesh_axes = next((m for logical, m in rules if logical == name), None)
            if mesh_axes is None:
                raise KeyError(f"no rule for logical dim {name!r}")
            parts = 1
            for a in mesh_axes:
                size = mesh_shape.get(a, 1)
                if size == 1 or a in used or a in kept or (shape is not None and shape[i] % (parts * size)):
                    continue
                kept.append(a)
                parts *= size
        used.update(kept)
        spec.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
    while spec and spec[-1] is None:
        spec.pop()
    return PartitionSpec(*spec)


def mesh_shape(mesh: Mesh) -> dict[str, int]:
    return dict(zip(mesh.axis_names, mesh.devices.shape))


def activation_resolver(mesh: Mesh, rules: Rules) -> Callable:
    """`(names, shape) -> NamedSharding`: where the rules table puts an activation of these logical dims."""
    shape_of = mesh_shape(mesh)
    return lambda names, shape: NamedSharding(mesh, resolve(names, rules, shape_of, shape))


def activation_layout(resolver: Callable) -> Callable:
    """`(x, names) -> x` pinned to where `resolver` (`activation_resolver`) puts it: what `model.axes.constrain`
    applies while it is installed (`model.axes.layout`)."""
    return lambda x, names: jax.lax.with_sharding_constraint(x, resolver(names, x.shape))


def param_specs(names_tree, shapes_tree, mesh: Mesh, rules: Rules):
    """PartitionSpec per parameter from its logical dim names (a tree of PartitionSpecs of logical names)."""
    shape_of = mesh_shape(mesh)
    return jax.tree.map(lambda names, x: resolve(tuple(names), rules, shape_of, x.shape), names_tree, shapes_tree,
                        is_leaf=lambda n: isinstance(n, PartitionSpec))


def zero1_spec(spec: PartitionSpec, shape, mesh: Mesh) -> PartitionSpec:
    """`spec` with the data-parallel axes it does not use added to the largest dim they divide (ZeRO-1)."""
    shape_of = mesh_shape(mesh)
    entries = list(spec) + [None] * (len(shape) - len(spec))
    used = {a for e in entries if e for a in ((e,) if isinstance(e, str) else e)}
    extra = tuple(a for a in DATA_AXES if shape_of[a] > 1 and a not in used)
    if not extra:
        return spec
    for dim in sorted(range(len(shape)), key=lambda i: -shape[i]):
        current = () if entries[dim] is None else (entries[dim],) if isinstance(entries[dim], str) else entries[dim]
        parts = math.prod(shape_of[a] for a in current + extra)
        if shape[dim] % parts == 0:
            entries[dim] = current + extra if current else (extra[0] if len(extra) == 1 else extra)
            while entries and entries[-1] is None:
                entries.pop()
            return PartitionSpec(*entries)
    return spec


def named(mesh: Mesh, specs):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, PartitionSpec))


def bytes_per_device(shape, dtype, spec: PartitionSpec, mesh: Mesh) -> int:
    shape_of = mesh_shape(mesh)
    parts = math.prod(shape_of[a] for e in spec if e for a in ((e,) if isinstance(e, str) else e))
    return math.prod(shape) * np.dtype(dtype).itemsize // parts


def sharding_report(rules: Rules, mesh: Mesh, shapes_tree, names_tree, specs_tree, master_specs_tree) -> str:
    """Rules table, mesh, and every parameter's logical names, PartitionSpec and bytes per device."""
    lines = ["mesh: " + " x ".join(f"{a}={n}" for a, n in mesh_shape(mesh).items()), "rules (first match wins):"]
    lines += [f"  {logical:<14} -> {', '.join(axes) or '-'}" for logical, axes in rules]
    lines.append("parameters: path | shape | logical | compute spec | master/optimizer spec | master bytes/device")
    flat = jax.tree_util.tree_flatten_with_path(shapes_tree)[0]
    names = jax.tree.leaves(names_tree, is_leaf=lambda n: isinstance(n, PartitionSpec))
    specs = jax.tree.leaves(specs_tree, is_leaf=lambda n: isinstance(n, PartitionSpec))
    masters = jax.tree.leaves(master_specs_tree, is_leaf=lambda n: isinstance(n, PartitionSpec))
    total = 0
    for (path, x), n, s, ms in zip(flat, names, specs, masters):
        b = bytes_per_device(x.shape, x.dtype, ms, mesh)
        total += b
        key = "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
        lines.append(f"  {key} | {tuple(x.shape)} | {tuple(n)} | {s} | {ms} | {b:,}")
    lines.append(f"master parameter bytes per device: {total:,}")
    return "\n".join(lines)
