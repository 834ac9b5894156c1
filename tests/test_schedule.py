"""Pipeline schedule tables, checked by simulating the data flow tick by tick."""
import itertools

import pytest

from mlm_jax.parallel.schedule import (SCHEDULES, Schedule, forward_index, forward_order, gpipe, one_f_one_b,
                                       theoretical_bubble, zb1)
from mlm_jax.parallel.stash import segments, stash_plan

SHAPES = [(P, V, M) for P, V, M in itertools.product([1, 2, 3, 4, 8], [1, 2, 3], [1, 2, 3, 4, 6, 8, 12, 16])
          if M >= P and (V == 1 or M % P == 0)]
# (t_F, t_B, t_W) with t_B the input-gradient part of a backward: the paper's regime t_W <= t_F, t_B, in binary
# fractions so that the run times add up exactly
SPLIT_TIMES = [(1.0, 1.0, 1.0), (1.0, 1.0, 0.5), (1.0, 1.5, 1.0), (1.5, 1.0, 1.0), (2.0, 2.0, 1.0)]


def replay(s):
    """Replays the table with one receive register per direction; returns the live sets [tick][stage].

    Forward (v, m) on stage p needs the activation of the previous chunk (stage p-1, or stage P-1 of chunk v-1),
    sent at the end of the previous tick; backward needs the gradient from the next chunk likewise, and the last
    chunk's backward needs its own forward. Each stage does at most one forward, one backward and (split schedules)
    one weight gradient per tick, each (v, m) once; a weight gradient follows its backward on the same stage, in a
    later tick or in the same tick's W slot. A chunk's residuals live from its forward to its backward, or to its
    weight gradient when the schedule splits them; a split backward's cotangents live until the weight gradient.
    A live set is (residual sets, cotangent sets) on a stage after a tick's F and B slots, before it frees any.
    """
    P, V, M = s.stages, s.virtual, s.microbatches
    act_reg = [None] * P  # what stage p received at the end of the last tick
    grad_reg = [None] * P
    done_f, done_b, done_w = set(), set(), set()
    residuals = [set() for _ in range(P)]
    cotangents = [set() for _ in range(P)]
    weight = s.weight if s.split_backward else ((None,) * P,) * s.ticks
    assert len(s.backward) == len(weight) == s.ticks
    live = []
    for tick in range(s.ticks):
        sent_act, sent_grad = [None] * P, [None] * P
        row = []
        for p in range(P):
            work = s.forward[tick][p]
            if work is not None:
                v, m = work
                if (v, p) != (0, 0):
                    assert act_reg[p] == (v * P + p - 1, m), (tick, p, work, act_reg[p])
                assert (v, m, p) not in done_f
                done_f.add((v, m, p))
                residuals[p].add((v, m))
                sent_act[(p + 1) % P] = (v * P + p, m)
            backward = s.backward[tick][p]
            if backward is not None:
                v, m = backward
                assert (v, m, p) in done_f and (v, m, p) not in done_b, (tick, p, backward)
                if (v, p) != (V - 1, P - 1):
                    assert grad_reg[p] == (v * P + p + 1, m), (tick, p, backward, grad_reg[p])
                done_b.add((v, m, p))
                if s.split_backward:
                    cotangents[p].add((v, m))
                sent_grad[(p - 1) % P] = (v * P + p, m)
            row.append((len(residuals[p]), len(cotangents[p])))
            if backward is not None and not s.split_backward:
                residuals[p].remove(backward)
            work = weight[tick][p]
            if work is not None:
                v, m = work
                assert (v, m, p) in done_b and (v, m, p) not in done_w, (tick, p, work)
                done_w.add((v, m, p))
                residuals[p].remove(work)
                cotangents[p].remove(work)
        live.append(row)
        act_reg, grad_reg = sent_act, sent_grad
    every = {(v, m, p) for v in range(V) for m in range(M) for p in range(P)}
    assert done_f == every and done_b == every and done_w == (every if s.split_backward else set())
    return live


def simulate(s):
    """The most live residual sets on a stage (the executor's stash), with the table checked by `replay`."""
    return max(r for row in replay(s) for r, _ in row)


@pytest.mark.parametrize("P, V, M", SHAPES)
def test_1f1b_dependencies_arrive_one_tick_early_and_memory_is_bounded(P, V, M):
    s = one_f_one_b(P, V, M)
    assert s.ticks == M * V + V * P + P - 2
    assert simulate(s) <= 2 * V * P - 1


@pytest.mark.parametrize("P, V, M", SHAPES)
def test_gpipe_dependencies_hold_and_it_stashes_everything(P, V, M):
    assert simulate(gpipe(P, V, M)) == M * V


@pytest.mark.parametrize("P, V, M", SHAPES)
@pytest.mark.parametrize("make", [one_f_one_b, gpipe], ids=["1f1b", "gpipe"])
def test_bubble_equals_the_interleaved_formula(make, P, V, M):
    for t_f, t_b in [(1.0, 2.0), (1.0, 1.0), (1.0, 3.0)]:
        assert abs(make(P, V, M).bubble(t_f, t_b) - theoretical_bubble(P, V, M)) < 1e-12


def test_1f1b_stash_does_not_grow_with_microbatches():
    assert len({simulate(one_f_one_b(4, 2, M)) for M in (8, 16, 32, 64)}) == 1


@pytest.mark.parametrize("P, V, M", SHAPES)
def test_stash_slots_keyed_by_forward_index_never_collide(P, V, M):
    """A stash of 2*V*P slots indexed by f mod 2*V*P: no live input is overwritten before its backward."""
    s = one_f_one_b(P, V, M)
    slots = 2 * V * P
    for p in range(P):
        live = {}
        for tick in range(s.ticks):
            if (work := s.forward[tick][p]) is not None:
                slot = forward_index(P, V, *work) % slots
                assert slot not in live, (p, tick, work, live[slot])
                live[slot] = work
            if (work := s.backward[tick][p]) is not None:
                assert live.pop(forward_index(P, V, *work) % slots) == work


def test_forward_index_inverts_the_forward_order():
    for P, V, M in SHAPES:
        assert [forward_index(P, V, v, m) for v, m in forward_order(P, V, M)] == list(range(M * V))


@pytest.mark.parametrize("P, V, M, message", [
    (4, 1, 2, "cannot fill"), (2, 2, 3, "not a multiple"), (0, 1, 1, ">= 1")])
@pytest.mark.parametrize("make", SCHEDULES.values(), ids=SCHEDULES)
def test_bad_shapes_are_rejected(make, P, V, M, message):
    with pytest.raises(ValueError, match=message):
        make(P, V, M)


def test_a_tick_lasts_as_long_as_its_busiest_stage():
    """A stage skips its idle slots: stage 0's F and W beside stage 1's B cost max(1 + 1, 3 - 1), not 1 + 2 + 1."""
    w = (0, 0)  # time() reads the slots, not the dependencies
    s = Schedule("zb1", 2, 1, 1, forward=((w, None),), backward=((None, w),), weight=((w, None),))
    assert s.time(t_forward=1.0, t_backward=3.0, t_weight=1.0) == 2.0
    fused = Schedule("1f1b", 2, 1, 1, forward=((w, None),), backward=((None, w),))
    assert fused.time(t_forward=1.0, t_backward=3.0) == 3.0


@pytest.mark.parametrize("P, V, M", SHAPES)
def test_zb1_keeps_1f1b_ticks_and_runs_each_weight_gradient_after_its_backward(P, V, M):
    """The same registers as 1F1B (every dependency arrives one tick early), then P-1 ticks of weight gradients."""
    s, base = zb1(P, V, M), one_f_one_b(P, V, M)
    idle = ((None,) * P,) * (P - 1)
    assert s.split_backward and not base.split_backward and SCHEDULES["zb1"] is zb1
    assert s.ticks == M * V + V * P + 2 * P - 3
    assert (s.forward, s.backward) == (base.forward + idle, base.backward + idle)
    replay(s)


@pytest.mark.parametrize("P, V", [(1, 1), (2, 1), (4, 1), (8, 1), (1, 3), (2, 2), (4, 2), (3, 3), (8, 2)])
def test_zb1_stashes_no_more_residuals_than_1f1b_whatever_the_microbatches(P, V):
    """Residuals live from F to W: never more on a stage than 1F1B's stage 0 holds; B's cotangents add < 2P."""
    for M in range(P, 17, 1 if V == 1 else P):
        live = [x for row in replay(zb1(P, V, M)) for x in row]
        assert max(r for r, _ in live) == simulate(one_f_one_b(P, V, M)) == min(M * V, V * P + P - 1)
        assert max(c for _, c in live) <= 2 * P - 1


@pytest.mark.parametrize("P, V, M", SHAPES)
def test_zb1_stash_slots_keyed_by_forward_and_backward_index_never_collide(P, V, M):
    """Residuals in 2*V*P slots by f mod 2*V*P and cotangents in 2*P slots by b mod 2*P, both freed by W."""
    s = zb1(P, V, M)
    for p in range(P):
        residuals, cotangents = {}, {}
        for tick in range(s.ticks):
            if (work := s.forward[tick][p]) is not None:
                slot = forward_index(P, V, *work) % (2 * V * P)
                assert slot not in residuals, (p, tick, work, residuals[slot])
                residuals[slot] = work
            if (work := s.backward[tick][p]) is not None:
                v, m = work
                slot = forward_index(P, V, V - 1 - v, m) % (2 * P)  # backward index b
                assert slot not in cotangents, (p, tick, work, cotangents[slot])
                cotangents[slot] = work
            if (work := s.weight[tick][p]) is not None:
                v, m = work
                assert residuals.pop(forward_index(P, V, v, m) % (2 * V * P)) == work
                assert cotangents.pop(forward_index(P, V, V - 1 - v, m) % (2 * P)) == work


@pytest.mark.parametrize("P, V, M", SHAPES)
def test_zb1_idles_as_zb_h1_plus_a_weight_gradient_per_tick_stage_0_waits(P, V, M):
    """Lockstep idle time (P-1)(t_F + t_B - t_W), the paper's ZB-H1, once M*V >= V*P + P - 2.

    Stage 0 hides P-1 of its W's for free in the P-1 ticks after its last forward, where the later stages still
    run F and B; with fewer microbatches the first V*P + P - 2 - M*V of those ticks come before its first backward,
    when it has no W to hide, and each of those W's costs a t_W elsewhere.
    """
    for t_f, t_b, t_w in SPLIT_TIMES:
        idle = zb1(P, V, M).time(t_f, t_b + t_w, t_w) - M * V * (t_f + t_b + t_w)
        assert idle == (P - 1) * (t_f + t_b - t_w) + max(0, V * P + P - 2 - M * V) * t_w
        assert one_f_one_b(P, V, M).time(t_f, t_b + t_w, t_w) - M * V * (t_f + t_b + t_w) == (P - 1) * (
            t_f + t_b + t_w)


@pytest.mark.parametrize("P", [2, 3, 4, 8])
def test_zb1_bubble_is_a_third_of_1f1bs_when_passes_cost_the_same(P):
    """t_F = t_B = t_W = 1, V = 1: ZB-H1 idles P-1 against 1F1B's 3(P-1) (Qi et al. 2023, figure 3)."""
    for M in range(max(P, 2 * P - 2), 17):
        assert zb1(P, 1, M).time(1.0, 2.0, 1.0) - 3 * M == P - 1
        assert one_f_one_b(P, 1, M).time(1.0, 2.0, 1.0) - 3 * M == 3 * (P - 1)


@pytest.mark.parametrize("P, V, M", SHAPES)
def test_zb1_bubble_is_below_1f1bs(P, V, M):
    """Also outside the paper's regime (a W dearer than a forward), where its fills are no longer free."""
    for t_f, t_b, t_w in SPLIT_TIMES + [(1.0, 1.0, 2.0), (0.5, 1.0, 1.0)]:
        zb, base = zb1(P, V, M).bubble(t_f, t_b + t_w, t_w), one_f_one_b(P, V, M).bubble(t_f, t_b + t_w, t_w)
        assert zb < base if P > 1 else zb == base


@pytest.mark.parametrize("P, V, M", SHAPES)
@pytest.mark.parametrize("kind", ["1f1b", "zb1"])
def test_stash_slots_are_as_many_as_the_most_live_chunks(P, V, M, kind):
    """The executor's slot allocation: the most chunks live at once (1F1B's peak), plus at most one slot for the
    writes of idle forward slots when every other is taken; zb1's cotangents need fewer than 2P."""
    s = SCHEDULES[kind](P, V, M)
    plan = stash_plan(s, segments(s))
    residual_slots, cotangent_slots = plan.res_slots, plan.cot_slots
    assert min(M * V, V * P + P - 1) <= residual_slots <= min(M * V, V * P + P - 1) + 1 <= 2 * V * P
    assert cotangent_slots <= 2 * P - 1
