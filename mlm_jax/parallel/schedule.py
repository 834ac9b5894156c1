"""Pipeline schedules as pure tables: which (virtual chunk, microbatch) each stage runs forward and backward at
each tick. The executor (`pipeline.py`) follows the table; tests check it with a simulator.

P stages, V virtual chunks per stage, M microbatches. Chunk c = v*P + p lives on stage p. A tick has a forward
slot F, then a backward slot B, then (split schedules only) a weight-gradient slot W; then activations move to the
next stage and input gradients to the previous one. `weight` is None when B also computes the weight gradient
(1f1b, gpipe); otherwise B computes only the input gradient and keeps the cotangents that the weight gradient
needs, and W (v, m) computes that weight gradient, at B's tick or later on the same stage, and frees the chunk's
residuals and cotangents. W does not communicate. A stage skips its idle slots and stages move in lockstep, so a
tick lasts as long as its busiest stage.

Circular 1F1B (interleaved): every stage runs forwards in the order f = 0..M*V-1 with g = f // (P*V),
r = f % (P*V), v = r // P, m = g*P + r % P, and backwards in the same order with v reversed. Stage p runs
forward f at tick f + p and backward b at tick b + V*P - 1 + (P-1-p), for T = M*V + V*P + P - 2 ticks. Every
activation and gradient then arrives exactly one tick before it is needed (one receive register per direction),
a stage holds at most V*P + P - 1 <= 2*V*P - 1 stashed chunks whatever M is (stage 0, at its first backward), and
the bubble is (P-1)/(V*M + P-1).

GPipe (circular): all forwards (same order), then all backwards; the same bubble, but every microbatch's chunk
inputs stay alive until its backward.

Zero bubble ZB-H1 (`zb1`, Qi et al. 2023, circular): 1F1B's F and B ticks, so the receive registers are unchanged,
then P-1 ticks that only run W's. Each stage runs its W's in its B order, one a tick, wherever a W lengthens no tick
(a busier stage sets its length: free when t_W <= t_F and t_W <= t_B, the paper's regime) or lengthens it for every
stage alike (all stages run the same slots: the steady state, the cool-down's all-B ticks, the W-only ticks), never
on the busiest stage of a mixed tick. So (for M*V >= V*P + P - 2) no W runs while the first backwards travel from
stage P-1 to stage 0, stage 0 runs each W beside its B but for the last P-1, and the later stages' W's fill their
cool-down holes. With t_B the input-gradient part of a backward, the idle time is
(P-1)*(t_F + t_B - t_W) + max(0, V*P + P - 2 - M*V)*t_W against 1F1B's (P-1)*(t_F + t_B + t_W): the paper's ZB-H1
once M*V >= V*P + P - 2, more for fewer microbatches (the test says why). Without the W-only ticks no placement
beats (P-1)*(t_F + t_B) (an exhaustive search over small shapes); each saves a t_W. Memory: a chunk's residuals live
from F to W, never more on a stage than on 1F1B's stage 0 (the later stages hold more than in 1F1B, up to that);
the cotangents B keeps for W add fewer than 2*P sets on a stage (most on the last), consecutive backward indices b,
so 2*P slots keyed by b mod 2*P do.
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
    weight: tuple[tuple[Work, ...], ...] | None = None  # [tick][stage]; None: B computes the weight gradient too

    @property
    def ticks(self) -> int:
        return len(self.forward)

    @property
    def split_backward(self) -> bool:
        return self.weight is not None

    def time(self, t_forward: float = 1.0, t_backward: float = 2.0, t_weight: float | None = None) -> float:
        """Run time when stages move in lockstep: a tick costs its busiest stage's slots.

        `t_backward` is a whole backward (input and weight gradient), so every schedule does the same work; a split
        schedule's B costs t_backward - t_weight and its W t_weight (by default half, the paper's T_B = T_W).
        """
        t_w = t_backward / 2 if t_weight is None else t_weight
        t_b = t_backward - t_w
        weight = self.weight if self.split_backward else self.backward  # fused: W runs inside the B slot
        return sum(max(t_forward * (f is not None) + t_b * (b is not None) + t_w * (w is not None)
                       for f, b, w in zip(fw, bw, ww))
                   for fw, bw, ww in zip(self.forward, self.backward, weight))

    def bubble(self, t_forward: float = 1.0, t_backward: float = 2.0, t_weight: float | None = None) -> float:
        """Idle fraction of the run time against a stage doing its M*V forwards and backwards back to back."""
        busy = self.microbatches * self.virtual * (t_forward + t_backward)
        return 1.0 - busy / self.time(t_forward, t_backward, t_weight)


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


def zb1(stages: int, virtual: int, microbatches: int) -> Schedule:
    """1F1B's F and B ticks, and each stage's W's as early as they lengthen no tick or every stage's alike."""
    s = one_f_one_b(stages, virtual, microbatches)
    P, n = stages, virtual * microbatches
    idle = ((None,) * P,) * (P - 1)  # the W-only ticks
    forward, backward = s.forward + idle, s.backward + idle
    order = forward_order(P, virtual, microbatches, reverse_chunks=True)  # every stage's B order, so its W order
    ran_b, ran_w = [0] * P, [0] * P
    weight = []
    for fw, bw in zip(forward, backward):
        busy = [(f is not None) + (b is not None) for f, b in zip(fw, bw)]  # [stage]: slots run before W
        row = []
        for p in range(P):
            ran_b[p] += bw[p] is not None
            if ran_w[p] < ran_b[p] and (busy[p] < max(busy) or min(busy) == max(busy)):
                row.append(order[ran_w[p]])
                ran_w[p] += 1
            else:
                row.append(None)
        weight.append(tuple(row))
    assert ran_w == [n] * P, ran_w
    return Schedule("zb1", P, virtual, microbatches, forward, backward, tuple(weight))


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


SCHEDULES = {"1f1b": one_f_one_b, "zb1": zb1, "gpipe": gpipe}
