"""One candidate layout compiled for N devices: the trainer's own train step, built from the config with the
candidate's overrides and compiled from the state's and batch's shapes (nothing is made), read for its memory (the
same report a run prints at its start) and its collectives, each tagged with the mesh axes its groups span."""
from __future__ import annotations

import dataclasses
import math
import tempfile
from dataclasses import dataclass

import numpy as np

from mlm_jax.config import Config
from mlm_jax.plan.collectives import Collective, collectives
from mlm_jax.train.loop import Trainer
from mlm_jax.train.memory import MemoryReport, memory_report, per_device_bytes

QUIET = ["train.eval_every=0", "checkpoint.save=false", "log.progress=never", "log.tensorboard=false"]


@dataclass(frozen=True)
class Compiled:
    """What the planner reads from a candidate's compiled step."""

    degrees: dict[str, int]
    accum_steps: int
    memory: MemoryReport
    collectives: tuple[tuple[Collective, tuple[str, ...]], ...]  # each with the mesh axes its groups span
    flops_per_token: float
    num_params: int
    chunk_layers: tuple[int, ...] | None  # layers per pipeline chunk (model order), None without stages
    whole: bool = True  # False: not compiled, the weights and optimizer state alone exceed the capacity


def axes_of(group: tuple[int, ...], mesh_shape: dict[str, int]) -> tuple[str, ...]:
    """The mesh axes whose coordinate changes within `group` (device positions in the mesh's flat order)."""
    coords = np.array(np.unravel_index(np.asarray(group), tuple(mesh_shape.values()))).T
    return tuple(a for i, a in enumerate(mesh_shape) if len(set(coords[:, i])) > 1)


def compile_layout(cfg: Config, devices, capacity: int | None) -> Compiled:
    """Compiles `cfg`'s train step for `devices` (raises `ConfigError` where validation refuses the layout)."""
    with tempfile.TemporaryDirectory(prefix="mlm_jax-plan-") as tmp:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, output_dir=tmp))
        trainer = Trainer(cfg, devices=devices)
    chunks = tuple(trainer.chunks.sizes) if trainer.chunks is not None else None
    state = trainer.abstract_state
    resident = per_device_bytes(state.params), per_device_bytes(state.opt_state)
    if capacity is not None and sum(resident) > capacity:  # no compilation can make it fit
        memory = MemoryReport(*resident, 0, sum(resident), capacity)
        return Compiled(dict(trainer.degrees), trainer.accum_steps, memory, (), trainer.flops_per_token,
                        trainer.num_params, chunks, whole=False)
    compiled = trainer.compile_step()
    memory = memory_report(compiled, state, capacity)
    shape = dict(trainer.mesh.shape)
    found = collectives(compiled.as_text(), num_devices=math.prod(shape.values()))
    tagged = tuple((c, tuple(sorted({a for g in c.groups for a in axes_of(g, shape)}))) for c in found)
    return Compiled(dict(trainer.degrees), trainer.accum_steps, memory, tagged, trainer.flops_per_token,
                    trainer.num_params, chunks)
