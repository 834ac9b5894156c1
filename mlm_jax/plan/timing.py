"""A layout's step time, priced from one-GPU measurements of the program's own pieces plus its collectives.

Compute. `python -m mlm_jax.plan calibrate` trains, on one GPU, the model each layout's devices run locally: the
same layer with its heads, K/V heads, ffn, experts and vocabulary divided as tensor and expert parallelism divide
them, at the layout's rows per microbatch and sequence per device, with its recompute and loss chunks, at two layer
counts and with one and two microbatches. Four step times fit step(L, M) = a + b L + (M - 1)(c + d L): a + b L is
what a step pays once (the head, embedding and optimizer of a one-microbatch step), c + d L what each further
microbatch adds. The optimizer's part of a + b L is the traffic of AdamW over the weights a device holds
(`optimizer_seconds`), which sharding divides: it is taken out at the one GPU's weights and put back at the
layout's.

Pipelines. A stage runs its chunks' layers; the schedule simulator (`parallel.schedule`) times its ticks with a
chunk's forward a third of its microbatch cost and the backward two thirds, the head on the last chunk, so the
bubble is the simulator's for that schedule, V, M and the chunk sizes.

Communication (the overlap, in one place). Every collective costs its time on the link its groups use
(`collectives.seconds`), added to the compute, including those XLA's schedule runs beside compute (asynchronous,
with compute placed between start and done: `Collective.overlapped`, shown apart as "... beside compute"). Measured
on two H200s (benchmarks/results.jsonl, 2026-11-30), data- and fsdp-parallel llama-1b and llama3-8b steps exceeded
their one-GPU compute by at least their collectives' time although the schedule puts those beside the layers: the
collective kernels take SMs and memory bandwidth from the compute they run beside. Counting them as hidden
predicted those steps 6-11% fast, counting them in full 4-5% (docs/planner.md).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass

import jax.numpy as jnp

from mlm_jax.config import Config
from mlm_jax.parallel.schedule import SCHEDULES
from mlm_jax.plan.collectives import Links, link_class, seconds
from mlm_jax.plan.compiled import Compiled
from mlm_jax.plan.hardware import Gpu

ADAMW_BYTES = 28  # per weight a step: fp32 weight read and written, two fp32 moments read and written, gradient read
TABLES = os.path.join(os.path.dirname(__file__), "tables")


def optimizer_seconds(weights: int, gpu: Gpu) -> float:
    """AdamW's update of `weights` weights on one device: memory traffic at the GPU's HBM bandwidth."""
    return weights * ADAMW_BYTES / gpu.hbm_bandwidth


def local_model(cfg: Config, degrees: dict[str, int]) -> dict:
    """The model shape one device of the layout computes, as `model.*` values (what calibration trains)."""
    m, t = cfg.model, degrees["tensor"]
    out = {"hidden_size": m.hidden_size, "num_heads": m.num_heads // t, "ffn_size": m.ffn_size // t,
           "vocab_size": -(-m.vocab_size // t)}
    if not m.mla.enabled:  # latent attention's heads are all query heads, its head dims its own keys
        out.update({"num_kv_heads": max(1, m.kv_heads // t), "head_dim": m.dim_per_head})
    if m.moe.enabled:
        experts = m.moe.num_experts // degrees["expert"]
        out.update({"moe.num_experts": experts, "moe.top_k": min(m.moe.top_k, experts),
                    "moe.expert_ffn_size": m.expert_ffn // t})
    return out


@dataclass(frozen=True)
class Piece:
    """What one device computes per microbatch: its model shape, rows, tokens of sequence, and the settings that
    change the program's cost."""

    model: tuple[tuple[str, int], ...]
    rows: int
    seq: int
    remat: str
    loss_chunks: int
    dtype: str
    precision: str

    @property
    def key(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


def piece(cfg: Config, degrees: dict[str, int], accum_steps: int) -> Piece:
    dp = degrees["data"] * degrees["fsdp"] * degrees["expert"]
    m, t = cfg.model, cfg.train
    return Piece(tuple(sorted(local_model(cfg, degrees).items())), t.global_batch_size // (dp * accum_steps),
                 t.seq_len // degrees["context"], m.remat, t.loss_chunks, m.dtype, m.precision)


@dataclass(frozen=True)
class Fit:
    """step(L, M) = a + b L + (M - 1)(c + d L), seconds; `weights` the one GPU's count at L = 0 and per layer."""

    a: float
    b: float
    c: float
    d: float
    weights0: int
    weights_per_layer: int

    @classmethod
    def from_steps(cls, layers: tuple[int, int], steps: dict[tuple[int, int], float], weights: tuple[int, int]):
        """From the step times at (layers[0] or layers[1], M = 1 or 2) and the weight counts at both depths."""
        (l1, l2), s = layers, steps
        b = (s[l2, 1] - s[l1, 1]) / (l2 - l1)
        d = (s[l2, 2] - s[l1, 2]) / (l2 - l1) - b
        per_layer = (weights[1] - weights[0]) // (l2 - l1)
        return cls(s[l1, 1] - b * l1, b, s[l1, 2] - s[l1, 1] - d * l1, d, weights[0] - per_layer * l1, per_layer)


class Table:
    """The calibration of one GPU kind: `Fit`s by `Piece.key`, with where and when they were measured."""

    def __init__(self, gpu: str, fits: dict[str, Fit] | None = None, meta: dict | None = None):
        self.gpu, self.fits, self.meta = gpu, dict(fits or {}), dict(meta or {})

    @classmethod
    def load(cls, gpu: str, directory: str = TABLES) -> Table:
        path = os.path.join(directory, f"{gpu}.json")
        if not os.path.exists(path):
            return cls(gpu)
        with open(path) as f:
            raw = json.load(f)
        return cls(gpu, {k: Fit(**v) for k, v in raw["fits"].items()}, raw.get("meta"))

    def save(self, directory: str = TABLES) -> str:
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"{self.gpu}.json")
        with open(path, "w") as f:
            json.dump({"meta": self.meta, "fits": {k: dataclasses.asdict(v) for k, v in sorted(self.fits.items())}},
                      f, indent=1)
        return path


@dataclass(frozen=True)
class Estimate:
    step_time_s: float
    compute_s: float
    bubble: float
    exposed_s: dict[str, float]  # communication a step exposes, by link class
    calibrated: bool


def _schedule_time(per_layer: float, head: float, layers: tuple[int, ...], stages: int, virtual: int,
                   schedule: str, M: int) -> tuple[float, float]:
    """(the schedule's time for the microbatches' work, its bubble): a chunk's microbatch costs its layers'
    `per_layer`, the last chunk's `head` more; ticks run in lockstep, so the costliest chunk sets every tick."""
    sched = SCHEDULES[schedule](stages, virtual, M)
    chunk = max(n * per_layer + head * (i == len(layers) - 1) for i, n in enumerate(layers))
    return sched.time(chunk / 3, 2 * chunk / 3), sched.bubble()


def estimate(cfg: Config, compiled: Compiled, table: Table, gpu: Gpu, links: Links,
             fallback_mfu: float = 0.5) -> Estimate:
    """The step time of `compiled` (see the module docstring for the model); without a calibration of its piece,
    its FLOPs at `fallback_mfu` of the GPU's peak, marked uncalibrated."""
    d, M = compiled.degrees, compiled.accum_steps
    P, V, L = d["stage"], cfg.parallel.virtual_stages, cfg.model.num_layers
    local_weights = compiled.memory.params // jnp.dtype(cfg.model.param_dtype).itemsize
    fit = table.fits.get(piece(cfg, d, M).key)
    bubble = 0.0
    if fit is None:
        flops = compiled.flops_per_token * cfg.train.global_batch_size * cfg.train.seq_len / math.prod(d.values())
        compute = flops * (4 / 3 if cfg.model.remat == "full" else 1) / (gpu.peak_flops * fallback_mfu)
        if P > 1:
            bubble = SCHEDULES[cfg.parallel.pipeline_schedule](P, V, M).bubble()
            compute /= 1 - bubble
    else:
        # once a step: the fixed costs and the optimizer over this device's weights
        fixed = (fit.a - fit.c - optimizer_seconds(fit.weights0, gpu)
                 + (fit.b - fit.d - optimizer_seconds(fit.weights_per_layer, gpu)) * L / P
                 + optimizer_seconds(local_weights, gpu))
        if P > 1:
            work, bubble = _schedule_time(fit.d, fit.c, compiled.chunk_layers, P, V, cfg.parallel.pipeline_schedule,
                                          M)
        else:
            work = M * (fit.c + fit.d * L)
        compute = fixed + work
    exposed: dict[str, float] = {}
    for c in compiled.collectives:
        key = link_class(c, links) + (" beside compute" if c.overlapped else "")
        exposed[key] = exposed.get(key, 0.0) + seconds(c, links)
    return Estimate(compute + sum(exposed.values()), compute, bubble, exposed, fit is not None)
