"""Pipeline schedules as pure tables: which (virtual chunk, microbatch) each stage runs forward and backward at
each tick. The executor (`pipeline.py`) follows the table; tests check it with a simulator.

P stages, V virtual chunks per stage, M microbatches. Chunk c = v*P + p lives on stage p. A tick has a forward
slot, then a backward slot.

Circular 1F1B (interleaved): every stage runs forwards in the order f = 0..M*V-1 with g = f // (P*V),
r = f % (P*V), v = r // P, m = g*P + r % P, and backwards in the same order with v reversed. Stage p runs
forward f at tick f + p and backward b at tick b + V*P - 1 + (P-1-p), for T = M*V + V*P + P - 2 ticks. Every
activation and gradient then arrives exactly one tick before it is needed (one receive register per direction),
a stage holds at most 2*V*P - 1 stashed chunk inputs whatever M is, and the bubble is (P-1)/(V*M + P-1).

GPipe (circular): all forwards (same order), then all backwards; the same bubble, but every microbatch's chunk
inputs stay alive until its backward.
"""
from __future__ import annotations

from dataclasses import dataclass

Work = tuple[int, int] | None  # (virtual chunk v, microbatch m), or idle


@dataclass(frozen=True)
class Schedule:
    kind: str
    stages: int
    virtual: int
    microbatches: int
    forward: tuple[tuple[Work, ...], ...]  # [tick][stage]
    backward: tuple[tuple[Work, ...], ...]  # [tick][stage]

    @property
    def ticks(self) -> int:
        return len(self.forward)

    def time(self, t_forward: float = 1.0, t_backward: float = 2.0) -> float:
        """Run time when stages move in lockstep: a tick costs each slot that any stage uses."""
        return sum(t_forward * any(f is not None for f in fw) + t_backward * any(b is not None for b in bw)
                   for fw, bw in zip(self.forward, self.backward))

    def bubble(self, t_forward: float = 1.0, t_backward: float = 2.0) -> float:
        """Idle fraction of the run time against a stage doing its M*V forwards and backwards back to back."""
        busy = self.microbatches * self.virtual * (t_forward + t_backward)
        return 1.0 - busy / self.time(t_forward, t_backward)


def theoretical_bubble(stages: int, virtual: int, microbatches: int) -> float:
    return (stages - 1) / (virtual * microbatches + stages - 1)


def forward_order(stages: int, virtual: int, microbatches: int, reverse_chunks: bool = False) -> list[tuple[int, int]]:
    """(v, m) of forward index f (or of backward index b with `reverse_chunks`), the same on every stage."""
    order = []
    for f in range(microbatches * virtual):
        g, r = divmod(f, stages * virtual)
        v = r // stages
        order.append((virtual - 1 - v if reverse_chunks else v, g * stages + r % stages))
    return order


def forward_index(stages: int, virtual: int, v: int, m: int) -> int:
    """Inverse of `forward_order`: the forward index f of chunk v, microbatch m (the stash slot key)."""
    return (m // stages) * stages * virtual + v * stages + m % stages


def one_f_one_b(stages: int, virtual: int, microbatches: int) -> Schedule:
    check(stages, virtual, microbatches)
    P, V, M = stages, virtual, microbatches
    ticks = M * V + V * P + P - 2
    fwd = [[None] * P for _ in range(ticks)]
    bwd = [[None] * P for _ in range(ticks)]
    for i, (f_work, b_work) in enumerate(zip(forward_order(P, V, M), forward_order(P, V, M, reverse_chunks=True))):
        for p in range(P):
            fwd[i + p][p] = f_work
            bwd[i + V * P - 1 + (P - 1 - p)][p] = b_work
    return Schedule("1f1b", P, V, M, tuple(map(tuple, fwd)), tuple(map(tuple, bwd)))


def gpipe(stages: int, virtual: int, microbatches: int) -> Schedule:
    check(stages, virtual, microbatches)
    P, V, M = stages, virtual, microbatches
    n = M * V
    ticks = 2 * (n + P - 1)
    fwd = [[None] * P for _ in range(ticks)]
    bwd = [[None] * P for _ in range(ticks)]
    backward = list(reversed(forward_order(P, V, M)))
    for i, work in enumerate(forward_order(P, V, M)):
        for p in range(P):
            fwd[i + p][p] = work
            bwd[n + P - 1 + i + (P - 1 - p)][p] = backward[i]
    return Schedule("gpipe", P, V, M, tuple(map(tuple, fwd)), tuple(map(tuple, bwd)))


def check(stages: int, virtual: int, microbatches: int) -> None:
    if stages < 1 or virtual < 1 or microbatches < 1:
        raise ValueError(f"need stages, virtual stages and microbatches >= 1, got {stages}, {virtual}, {microbatches}")
    if microbatches < stages:
        raise ValueError(f"{microbatches} microbatches cannot fill {stages} pipeline stages (need M >= P)")
    if virtual > 1 and microbatches % stages:
        raise ValueError(f"{microbatches} microbatches are not a multiple of the {stages} pipeline stages, which "
                         f"interleaving (virtual stages {virtual}) needs")


SCHEDULES = {"1f1b": one_f_one_b, "gpipe": gpipe}
