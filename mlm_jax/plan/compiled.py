"""One candidate layout compiled for N devices: the trainer's own train step, built from the config with the
candidate's overrides and compiled from the state's and batch's shapes (nothing is made), read for its memory (the
same report a run prints at its start) and its collectives."""
from __future__ import annotations

import dataclasses
import math
import tempfile
from dataclasses import dataclass

from mlm_jax.config import Config
from mlm_jax.plan.collectives import Collective, collectives
from mlm_jax.train.loop import Trainer
from mlm_jax.train.memory import MemoryReport, memory_report, per_device_bytes

PROBE_LAYERS = 4
QUIET = ["train.eval_every=0", "checkpoint.save=false", "log.progress=never", "log.tensorboard=false"]


@dataclass(frozen=True)
class Compiled:
    """What the planner reads from a candidate's compiled step."""

    degrees: dict[str, int]
    accum_steps: int
    memory: MemoryReport
    collectives: tuple[Collective, ...]
    flops_per_token: float
    num_params: int
    chunk_layers: tuple[int, ...] | None  # layers per pipeline chunk (model order), None without stages
    whole: bool = True  # False: not compiled, the weights and optimizer state alone exceed the capacity
    # probed (`_probed`) and already over the capacity at this many layers: `memory` is that depth's, not extrapolated
    over_at: int | None = None


def compile_layout(cfg: Config, devices, capacity: int | None, probe: bool = False) -> Compiled:
    """Compiles `cfg`'s train step for `devices` (raises `ConfigError` where validation refuses the layout).

    `probe`: compile at two shallower depths and extrapolate to the model's (`_probed`) where that takes at most half
    the layers (`probe_depths`)."""
    full = _trainer(cfg, devices)
    state = full.abstract_state
    chunks = tuple(full.chunks.sizes) if full.chunks is not None else None
    resident = per_device_bytes(state.params), per_device_bytes(state.opt_state)
    head = (dict(full.degrees), full.accum_steps)
    if capacity is not None and sum(resident) > capacity:  # no compilation can make it fit
        memory = MemoryReport(*resident, 0, sum(resident), capacity)
        return Compiled(*head, memory, (), full.flops_per_token, full.num_params, chunks, whole=False)
    depths = probe_depths(cfg, full.degrees["stage"]) if probe else None
    over_at = None
    if depths is None:
        memory, found = _read(full, capacity)
    else:
        memory, found, over_at = _probed(cfg, devices, capacity, depths, resident)
    return Compiled(*head, memory, found, full.flops_per_token, full.num_params, chunks, over_at=over_at)


def probe_depths(cfg: Config, stages: int) -> tuple[int, int] | None:
    """Two depths, k and 2k layers per pipeline chunk with at least `PROBE_LAYERS` layers in the shallower (XLA
    schedules one or two layers differently from many: an FSDP step of 1 and 2 layers extrapolated to llama-1b's 16
    understated its temporaries by 22%) and at least an eighth of the model (where the step's peak moves with depth,
    temporaries grow more slowly over the first layers: the 70B shape under fsdp 8 x tensor 8 with SP grows 0.13 GiB a
    layer from 4 to 8 layers, 0.40 from 16 on, and probes of 4 and 8 understated its 80 layers by 41%), or None where
    shallower models would not repeat the model's layers (a per-layer list of kinds, dense layers among MoE ones, an
    uneven pipeline split) or where the model is not deeper than them."""
    m, p = cfg.model, cfg.parallel
    unit = stages * p.virtual_stages
    unit *= -(-PROBE_LAYERS // unit)
    uniform = m.layer_types is None and (not m.moe.enabled or (
        m.moe.every_n_layers == 1 and not m.moe.first_dense_layers and not m.moe.dense_layers))
    if not uniform or p.pipeline_layers != "even" or m.num_layers < 6 * unit:  # at least twice as fast
        return None
    k = unit * -(-m.num_layers // (8 * unit))
    return k, 2 * k


def _trainer(cfg: Config, devices) -> Trainer:
    with tempfile.TemporaryDirectory(prefix="mlm_jax-plan-") as tmp:
        return Trainer(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, output_dir=tmp)), devices=devices)


def _read(trainer: Trainer, capacity: int | None):
    """(memory report, collectives) of the trainer's compiled step."""
    compiled = trainer.compile_step()
    found = collectives(compiled.as_text(), num_devices=math.prod(trainer.mesh.shape.values()))
    return memory_report(compiled, trainer.abstract_state, capacity), tuple(found)


def _probed(cfg: Config, devices, capacity, depths: tuple[int, int], resident: tuple[int, int]):
    """(memory, collectives, None) at the model's depth L from those at `depths` (l1, l2): the temporaries grow by
    the same amount per layer, and so does each collective's run count (collectives told apart by kind, bytes and
    groups); the weights and optimizer state are the model's own (`resident`).

    Where a probe is already over `capacity`, XLA's rematerialization pass has worked to bring it under the GPU's
    memory, so that memory is not linear in depth there (a step probed at 106 GiB compiled whole at 311): the step
    cannot fit, and that probe's own figures are returned with its depth, (memory, collectives, depth), rather than
    a shortfall that would mislead."""
    (l1, l2), L = depths, cfg.model.num_layers
    read = []
    for n in depths:
        read.append(_read(_trainer(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_layers=n)),
                                   devices), capacity))
        if capacity is not None and read[-1][0].total > capacity:
            return *read[-1], n

    def t(x1, x2):  # the value at depth L of what is x1 at l1 and x2 at l2
        return x1 + (x2 - x1) * (L - l1) / (l2 - l1)
    (m1, c1), (m2, c2) = read
    extra = round(t(m1.total - m1.params - m1.optimizer, m2.total - m2.params - m2.optimizer))
    memory = MemoryReport(*resident, round(t(m1.temporaries, m2.temporaries)), sum(resident) + extra, capacity)
    counts: dict = {}
    for i, found in enumerate((c1, c2)):
        for c in found:
            counts.setdefault(dataclasses.replace(c, count=1, computation=""), [0, 0])[i] += c.count
    return memory, tuple(dataclasses.replace(c, count=round(t(*n))) for c, n in counts.items()
                         if round(t(*n)) > 0), None
