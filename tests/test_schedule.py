"""Pipeline schedule tables, checked by simulating the data flow tick by tick."""
import itertools

import pytest

from mlm_jax.parallel.schedule import (forward_index, forward_order, gpipe, one_f_one_b, theoretical_bubble)

SHAPES = [(P, V, M) for P, V, M in itertools.product([1, 2, 3, 4, 8], [1, 2, 3], [1, 2, 3, 4, 6, 8, 12, 16])
          if M >= P and (V == 1 or M % P == 0)]


def simulate(s):
    """Replays the table with one receive register per direction; returns the most stashed inputs on a stage.

    Forward (v, m) on stage p needs the activation of the previous chunk (stage p-1, or stage P-1 of chunk v-1),
    sent at the end of the previous tick; backward needs the gradient from the next chunk likewise, and the last
    chunk's backward needs its own forward. Each stage does at most one forward and one backward per tick.
    """
    P, V, M = s.stages, s.virtual, s.microbatches
    act_reg = [None] * P  # what stage p received at the end of the last tick
    grad_reg = [None] * P
    done_f, done_b = set(), set()
    stash = [set() for _ in range(P)]
    most = 0
    for tick in range(s.ticks):
        sent_act, sent_grad = [None] * P, [None] * P
        for p in range(P):
            work = s.forward[tick][p]
            if work is not None:
                v, m = work
                if (v, p) != (0, 0):
                    assert act_reg[p] == (v * P + p - 1, m), (tick, p, work, act_reg[p])
                assert (v, m, p) not in done_f
                done_f.add((v, m, p))
                stash[p].add((v, m))
                sent_act[(p + 1) % P] = (v * P + p, m)
            work = s.backward[tick][p]
            if work is not None:
                v, m = work
                assert (v, m, p) in done_f, (tick, p, work)
                if (v, p) != (V - 1, P - 1):
                    assert grad_reg[p] == (v * P + p + 1, m), (tick, p, work, grad_reg[p])
                done_b.add((v, m, p))
                stash[p].discard((v, m))
                sent_grad[(p - 1) % P] = (v * P + p, m)
        most = max(most, max(len(x) for x in stash))
        act_reg, grad_reg = sent_act, sent_grad
    every = {(v, m, p) for v in range(V) for m in range(M) for p in range(P)}
    assert done_f == every and done_b == every
    return most


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
def test_bad_shapes_are_rejected(P, V, M, message):
    with pytest.raises(ValueError, match=message):
        one_f_one_b(P, V, M)
