"""The 1F1B and zb1 executor's stash (`pipeline`): what a stage keeps from a chunk's forward to its backward, in
slots allocated from the schedule's tables like registers, and a chunk's VJP as the arrays it keeps."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from mlm_jax.parallel.schedule import Schedule


@dataclasses.dataclass(frozen=True)
class Stash:
    """What a stage keeps from a chunk's forward to its backward (1F1B, zb1): `slots` of one chunk's residuals
    (`residual_bytes`) and, for a split schedule, `cotangent_slots` of the cotangents its deferred W reads
    (`cotangent_bytes`), in bytes of the stage's program: shapes whole over the mesh axes other than `stage`, which
    XLA then splits."""

    slots: int
    residual_bytes: int
    cotangent_slots: int = 0
    cotangent_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.slots * self.residual_bytes + self.cotangent_slots * self.cotangent_bytes

    def describe(self) -> str:
        cotangents = f" and {self.cotangent_slots} of W's cotangents" if self.cotangent_slots else ""
        return f"{self.slots} slots of a chunk's residuals{cotangents}, {self.total_bytes / 2**30:.2f} GiB a stage"


def nbytes(shapes) -> int:
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(shapes))


class Residuals:
    """A chunk's VJP as stashable arrays: the residual leaves of `jax.vjp`'s pullback, less the chunk's weights
    (the pullback closes over them; they are passed again when it is rebuilt, never stashed)."""

    def __init__(self):
        self.treedef, self.weight_at = None, None

    def split(self, pullback, weights) -> list[jax.Array]:
        leaves, treedef = jax.tree.flatten(pullback)
        index = {id(w): j for j, w in enumerate(jax.tree.leaves(weights))}
        weight_at = tuple(index.get(id(leaf)) for leaf in leaves)
        if self.treedef is None:  # the first trace's structure serves every tick (the pullback's jaxpr is static)
            self.treedef, self.weight_at = treedef, weight_at
        assert weight_at == self.weight_at, "the chunk's VJP changed structure between traces"
        return [leaf for leaf, j in zip(leaves, weight_at) if j is None]

    def join(self, stashed: list[jax.Array], weights):
        w, it = jax.tree.leaves(weights), iter(stashed)
        return jax.tree.unflatten(self.treedef, [next(it) if j is None else w[j] for j in self.weight_at])


def segments(schedule: Schedule) -> list[tuple[int, int, bool, bool, bool]]:
    """The ticks as runs (start, stop, forward slot runs, backward slot runs, weight gradients deferred): a slot
    that no stage uses over a run of ticks (the warm-up's backward, the cool-down's forward) is left out of that
    run's program. A split schedule's tick where every stage's W is its own B of that tick runs the whole
    backward in the B slot, as 1F1B does; only the other ticks split it and defer W."""
    runs: list[list] = []
    weight = schedule.weight or schedule.backward
    for t, (fw, bw, ww) in enumerate(zip(schedule.forward, schedule.backward, weight)):
        kind = (any(w is not None for w in fw), any(w is not None for w in bw), tuple(bw) != tuple(ww))
        if runs and tuple(runs[-1][2:]) == kind:
            runs[-1][1] = t + 1
        else:
            runs.append([t, t + 1, *kind])
    return [tuple(r) for r in runs]


@dataclasses.dataclass(frozen=True)
class StashPlan:
    """Slot tables [tick, stage] of the residual stash and of the cotangent stash (a split schedule's deferred W
    reads what its B kept), and the slot counts each stage allocates."""

    res_write: np.ndarray  # where the forward slot writes its chunk's residuals
    res_b: np.ndarray  # where the backward slot reads them
    res_w: np.ndarray  # where a deferred W reads them
    res_slots: int
    cot_write: np.ndarray  # where a deferred tick's B writes the cotangents W needs
    cot_w: np.ndarray  # where W reads them
    cot_slots: int


def stash_plan(schedule: Schedule, runs) -> StashPlan:
    """The slot tables of `schedule` run as `runs` (`segments`): a chunk's residuals live from its F to its
    backward, or to its W where that tick defers it; a deferred tick's cotangents from its B to its W."""
    P, ticks = schedule.stages, schedule.ticks
    deferred = np.zeros(ticks, bool)
    runs_f = np.zeros(ticks, bool)
    for start, stop, run_f, _, defer in runs:
        deferred[start:stop], runs_f[start:stop] = defer, run_f
    weight = schedule.weight or schedule.backward
    when = {name: [{} for _ in range(P)] for name in ("f", "b", "w")}
    for name, table in (("f", schedule.forward), ("b", schedule.backward), ("w", weight)):
        for t, row in enumerate(table):
            for p, work in enumerate(row):
                if work is not None:
                    when[name][p][work] = t
    res_lives = [{k: (t, when["w"][p][k] if deferred[when["b"][p][k]] else when["b"][p][k])
                  for k, t in when["f"][p].items()} for p in range(P)]
    res_rows = [[w if runs_f[t] else ... for w in row] for t, row in enumerate(schedule.forward)]
    res_write, res_where, res_slots = _allocate(res_rows, res_lives)
    cot_lives = [{k: (t, when["w"][p][k]) for k, t in when["b"][p].items() if deferred[t]} for p in range(P)]
    cot_rows = [[w if deferred[t] else ... for w in row] for t, row in enumerate(schedule.backward)]
    cot_write, cot_where, cot_slots = _allocate(cot_rows, cot_lives)
    w_rows = [[w if deferred[t] else None for w in row] for t, row in enumerate(weight)]
    return StashPlan(res_write, _read(schedule.backward, res_where), _read(w_rows, res_where), res_slots,
                     cot_write, _read(w_rows, cot_where), cot_slots)


def _allocate(rows, lives) -> tuple[np.ndarray, dict, int]:
    """Stash slots, like registers: `rows[t][p]` is the key (v, m) stage p writes at tick t, None for an idle slot
    that still writes (to a slot free at t), or ... for no write; `lives[p][key]` the ticks (first, last) its value
    is read until. A slot is reused from the tick after its last read (within a tick, writes come before reads).
    Returns (write slot [t, p], slot of each key per stage, slot count): the most values live at once, plus one
    where an idle write found every slot taken."""
    ticks, P = len(rows), len(rows[0]) if rows else 0
    write, where, count = np.zeros((ticks, P), np.int32), [{} for _ in range(P)], 0
    for p in range(P):
        last = []  # per slot: the last tick its value is read
        for t in range(ticks):
            key = rows[t][p]
            if key is ...:
                continue
            free = [i for i, e in enumerate(last) if e < t]
            i = free[0] if free else len(last)
            if not free:
                last.append(-1)
            if key is not None:
                last[i], where[p][key] = lives[p][key][1], i
            write[t, p] = i
        count = max(count, len(last))
    return write, where, count


def _read(rows, where) -> np.ndarray:
    """[t, p]: the slot holding `rows[t][p]`'s value (0 for an idle entry: read, then discarded)."""
    return np.array([[where[p][w] if w is not None else 0 for p, w in enumerate(r)] for r in rows], np.int32)
