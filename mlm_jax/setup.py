"""One set-up for training, generation and evaluation: a config and devices in, and out every check passed
(`validation.plan`), the mesh, the rules table, the activation layout and the kernels each layer runs.

The trainer builds its model and steps from `setup`; `infer.pretrained.load_pretrained` builds a checkpoint's model
from it (one device, or split over `tensor` devices), and generation lays out a model on its weights' mesh with
`on_mesh`, which adds the same layout kernels (`parallel.kernels.layout_kernels`).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from jax.sharding import Mesh

from mlm_jax.config import Config
from mlm_jax.model import axes as ax
from mlm_jax.model.kernels import Kernels
from mlm_jax.parallel import sharding as shd
from mlm_jax.parallel.kernels import layout_kernels
from mlm_jax.parallel.mesh import build_mesh, dcn_degrees
from mlm_jax.parallel.rules import MESH_AXES, Rules, make_rules
from mlm_jax.validation.plan import Plan, plan


@dataclass(frozen=True)
class Setup:
    mesh: Mesh
    rules: Rules
    resolver: Callable  # (names, shape) -> NamedSharding, by the rules table
    kernels: Kernels  # what the layers run under this layout (the plan's, plus the layout's own)
    prepare: Callable | None = None  # rewrites a batch once before the step (context parallelism's token order)
    plan: Plan | None = None  # a config's: degrees, microbatches, the kernels chosen for the devices, their names

    @property
    def layout(self):
        """The activation layout to trace the model's steps under (`model.axes.layout`)."""
        return ax.layout(shd.activation_layout(self.resolver))


def setup(cfg: Config, devices) -> Setup:
    """Checks `cfg` on `devices` (`ConfigError` before anything is traced) and builds what its steps run on."""
    devices = list(devices)
    p = plan(cfg, devices)
    mesh = build_mesh(p.degrees, devices, dcn_degrees(cfg))
    rules = make_rules(cfg.parallel.rules, cfg.parallel.sequence_parallel)
    m = cfg.model
    out = _laid_out(mesh, rules, p.kernels, p.degrees, kv_heads=m.kv_heads, moe=m.moe.enabled,
                    context_strategy=cfg.parallel.context_strategy, seq_len=cfg.train.seq_len)
    # FSDP: each layer's master weight cast on its shard before the gather, its gradient reduced in fp32
    return dataclasses.replace(out, kernels=dataclasses.replace(out.kernels, master=p.degrees["fsdp"] > 1), plan=p)


def on_mesh(mesh: Mesh, rules: Rules, kernels: Kernels, *, kv_heads: int | None, moe: bool) -> Setup:
    """What a model whose weights lie on `mesh` runs outside training (generation): its `kernels` with the layout's
    own, as `setup` adds them, but no pipeline stages or context-parallel attention (the sequence grows one
    position at a time)."""
    degrees = {a: mesh.shape.get(a, 1) for a in MESH_AXES} | {"stage": 1, "context": 1}
    return _laid_out(mesh, rules, kernels, degrees, kv_heads=kv_heads, moe=moe)


def _laid_out(mesh: Mesh, rules: Rules, kernels: Kernels, degrees: dict[str, int], **kw) -> Setup:
    resolver = shd.activation_resolver(mesh, rules)
    kernels, prepare = layout_kernels(kernels, mesh, degrees, resolver=resolver, **kw)
    return Setup(mesh, rules, resolver, kernels, prepare)
