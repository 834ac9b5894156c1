"""The search: every split of the devices (`space.splits`), each tried with its settings fastest first until one
fits, each compiled (`compiled.compile_layout`, or the cache of an earlier call) and priced (`timing.estimate`);
what validation refuses or what fits nowhere is kept with its one-line reason. Splits are independent, so `jobs`
processes can search them at once (compiling is the plan's cost)."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass

import jax

from mlm_jax.config import ConfigError, to_yaml
from mlm_jax.plan import space
from mlm_jax.plan.collectives import Collective, Links
from mlm_jax.plan.compiled import QUIET, Compiled, compile_layout
from mlm_jax.plan.hardware import GIB, Gpu
from mlm_jax.plan.target import Target
from mlm_jax.plan.timing import Estimate, Table, estimate
from mlm_jax.train.memory import MemoryReport
from mlm_jax.validation.config import load_config


@dataclass(frozen=True)
class Candidate:
    """A layout the planner looked at: its overrides, and either its compiled figures and estimate or why not."""

    split: space.Split
    setting: space.Setting | None
    overrides: list[str]
    compiled: Compiled | None = None
    estimate: Estimate | None = None
    reason: str | None = None

    @property
    def fits(self) -> bool:
        return self.estimate is not None

    def record(self, cfg, gpu: Gpu, gpus: int) -> dict:
        """One JSON object: overrides, predicted step time, tokens/s per GPU, MFU, memory, whether it fits, why not."""
        out = {"layout": self.split.describe(), "setting": self.setting and self.setting.describe(),
               "overrides": self.overrides, "fits": self.fits, "reason": self.reason}
        if self.compiled is not None:
            m = self.compiled.memory
            out |= {"memory_gib": m.total / GIB, "params_gib": m.params / GIB, "optimizer_gib": m.optimizer / GIB,
                    "temporaries_gib": m.temporaries / GIB}
        if self.estimate is not None:
            e, t = self.estimate, cfg.train
            tokens = t.global_batch_size * t.seq_len / e.step_time_s
            out |= {"step_time_s": e.step_time_s, "tokens_per_s_per_gpu": tokens / gpus,
                    "mfu": self.compiled.flops_per_token * tokens / gpus / gpu.peak_flops, "compute_s": e.compute_s,
                    "bubble": e.bubble, "exposed_s": e.exposed_s, "calibrated": e.calibrated}
        return out


@functools.cache
def _source_hash() -> str:
    """The package's source: a cached compilation is reused only by the code that made it."""
    h = hashlib.sha256()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for folder, _, files in sorted(os.walk(root)):
        for name in sorted(f for f in files if f.endswith(".py")):
            with open(os.path.join(folder, name), "rb") as f:
                h.update(f.read())
    return h.hexdigest()


class Cache:
    """Compiled figures on disk by (config, devices, jax, source): a second plan reads instead of compiling."""

    def __init__(self, directory: str | None):
        self.directory = directory

    def key(self, cfg, devices, probe: bool) -> str:
        d = devices[0]
        text = "\n".join([to_yaml(cfg), d.platform, d.device_kind, str(len(devices)), jax.__version__,
                          _source_hash(), str(probe)])
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def get(self, key: str) -> Compiled | None:
        path = self.directory and os.path.join(self.directory, key + ".json")
        if not path or not os.path.exists(path):
            return None
        with open(path) as f:
            raw = json.load(f)
        return dataclasses.replace(
            Compiled(**raw), memory=MemoryReport(**raw["memory"]),
            collectives=tuple(Collective(**{**c, "groups": tuple(map(tuple, c["groups"]))}) for c in raw["collectives"]),
            chunk_layers=raw["chunk_layers"] and tuple(raw["chunk_layers"]))

    def put(self, key: str, compiled: Compiled) -> None:
        if not self.directory:
            return
        os.makedirs(self.directory, exist_ok=True)
        with open(os.path.join(self.directory, key + ".json"), "w") as f:
            json.dump(dataclasses.asdict(compiled), f)


def search(path: str | None, overrides: list[str], target: Target, links: Links, table: Table, cache: Cache,
           capacity: int, remats: tuple[str, ...] = space.REMATS, probe: bool = False, jobs: int = 1,
           progress: Callable[[int, int, str], None] = lambda i, n, what: None) -> list[Candidate]:
    """Every split's best fitting setting, ranked by predicted tokens/s (fitting first), then the rest with why;
    `probe`: deep models compiled at two shallower depths (`compiled.compile_layout`); `jobs` > 1: that many
    processes search the splits (each builds the target's devices and compiles on its own)."""
    base = load_config(path, overrides)
    splits = space.splits(base, target.count, links.gpus_per_node, space.fixed(overrides))
    args = (path, overrides, target, links, table, cache, capacity, remats, probe)
    if jobs <= 1:
        out = []
        for i, split in enumerate(splits):
            progress(i, len(splits), split.describe())
            out.append(_best_setting(split, *args))
    else:
        progress(0, len(splits), f"{jobs} processes")
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_exit_with,
                                 initargs=(os.getpid(),)) as pool:
            futures = {pool.submit(_best_setting, split, *args): split for split in splits}
            for i, done in enumerate(as_completed(futures), 1):
                progress(i, len(splits), futures[done].describe())
            out = [f.result() for f in futures]
    progress(len(splits), len(splits), "")
    ranked = sorted((c for c in out if c.fits), key=lambda c: c.estimate.step_time_s)
    return ranked + [c for c in out if not c.fits]


def _exit_with(parent: int, every_s: float = 1.0) -> None:
    """A search process's watch on the planner that started it: a planner ended by a signal runs no clean-up, and
    its processes would go on compiling for nobody; each ends itself once its parent is gone."""
    def watch():
        while os.getppid() == parent:
            time.sleep(every_s)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def _groups(settings: list[space.Setting]) -> list[list[list[space.Setting]]]:
    """The settings per recompute setting, per micro batch, in the order given (fastest first)."""
    out: dict = {}
    for setting in settings:
        out.setdefault(setting.remat, {}).setdefault(setting.micro_batch, []).append(setting)
    return [list(per_micro.values()) for per_micro in out.values()]


def _best_setting(split, path, overrides, target, links, table, cache, capacity, remats, probe) -> Candidate:
    """The split's first setting (fastest first) that validation accepts and that fits `capacity`.

    Memory grows with the micro batch, and ZeRO-1 and loss chunks only take memory away, so not every setting is
    compiled: the fastest first (it fits often); then per recompute setting the leanest at the smallest micro
    batch, and if that fits, a bisection over the micro batches (each judged by its leanest variant), and at the
    largest that fits its variants in order. Where nothing fits, the leanest settings tried give the shortfall."""
    devices = target.devices()
    reason = "no micro batch divides the batch"
    base = load_config(path, [*overrides, *split.overrides, *QUIET])
    tried: dict[space.Setting, tuple | None] = {}

    def attempt(setting: space.Setting):
        """(config, compiled) of the setting, or None where validation refuses it (its reason kept)."""
        nonlocal reason
        if setting not in tried:
            try:
                cfg = load_config(path, [*overrides, *split.overrides, *setting.overrides, *QUIET])
                key = cache.key(cfg, devices, probe)
                compiled = cache.get(key)
                if compiled is None:
                    compiled = compile_layout(cfg, devices, capacity, probe)
                    cache.put(key, compiled)
                tried[setting] = cfg, compiled
            except ConfigError as e:
                reason, tried[setting] = str(e), None
        return tried[setting]

    def fitting(setting: space.Setting) -> Candidate | None:
        got = attempt(setting)
        if got is None or got[1].memory.total > capacity:
            return None
        cfg, compiled = got
        return Candidate(split, setting, [*split.overrides, *setting.overrides], compiled,
                         estimate(cfg, compiled, table, target.gpu, links))

    def fits(variants: list[space.Setting]) -> bool:
        """Whether a micro batch fits under some variant: its leanest one that validation accepts decides."""
        for setting in reversed(variants):
            if (got := attempt(setting)) is not None:
                return got[1].memory.total <= capacity
        return False

    groups = _groups(space.settings(base, split, remats, space.fixed(overrides)))
    if groups and (first := fitting(groups[0][0][0])):
        return first
    for per_micro in groups:
        if not fits(per_micro[-1]):
            continue
        lo, hi = 0, len(per_micro) - 1  # per_micro[hi] fits: find the largest micro batch that does
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(per_micro[mid]) else (mid + 1, hi)
        for setting in per_micro[lo]:
            if found := fitting(setting):
                return found
    closest = None
    rank = lambda c: (c.over_at is not None, c.memory.total)  # whole figures first
    for setting, got in tried.items():
        if got is not None and (closest is None or rank(got[1]) < rank(closest.compiled)):
            closest = Candidate(split, setting, [*split.overrides, *setting.overrides], got[1])
    if closest is None:
        return Candidate(split, None, split.overrides, reason=reason)
    m, c = closest.compiled.memory, closest.compiled
    if c.over_at is not None:
        return dataclasses.replace(closest, reason=(
            f"does not fit: over already at {c.over_at} of its {base.model.num_layers} layers at best "
            f"({closest.setting.describe()}: {m.describe()}; without --probe for the whole model's figure)"))
    why = m.describe() if c.whole else (
        f"parameters {m.params / GIB:.2f} GiB and optimizer state {m.optimizer / GIB:.2f} GiB per device alone, "
        f"not compiled")
    return dataclasses.replace(closest, reason=f"does not fit by {(m.total - capacity) / GIB:.1f} GiB at best "
                                               f"({closest.setting.describe()}: {why})")
