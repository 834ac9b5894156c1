"""A chunk's backward split in two, for zero-bubble schedules: B computes the input gradient (the critical path)
and keeps the values the weight gradient needs; W computes the weight gradient later from those and the
residuals. Nothing is computed twice: W runs no equation of B's but elementwise recomputations from residuals.

The split is made once, on the pullback's jaxpr (the jaxpp idea): the equations the input gradient needs are B, the
rest of those the weight gradient needs are W, and B's values that W reads are `kept` (in a transformer, the output
cotangent of each weight matmul). An elementwise value of residuals only (a norm's output, a rope table) that both
read is recomputed in W rather than kept. Call bodies (jit, remat, custom_jvp/custom_vjp primal calls) are inlined,
so an equation is split wherever it sits; a `lax.scan` (layers scanned) is split into a B scan, which also emits the
per-iteration values W reads as stacked outputs, and a W scan that reads them. A `lax.cond` (a pipeline chunk's
skipped layers) is split into a B cond, which also returns every branch's kept values (zeros from the branches
that do not compute them), and a W cond over the same index. Other equations with bodies (while) are split as a
whole. B and W evaluate the equations on the current residual leaves, so the analysis made
in one trace (under `jax.eval_shape`, say) serves every later trace of a pullback of the same structure. They are
for evaluation, not for differentiating again (custom_jvp rules are inlined away).
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
# The jaxpr types and evaluator, public in `jax.extend.core` (checked in jax 0.10.2 and 0.11.2). The one internal
# detail read is a scan equation's grouping of its inputs (`_scan_groups`), whose form changed in 0.11.
from jax.extend.core import ClosedJaxpr, DebugInfo, Jaxpr, Literal, jaxpr_as_fun

from mlm_jax.parallel.recompute import CHEAP

# Call primitives whose body is inlined, and the parameter holding it (a ClosedJaxpr, or an open Jaxpr for remat).
_INLINED = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
            "remat2": "jaxpr", "checkpoint": "jaxpr", "custom_jvp_call": "call_jaxpr",
            "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr"}


@dataclass(frozen=True)
class _Const:
    val: Any


Ref = int | _Const  # a value: an id of this module's graphs, or a constant


@dataclass
class _Eqn:
    """One jaxpr equation, run by `jaxpr_as_fun` on a jaxpr of that equation alone."""
    fn: Callable
    ins: list[Ref]
    outs: list[int]
    cheap: bool
    effectful: bool

    def run(self, vals):
        return self.fn(*vals)


@dataclass
class _Cond:
    """A `lax.cond` / `lax.switch` whose branches are graphs of the same inputs: ins are the index, then those."""
    branches: list
    ins: list[Ref]
    outs: list[int]
    cheap = False

    def run(self, vals):
        fns = [lambda *ops, b=b: _run(b, ops) for b in self.branches]
        return jax.lax.switch(vals[0], fns, *vals[1:])


@dataclass
class _Graph:
    inputs: list[int]
    outputs: list[Ref]
    nodes: list


@dataclass
class _Scan:
    """A `lax.scan` whose body is a graph: ins are consts, initial carries, xs; outs are carries, ys."""
    length: int
    reverse: bool
    unroll: Any
    num_consts: int
    num_carry: int
    body: _Graph
    ins: list[Ref]
    outs: list[int]

    @property
    def cheap(self) -> bool:
        return all(n.cheap for n in self.body.nodes)

    def run(self, vals):
        nc, k = self.num_consts, self.num_carry
        consts, init, xs = vals[:nc], vals[nc:nc + k], vals[nc + k:]

        def step(carry, x):
            out = _run(self.body, [*consts, *carry, *x])
            return out[:k], out[k:]

        carry, ys = jax.lax.scan(step, list(init), list(xs), length=self.length, reverse=self.reverse,
                                 unroll=self.unroll)
        return [*carry, *ys]


def _ids(refs) -> list[int]:
    return [r for r in refs if isinstance(r, int)]


def _run(graph: _Graph, vals: Sequence) -> list:
    env = dict(zip(graph.inputs, vals, strict=True))

    def read(r):
        return r.val if isinstance(r, _Const) else env[r]

    for node in graph.nodes:
        env.update(zip(node.outs, node.run([read(r) for r in node.ins]), strict=True))
    return [read(r) for r in graph.outputs]


class _Builder:
    """Jaxprs to graphs (call bodies inlined, scans kept as `_Scan`s), and graphs split into B and W."""

    def __init__(self):
        self._ids = itertools.count()
        self.avals: dict[int, Any] = {}  # id -> its jaxpr value's aval, where it came from a jaxpr

    def fresh(self, aval=None) -> int:
        i = next(self._ids)
        if aval is not None:
            self.avals[i] = aval
        return i

    def graph(self, jaxpr: Jaxpr, consts: Sequence) -> _Graph:
        inputs = [self.fresh(v.aval) for v in jaxpr.invars]
        nodes: list = []
        outputs = self._inline(jaxpr, consts, inputs, nodes)
        return _Graph(inputs, outputs, nodes)

    def _inline(self, jaxpr: Jaxpr, consts: Sequence, in_refs: Sequence[Ref], nodes: list) -> list[Ref]:
        env: dict = dict(zip(jaxpr.constvars, map(_Const, consts), strict=True))
        env.update(zip(jaxpr.invars, in_refs, strict=True))

        def ref(a) -> Ref:
            return _Const(_typed(a.val, a.aval)) if isinstance(a, Literal) else env[a]

        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if name in _INLINED and _INLINED[name] in eqn.params:
                body = eqn.params[_INLINED[name]]
                sub, sub_consts = (body.jaxpr, body.consts) if isinstance(body, ClosedJaxpr) else (body, ())
                env.update(zip(eqn.outvars, self._inline(sub, sub_consts, [ref(a) for a in eqn.invars], nodes),
                               strict=True))
                continue
            outs = [self.fresh(v.aval) for v in eqn.outvars]
            env.update(zip(eqn.outvars, outs))
            if name == "cond":
                nodes.append(_Cond([self.graph(b.jaxpr, b.consts) for b in eqn.params["branches"]],
                                   [ref(a) for a in eqn.invars], outs))
                continue
            if name == "scan":
                p, body = eqn.params, eqn.params["jaxpr"]
                nodes.append(_Scan(p["length"], p["reverse"], p["unroll"], *_scan_groups(p, len(eqn.invars)),
                                   self.graph(body.jaxpr, body.consts), [ref(a) for a in eqn.invars], outs))
                continue
            invars = list(dict.fromkeys(a for a in eqn.invars if not isinstance(a, Literal)))
            one = ClosedJaxpr(Jaxpr([], invars, list(eqn.outvars), [eqn], eqn.effects,
                                    DebugInfo("split_vjp", name, None, None)), [])
            nodes.append(_Eqn(jaxpr_as_fun(one), [env[v] for v in invars], outs, name in CHEAP,
                              bool(eqn.effects)))
        return [ref(a) for a in jaxpr.outvars]

    def split(self, graph: _Graph, b_mask: Sequence[bool], w_mask: Sequence[bool], w_inputs: set[int],
              rec_inputs: set[int]) -> tuple[list, list, list[int]]:
        """(B's nodes, W's nodes, kept ids): B computes the outputs in `b_mask`, W those in `w_mask` from
        `w_inputs` and the kept values (B's values, or inputs not in `w_inputs`). W recomputes a cheap node of B's
        when all its inputs derive cheaply from `rec_inputs`."""
        nodes = graph.nodes
        b_live = set(_ids(r for r, m in zip(graph.outputs, b_mask) if m))
        b_role: dict[int, Any] = {}  # node index -> True (an equation), or the output positions of a scan
        for i in reversed(range(len(nodes))):
            node = nodes[i]
            if isinstance(node, _Eqn):
                if node.effectful or b_live.intersection(node.outs):
                    b_role[i] = True
                    b_live.update(_ids(node.ins))
            elif isinstance(node, _Cond):
                want = {j for j, o in enumerate(node.outs) if o in b_live}
                if want:
                    b_role[i] = want
                    b_live.update(self._cond_reads(node, want))
            else:
                want = {j for j, o in enumerate(node.outs) if o in b_live}
                if want:
                    b_role[i] = self._closure(node, want)
                    b_live.update(self._scan_reads(node, b_role[i]))

        rec = set(rec_inputs)
        for node in nodes:
            if node.cheap and all(isinstance(r, _Const) or r in rec for r in node.ins):
                rec.update(node.outs)

        w_live = set(_ids(r for r, m in zip(graph.outputs, w_mask) if m))
        w_nodes, b_scans = [], {}  # b_scans: scan index -> (B body nodes, body kept ids, outer ids of those)
        for i in reversed(range(len(nodes))):
            node = nodes[i]
            recompute = node.cheap and all(isinstance(r, _Const) or r in rec for r in node.ins)
            if isinstance(node, _Eqn):
                if w_live.intersection(node.outs) and (i not in b_role or recompute):
                    w_nodes.append(node)
                    w_live.difference_update(node.outs)
                    w_live.update(_ids(node.ins))
                continue
            want = {j for j, o in enumerate(node.outs) if o in w_live}
            b_pos = set() if recompute else b_role.get(i, set())
            if not want - b_pos:  # nothing for W to compute here: B's outputs W reads stay live, to be kept
                continue
            if isinstance(node, _Cond):
                w_cond, b_cond = self._split_cond(node, b_pos, want - b_pos)
                if b_pos:
                    b_scans[i] = b_cond
                w_nodes.append(w_cond)
                w_live.difference_update(w_cond.outs)
                w_live.update(_ids(w_cond.ins))
                continue
            w_scan, b_body, kept_body, kept_outer = self._split_scan(node, b_pos, want - b_pos)
            if b_pos:
                b_scans[i] = (b_body, kept_body, kept_outer)
            w_nodes.append(w_scan)
            w_live.difference_update(w_scan.outs)
            w_live.update(_ids(w_scan.ins))

        b_nodes = []
        for i, node in enumerate(nodes):
            if b_role.get(i) is True:
                b_nodes.append(node)
            elif isinstance(node, _Cond) and i in b_role:
                b_nodes.append(b_scans.get(i) or self._restrict_cond(node, b_role[i]))
            elif i in b_role:
                body, kept_body, kept_outer = b_scans.get(i) or (self._dce(node.body, b_role[i]), [], [])
                b_nodes.append(_restrict(node, b_role[i], body, [], kept_body, [], kept_outer))
        kept = sorted(w_live - w_inputs)
        return b_nodes, w_nodes[::-1], kept

    def _dce(self, graph: _Graph, positions) -> list:
        return self.split(graph, [j in positions for j in range(len(graph.outputs))],
                          [False] * len(graph.outputs), set(), set())[0]

    def _closure(self, scan: _Scan, want: set[int]) -> set[int]:
        """The output positions a scan computes to give `want`: the carries that those read, transitively."""
        k, carry_in = scan.num_carry, scan.body.inputs[scan.num_consts:scan.num_consts + scan.num_carry]
        want = set(want)
        while True:
            reads = self._reads(scan.body, self._dce(scan.body, want), [scan.body.outputs[j] for j in want])
            more = {j for j in range(k) if carry_in[j] in reads} - want
            if not more:
                return want
            want |= more

    @staticmethod
    def _reads(graph: _Graph, nodes: list, outputs: Sequence[Ref]) -> set[int]:
        """The ids of `graph`'s inputs that `nodes` and `outputs` read."""
        used = set(_ids(outputs)).union(*(_ids(n.ins) for n in nodes))
        return used.intersection(graph.inputs)

    def _scan_reads(self, scan: _Scan, positions: set[int]) -> list[int]:
        body_reads = self._reads(scan.body, self._dce(scan.body, positions),
                                 [scan.body.outputs[j] for j in positions])
        nc, k = scan.num_consts, scan.num_carry
        return _ids(r for j, r in enumerate(scan.ins)
                    if (nc <= j < nc + k and j - nc in positions) or (not nc <= j < nc + k
                                                                     and scan.body.inputs[j] in body_reads))

    def _cond_reads(self, cond: _Cond, positions: set[int]) -> list[int]:
        """The index and the operands that the branches read to give the outputs at `positions`."""
        return _ids(self._restrict_cond(cond, positions).ins)

    def _restrict_cond(self, cond: _Cond, positions: set[int]) -> _Cond:
        pos = sorted(positions)
        branches = [_Graph(b.inputs, [b.outputs[j] for j in pos], self._dce(b, positions)) for b in cond.branches]
        return self._pruned(cond, branches, [cond.outs[j] for j in pos])

    def _pruned(self, cond: _Cond, branches: list, outs: list[int]) -> _Cond:
        """A cond of `branches` (over `cond`'s operands) that takes only the operands they read."""
        reads = [self._reads(b, b.nodes, b.outputs) for b in branches]
        used = [j for j in range(len(cond.ins) - 1) if any(b.inputs[j] in r for b, r in zip(branches, reads))]
        return _Cond([_Graph([b.inputs[j] for j in used], b.outputs, b.nodes) for b in branches],
                     [cond.ins[0]] + [cond.ins[1 + j] for j in used], outs)

    def _split_cond(self, cond: _Cond, b_pos: set[int], w_want: set[int]) -> tuple[_Cond, _Cond]:
        """(W cond, B cond): each branch split as a graph of its own; B returns the values each branch's W reads
        (all branches' kept values, zeros from the other branches), W reads them and the operands it needs."""
        parts = []
        for b in cond.branches:
            ins = set(b.inputs)
            parts.append(self.split(b, [j in b_pos for j in range(len(b.outputs))],
                                    [j in w_want for j in range(len(b.outputs))], ins, ins))
        kept = [(j, k) for j, (_, _, ks) in enumerate(parts) for k in ks]
        kept_outer = [self.fresh(self.avals.get(k)) for _, k in kept]
        w_pos, b_out = sorted(w_want), sorted(b_pos)
        w_branches, b_branches = [], []
        for j, (b, (b_nodes, w_nodes, _)) in enumerate(zip(cond.branches, parts)):
            mine = [k if owner == j else self.fresh() for owner, k in kept]
            w_branches.append(_Graph(b.inputs + mine, [b.outputs[x] for x in w_pos], w_nodes))
            zeros = [self._zeros(self.avals[k]) for owner, k in kept if owner != j]
            it = iter(z.outs[0] for z in zeros)
            b_branches.append(_Graph(b.inputs, [b.outputs[x] for x in b_out]
                                     + [k if owner == j else next(it) for owner, k in kept], b_nodes + zeros))
        w_cond = self._pruned(_Cond(w_branches, cond.ins + kept_outer, []), w_branches,
                              [cond.outs[x] for x in w_pos])
        return w_cond, self._pruned(cond, b_branches, [cond.outs[x] for x in b_out] + kept_outer)

    def _zeros(self, aval) -> _Eqn:
        return _Eqn(lambda: [jax.numpy.zeros(aval.shape, aval.dtype)], [], [self.fresh(aval)], True, False)

    def _split_scan(self, scan: _Scan, b_pos: set[int], w_want: set[int]):
        """(W scan, B body nodes, body ids B emits per iteration for W, their stacked outer ids)."""
        body, nc, k = scan.body, scan.num_consts, scan.num_carry
        carry_in = body.inputs[nc:nc + k]
        shared = set(body.inputs[:nc] + body.inputs[nc + k:])
        w_pos = set(w_want)
        while True:
            w_carries = {carry_in[j] for j in w_pos if j < k}
            b_body, w_body, kept = self.split(body, [j in b_pos for j in range(len(body.outputs))],
                                              [j in w_pos for j in range(len(body.outputs))],
                                              shared | w_carries, shared)
            more = {j for j in range(k) if carry_in[j] in kept} - b_pos  # W reads a carry B does not compute
            if not more:
                break
            w_pos |= more
        kept_outer = [self.fresh(_stacked(self.avals.get(k), scan.length)) for k in kept]
        w_scan = _restrict(scan, w_pos, w_body, kept, [], kept_outer, [])
        return w_scan, b_body, kept, kept_outer


def _restrict(scan: _Scan, positions: set[int], nodes: list, extra_xs: list[int], extra_ys: list[Ref],
              extra_xs_outer: list[Ref], extra_ys_outer: list[int]) -> _Scan:
    """`scan` computing only the outputs at `positions` with `nodes`, plus extra per-iteration inputs and outputs."""
    body, nc, k = scan.body, scan.num_consts, scan.num_carry
    carries = sorted(j for j in positions if j < k)
    ys = sorted(j for j in positions if j >= k)
    outputs = [body.outputs[j] for j in carries + ys] + list(extra_ys)
    reads = _Builder._reads(body, nodes, outputs)
    consts = [j for j in range(nc) if body.inputs[j] in reads]
    xs = [j for j in range(nc + k, len(body.inputs)) if body.inputs[j] in reads]
    order = consts + [nc + j for j in carries] + xs
    return _Scan(scan.length, scan.reverse, scan.unroll, len(consts), len(carries),
                 _Graph([body.inputs[j] for j in order] + list(extra_xs), outputs, nodes),
                 [scan.ins[j] for j in order] + list(extra_xs_outer),
                 [scan.outs[j] for j in carries + ys] + list(extra_ys_outer))


def _stacked(aval, length: int):
    return None if aval is None else jax.ShapeDtypeStruct((length, *aval.shape), aval.dtype)


def _scan_groups(params, num_inputs: int) -> tuple[int, int]:
    """(consts, carries) among a scan equation's inputs: counts until jax 0.10, a flat tree of the three groups
    (consts, carries, xs) from jax 0.11."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].update(list(range(num_inputs))).unpack()
    return len(list(consts)), len(list(carry))


def _typed(val, aval):
    """A literal as an array of its aval's dtype (a Python scalar would enter the next equation weakly typed)."""
    return np.asarray(val, aval.dtype) if isinstance(val, (bool, int, float, complex)) else val


@dataclass(frozen=True)
class SplitVJP:
    """B and W of a pullback of `f(weights, x)` (one returning `(g_weights, g_x)`), for any pullback with the
    analysed one's structure: the same residual shapes and dtypes, from the same function."""
    b: _Graph
    w: _Graph
    residuals: tuple[jax.ShapeDtypeStruct, ...]
    g_w_tree: Any
    g_x_tree: Any
    kept_shapes: tuple[jax.ShapeDtypeStruct, ...]  # what `input_grad` keeps for `weight_grad`, in order

    def _leaves(self, pullback) -> list:
        leaves = jax.tree.leaves(pullback)
        got = tuple((np.shape(a), a.dtype) for a in leaves)
        assert got == tuple((a.shape, a.dtype) for a in self.residuals), "the pullback's structure changed"
        return leaves

    def input_grad(self, pullback, g_y) -> tuple[Any, list[jax.Array]]:
        """B: (g_x, kept), where kept is the flat list of B's values that `weight_grad` reads."""
        out = _run(self.b, [*self._leaves(pullback), *jax.tree.leaves(g_y)])
        n = self.g_x_tree.num_leaves
        return jax.tree.unflatten(self.g_x_tree, out[:n]), out[n:]

    def weight_grad(self, pullback, kept: Sequence[jax.Array]) -> Any:
        """W: g_weights, from the pullback's residuals and what `input_grad` kept."""
        assert len(kept) == len(self.kept_shapes), (len(kept), len(self.kept_shapes))
        return jax.tree.unflatten(self.g_w_tree, _run(self.w, [*self._leaves(pullback), *kept]))


def split_pullback(pullback, g_y_like) -> SplitVJP:
    """Analyse `pullback` (from `jax.vjp(f, weights, x)`) at `g_y_like`'s shapes: once, at trace time."""
    leaves, treedef = jax.tree.flatten(pullback)
    residuals = tuple(jax.ShapeDtypeStruct(np.shape(a), a.dtype) for a in leaves)
    # traced at the leaves' own types (in a shard_map, which mesh axes they vary over), not at plain shapes
    closed, (g_w_shape, g_x_shape) = jax.make_jaxpr(
        lambda res, g: jax.tree.unflatten(treedef, res)(g), return_shape=True)(leaves, g_y_like)
    builder = _Builder()
    graph = builder.graph(closed.jaxpr, closed.consts)
    n_res, n_w = len(leaves), len(jax.tree.leaves(g_w_shape))
    res_ids = graph.inputs[:n_res]
    is_w = [j < n_w for j in range(len(graph.outputs))]
    b_nodes, w_nodes, kept = builder.split(graph, [not m for m in is_w], is_w, set(res_ids), set(res_ids))
    b = _Graph(graph.inputs, [r for r, m in zip(graph.outputs, is_w) if not m] + kept, b_nodes)
    w = _Graph(res_ids + kept, [r for r, m in zip(graph.outputs, is_w) if m], w_nodes)
    g_x_tree = jax.tree.structure(g_x_shape)
    shapes = jax.eval_shape(lambda res, g: _run(b, [*res, *jax.tree.leaves(g)])[g_x_tree.num_leaves:],
                            leaves, g_y_like)
    return SplitVJP(b, w, residuals, jax.tree.structure(g_w_shape), g_x_tree, tuple(shapes))
