"""Pipeline parallelism in one SPMD program: a `shard_map` over the `stage` axis around `lax.scan`s of ticks.

Block parameters are stored canonically as (L, ...), their layer dim sharded over `stage`; chunk c = v*P + p
(its layers given by a `ChunkLayout`: an even split, or fewer layers on the chunks that also embed or run the
head) lives on stage p, which gathers its chunks' layers at the start of the step (`stages.py`). Every other axis
(data, fsdp, tensor, ...) stays automatic inside each stage. Each tick runs the schedule's forward slot, then its
backward slot, then two `ppermute`s: activations to the next stage and gradients to the previous one, both wrapping
around (stage P-1 feeds chunk v+1 on stage 0).

1F1B and zb1 schedule backward passes themselves: the forward slot runs the chunk under `jax.vjp` and stashes the
pullback's residuals in slots allocated from the schedule table (the most chunks live at once, at most 2*V*P - 1,
whatever the number of microbatches), the backward slot rebuilds the pullback from them, so no chunk is computed
twice. zb1 splits the backward where the table defers a weight gradient (`split_vjp`): B computes the input
gradient and stashes the matmul cotangents, a later W slot the weight gradient. GPipe runs only the forward ticks
and lets autodiff produce the backward (all microbatches stay alive).

Collectives inside a chunk (tensor, expert and context parallelism) run in every stage's program at the same tick:
slots run on all stages of a run of ticks that needs them, idle ones on stale inputs with their results discarded.

Shapes: M microbatches, b rows each, S sequence, D model.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from mlm_jax.model import axes as ax
from mlm_jax.model.linear import for_fp32_sums, master_gradients, path_names, stand_in
from mlm_jax.model.moe import moe_metrics
from mlm_jax.model.transformer import default_positions, layers_of, segment_positions, stack_layers
from mlm_jax.parallel.schedule import Schedule
from mlm_jax.parallel.recompute import stash_policy
from mlm_jax.parallel.split_vjp import split_pullback
from mlm_jax.parallel.stash import Residuals, Stash, StashPlan, nbytes, segments, stash_plan
from mlm_jax.parallel.stages import STAGE, ChunkLayout, run_chunk


def _tables(rows) -> tuple[jax.Array, jax.Array, jax.Array]:
    """[tick][stage] -> (valid, v, m) int arrays the scan indexes with the tick and the stage index."""
    valid = np.array([[w is not None for w in r] for r in rows], np.int32)
    v = np.array([[w[0] if w else 0 for w in r] for r in rows], np.int32)
    m = np.array([[w[1] if w else 0 for w in r] for r in rows], np.int32)
    return jnp.asarray(valid), jnp.asarray(v), jnp.asarray(m)


def _split_microbatches(x_BS: jax.Array, M: int, seq_name: str) -> jax.Array:
    """(B, S) -> (M, B/M, S); row j*M + m goes to microbatch m, so each keeps the batch's data-parallel split.

    The sequence dim takes the layout its consumer needs (`seq_name`) here, outside the stage-dependent branches:
    a resharding collective inside a branch that only some stages take would wait for the others forever.
    """
    b, s = x_BS.shape
    x_MbS = ax.constrain(x_BS.reshape(b // M, M, s), (ax.ACT_BATCH, None, None)).swapaxes(0, 1)
    return ax.constrain(x_MbS, (None, ax.ACT_BATCH, seq_name))


def _at(tree, i):
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False), tree)


def _f32(tree):
    return jax.tree.map(lambda a: a.astype(jnp.float32), tree)


def _zeros(tree, dtype=None):
    return jax.tree.map(lambda a: jnp.zeros(a.shape, dtype or a.dtype), tree)


def _add_at(acc, i, g):
    return jax.tree.map(lambda a, x: a.at[i].add(x.astype(a.dtype)), acc, g)


def _maybe(pred, f: Callable, carry):
    """`f(carry)` where `pred`, else `carry`: a loop of zero or one trips. XLA updates a loop's carry in place,
    where a conditional copies what passes through it (the head's fp32 gradient sums, a chunk's weight-gradient
    sums, once per tick); the price is the host reading the loop's condition."""
    trips = pred.astype(jnp.int32)
    return jax.lax.while_loop(lambda c: c[0] < trips, lambda c: (c[0] + 1, f(c[1])), (jnp.int32(0), carry))[1]


def _split(params, batch, M: int, layout: ChunkLayout, count):
    """(the layer stacks, the other parameters, the batch as M microbatches with its positions, loss mask if it has
    one, and the step's token `count`)."""
    stacks = {k: v for k, v in params.items() if k in layout.stacks}
    rest = {k: v for k, v in params.items() if k not in layout.stacks}
    positions_BS = batch.get("positions")
    if positions_BS is None:
        positions_BS = (default_positions(batch["inputs"]) if "segment_ids" not in batch
                        else segment_positions(batch["segment_ids"]))
    data = {"tokens": _split_microbatches(batch["inputs"], M, ax.ACT_SEQ_SP),  # the embedding's output layout
            "targets": _split_microbatches(batch["targets"], M, ax.ACT_SEQ),  # the logits' layout
            "positions": _split_microbatches(positions_BS, M, ax.ACT_SEQ), "count": jnp.asarray(count, jnp.float32)}
    if "loss_mask" in batch:
        data["weights"] = _split_microbatches(batch["loss_mask"], M, ax.ACT_SEQ)
    if "segment_ids" in batch:
        data["segment_ids"] = _split_microbatches(batch["segment_ids"], M, ax.ACT_SEQ)
    return stacks, rest, data


def _layout(params, schedule: Schedule, layout: ChunkLayout | None) -> ChunkLayout:
    """`layout`, or an even split of a model whose layers all come from `blocks`."""
    layout = layout or ChunkLayout.even(jax.tree.leaves(params["blocks"])[0].shape[0], schedule.stages,
                                        schedule.virtual)
    assert (layout.stages, layout.virtual) == (schedule.stages, schedule.virtual), layout
    for stack in layout.stacks:
        assert jax.tree.leaves(params[stack])[0].shape[0] == len(layout.rows(stack)), (stack, layout)
    return layout


def pipeline_value_and_grad(graphdef: nnx.GraphDef, params, batch, count, *, mesh: Mesh, schedule: Schedule,
                            loss_fn: Callable, compute_dtype=jnp.float32, moe=None,
                            layout: ChunkLayout | None = None, cast_once: frozenset = frozenset(),
                            on_stash: Callable[[Stash], None] | None = None) -> tuple[dict, dict]:
    """(metrics, gradient with respect to `params`) of the batch, computed by `schedule` over the chunks of
    `layout` (even by default): the cross-entropy over the step's `count` of target tokens (`train.loss`) as
    `metrics["loss"]` and, for an MoE model (`moe`, its config), the MoE losses in the objective and their statistics
    in the metrics, as the plain step reports them. `loss_fn(model, y_bSD, targets_bS, weights_BS=, count=)`: a
    microbatch's share of the cross-entropy from the last chunk's output (`train.loss.head_loss`). `cast_once`: the
    kernels (paths from the parameters' root) whose weight gradients 1F1B and zb1 take as fp32 products in the
    chunks (`linear.stand_in`), as accumulation per layer does. `on_stash` is told the stash's size when the step is
    traced (not for GPipe, whose backward autodiff keeps)."""
    layout = _layout(params, schedule, layout)
    stacks, rest, data = _split(params, batch, schedule.microbatches, layout, count)
    kw = dict(mesh=mesh, schedule=schedule, loss_fn=loss_fn, layout=layout, moe=moe)
    if schedule.kind == "gpipe":
        return _gpipe(graphdef, stacks, rest, data, **kw)
    return _one_f_one_b(graphdef, stacks, rest, data, compute_dtype=compute_dtype, cast_once=cast_once,
                        on_stash=on_stash, **kw)


def pipeline_loss(graphdef: nnx.GraphDef, params, batch, count, *, mesh: Mesh, schedule: Schedule,
                  loss_fn: Callable, moe=None, layout: ChunkLayout | None = None) -> jax.Array:
    """The batch's cross-entropy over its `count` of target tokens through the pipeline's forward ticks
    (evaluation: the weights stay on their stages, and only activations move)."""
    layout = _layout(params, schedule, layout)
    stacks, rest, data = _split(params, batch, schedule.microbatches, layout, count)
    loss_of = _forward_loss(graphdef, stacks, rest, mesh=mesh, schedule=schedule, loss_fn=loss_fn, layout=layout,
                            moe=moe)
    return loss_of(stacks, _f32(rest), data)[1]


class _Stage:
    """The model pieces one stage (`p`) runs, as functions of explicit parameters; `chunks` are its chunk layers,
    per stack (V, rows, ...)."""

    def __init__(self, graphdef, chunks, data, loss_fn, M, moe, layout: ChunkLayout, p):
        self.graphdef, self.loss_fn, self.M, self.moe, self.layout = graphdef, loss_fn, M, moe, layout
        self.tokens, self.targets, self.positions = data["tokens"], data["targets"], data["positions"]
        self.weights, self.count, self.segments = data.get("weights"), data["count"], data.get("segment_ids")
        self.placeholder = _at(chunks, 0)  # merge needs some blocks; the chunk's own are passed explicitly
        # (V, width): whether each slot of this stage's chunk v holds a layer, and a sliding-window one
        slots = layout.chunk_slots
        self.active = jnp.asarray(layout.active)[:, p] if any(slots.optional) else None
        self.local = jnp.asarray(layout.local)[:, p] if None in slots.local else None

    def model(self, rest):
        return nnx.merge(self.graphdef, {**rest, **self.placeholder})

    def embed(self, rest, m):
        return self.model(rest).embed(self.tokens[m])

    def chunk(self, rest, chunk_pools, x_bSD, v, m):
        """Chunk v's output and each of its slots' MoE routing statistics ({} for a model without experts)."""
        x_bSD = ax.constrain(x_bSD, (ax.ACT_BATCH, ax.ACT_SEQ_SP, ax.ACT_EMBED))
        pick = lambda table: None if table is None else table[v]  # noqa: E731
        return run_chunk(self.model(rest), x_bSD, self.positions[m], chunk_pools, self.layout.chunk_slots,
                         pick(self.active), pick(self.local), None if self.segments is None else self.segments[m])

    def moe_term(self, stats) -> jax.Array:
        """The chunk's share of the MoE losses in the objective: means over all MoE layers and microbatches (a slot
        without an MoE layer adds zeros)."""
        if not stats:
            return jnp.zeros((), jnp.float32)
        total = self.moe.aux_loss_coef * jnp.sum(stats["aux_loss"]) + self.moe.z_loss_coef * jnp.sum(stats["z_loss"])
        return total.astype(jnp.float32) / (len(self.layout.rows("blocks")) * self.M)

    def loss(self, rest, y_bSD, m):
        """This microbatch's share of the step's cross-entropy (`train.loss`)."""
        weights = None if self.weights is None else self.weights[m]
        return self.loss_fn(self.model(rest), y_bSD, self.targets[m], weights_BS=weights, count=self.count)


def _specs(stacks, rest, layout: ChunkLayout):
    """Each canonical stack enters the stages as its blocks of n/P layers (whole where P does not divide n)."""
    def spec(stack):
        return PartitionSpec(STAGE) if layout.pools[stack].sharded else PartitionSpec()
    return ({k: jax.tree.map(lambda _: spec(k), v) for k, v in stacks.items()},
            jax.tree.map(lambda _: PartitionSpec(), rest))


def _gathered(layout: ChunkLayout, stacks, dtype=None):
    """(this stage's chunk layers per stack, (V, rows, ...), in `dtype`, the map of their fp32 gradients back to the
    stacks' blocks): the weights are cast before they move, and the gradients move in fp32."""
    pools = layout.pools

    def to_block(g_chunks):
        def back(stack, g):
            g = pools[stack].scatter(g)
            return g if pools[stack].sharded else jax.lax.psum(g, STAGE)  # each stage holds its own layers' part
        return {k: back(k, g) for k, g in g_chunks.items()}
    cast = stacks if dtype is None else _cast_floating(stacks, dtype)
    return {k: pools[k].gather(v) for k, v in cast.items()}, to_block


def _cast_floating(tree, dtype):
    """Stacked layers' floating weights in `dtype`, but their vectors (norms' scales, biases: [layers, n]) in fp32,
    as the layers read them, so that each microbatch's gradient of them comes back unrounded
    (`linear.for_fp32_sums`)."""
    return jax.tree.map(lambda a: a.astype(dtype if a.ndim > 2 else jnp.float32)
                        if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


@dataclasses.dataclass(frozen=True)
class _Tables:
    """A 1F1B or zb1 schedule as its ticks read it: [tick, stage] arrays of each slot's (valid, v, m) (`w` for a
    split schedule's W slots), the runs of ticks (`segments`) and the stash's slots (`stash_plan`)."""

    fwd: tuple[jax.Array, jax.Array, jax.Array]
    bwd: tuple[jax.Array, jax.Array, jax.Array]
    w: tuple[jax.Array, jax.Array, jax.Array] | None
    runs: list[tuple[int, int, bool, bool, bool]]
    stash: StashPlan

    @classmethod
    def of(cls, schedule: Schedule) -> _Tables:
        runs = segments(schedule)
        split = any(deferred for *_, deferred in runs)  # some W's run after their B's tick
        fwd, bwd = _tables(schedule.forward), _tables(schedule.backward)
        w = _tables(schedule.weight) if split else None
        plan = stash_plan(schedule, runs)
        plan = dataclasses.replace(plan, **{k: jnp.asarray(v) for k, v in vars(plan).items()
                                            if isinstance(v, np.ndarray)})
        return cls(fwd, bwd, w, runs, plan)

    @property
    def split(self) -> bool:
        return self.w is not None


class _Ticks:
    """One stage's slots of circular 1F1B and zb1 ticks (`_one_f_one_b`), over its chunks' layers; `tick` makes a
    run of ticks' scan body. Each chunk's residuals' structure and, for a split schedule, its pullback's split
    into B and W are made at its first trace (each chunk's program is its own: its slots' kinds, which of them it
    skips)."""

    def __init__(self, st: _Stage, rest, blocks, schedule: Schedule, tables: _Tables, cast_once: frozenset, p):
        self.st, self.rest, self.tables, self.cast_once, self.p = st, rest, tables, cast_once, p
        self.P, self.V = schedule.stages, schedule.virtual
        unrolled = not st.model(rest).scan_layers
        self.layers = [_chunk_layers(blocks, u, unrolled) for u in range(self.V)]
        self.residuals = [Residuals() for _ in range(self.V)]
        self.analysed = {}
        slots = st.layout.chunk_slots
        self.always = {k: {slots.row(i) for i, stack in enumerate(slots.stacks)
                           if stack == k and not slots.optional[i]} for k in blocks}
        self.to_next = [(i, (i + 1) % self.P) for i in range(self.P)]
        self.to_prev = [(i, (i - 1) % self.P) for i in range(self.P)]
        self.zero_act, self.res0, self.stats0, self.kept = self._shapes()
        plan = tables.stash
        self.stash = Stash(plan.res_slots, nbytes(self.res0), plan.cot_slots, nbytes(self.kept))

    def _shapes(self):
        """Traces every chunk's forward for its shapes (all take the same stash slots): (the activation's zeros,
        a chunk's residuals, its statistics, the cotangents a deferred W keeps)."""
        st, V, split = self.st, self.V, self.tables.split
        x0 = jax.eval_shape(lambda: st.embed(self.rest, 0))
        y0, res0, stats0 = jax.eval_shape(lambda x, m: self.forward(x, 0, m), x0, 0)
        for u in range(1, V):
            shapes = jax.eval_shape(lambda x, m, u=u: self.forward(x, u, m)[1], x0, 0)
            assert shapes == res0 and (not split or self.analysed[u].kept_shapes == self.analysed[0].kept_shapes), u
        return jnp.zeros(y0.shape, y0.dtype), res0, stats0, self.analysed[0].kept_shapes if split else []

    def initial(self) -> tuple:
        """The first tick's carry: activations, stashes, fp32 sums and statistics, all zeros."""
        plan = self.tables.stash
        cots = [jnp.zeros((plan.cot_slots, *k.shape), k.dtype) for k in self.kept]
        return (self.zero_act, self.zero_act, [jnp.zeros((plan.res_slots, *r.shape), r.dtype) for r in self.res0],
                cots, [_zeros(chunk, jnp.float32) for chunk in self.layers],
                _zeros(master_gradients(self.rest), jnp.float32),
                jnp.zeros((), jnp.float32),
                _zeros(jax.tree.map(lambda a: jax.ShapeDtypeStruct((self.V, *a.shape), jnp.float32), self.stats0)))

    def weights(self, u):
        return _paired(self.layers[u], self.cast_once, self.always)

    def forward(self, act_in, u, m):
        """Chunk u's (output, stashable residuals, routing statistics)."""
        st, p = self.st, self.p
        x = jnp.where(p == 0, st.embed(self.rest, m), act_in) if u == 0 else act_in  # a gather: cheaper than a branch
        w = self.weights(u)
        chunk = jax.checkpoint(lambda w, x: st.chunk(self.rest, w, x, u, m), policy=stash_policy, prevent_cse=False)

        def run(w, x):
            y, stats = chunk(w, x)
            return (y, st.moe_term(stats)), stats

        (y, term), pullback, stats = jax.vjp(run, w, x, has_aux=True)
        if self.tables.split and u not in self.analysed:
            self.analysed[u] = split_pullback(pullback, (y, term))
        return y, self.residuals[u].split(pullback, w), stats

    def head(self, y, loss, g_rest, ok, m):
        """The loss of the last chunk's output added to `loss`, the head's gradient to `g_rest`, and the output's
        cotangent (all scaled by `ok`: 0 for an idle slot)."""
        value, pullback = jax.vjp(lambda r, y: self.st.loss(r, y, m), self.rest, y)
        g_r, g_y = pullback(ok.astype(value.dtype))
        return (loss + ok * value.astype(jnp.float32), _sum_into(g_rest, master_gradients(g_r)),
                g_y.astype(self.zero_act.dtype))

    def backward(self, u, stash, y, g_in, m, ok, deferred, t) -> Callable:
        """Chunk u's backward slot, as a function of (loss, g_rest, g_x, chunk u's sums, stashed cotangents). Its
        residuals are read out of the stash inside the slot's loop, where XLA reads each one in place into the
        fusion that consumes it (read before the loop, each would be copied out whole every tick)."""
        st, p, plan, P, V = self.st, self.p, self.tables.stash, self.P, self.V

        def run(carry):
            loss, g_rest, _, sums, cots = carry
            stashed = [jax.lax.dynamic_index_in_dim(s, plan.res_b[t, p], 0, keepdims=False) for s in stash]
            g_y = g_in * ok.astype(g_in.dtype)
            if u == V - 1:
                loss, g_rest, g_y = _maybe(p == P - 1, lambda c: self.head(y, *c[:2], ok, m), (loss, g_rest, g_y))
            pullback = self.residuals[u].join(stashed, self.weights(u))
            if deferred:  # the input gradient only, and what the weight gradient will need
                g_x, kept = self.analysed[u].input_grad(pullback, (g_y, ok.astype(jnp.float32)))
                cots = [jax.lax.dynamic_update_index_in_dim(c, k.astype(c.dtype), plan.cot_write[t, p], 0)
                        for c, k in zip(cots, kept)]
            else:
                g_w, g_x = pullback((g_y, ok.astype(jnp.float32)))
                sums = _sum_into(sums, master_gradients(g_w))
            if u == 0:  # the embedding's gradient, a scatter-add into its sum: cheaper than a branch
                _, pullback = jax.vjp(lambda r: st.embed(r, m), self.rest)
                g_r = pullback(g_x * ((p == 0) & (ok == 1)).astype(g_x.dtype))[0]
                g_rest = _sum_into(g_rest, master_gradients(g_r))
            return loss, g_rest, g_x.astype(self.zero_act.dtype), sums, cots
        return run

    def weight_grad(self, stash, cots, u, t):
        """W of a split schedule: chunk u's weight gradient of the (v, m) the table names, from its residuals and
        B's cotangents."""
        plan, p = self.tables.stash, self.p
        stashed = [jax.lax.dynamic_index_in_dim(s, plan.res_w[t, p], 0, keepdims=False) for s in stash]
        kept = [jax.lax.dynamic_index_in_dim(c, plan.cot_w[t, p], 0, keepdims=False) for c in cots]
        return master_gradients(self.analysed[u].weight_grad(self.residuals[u].join(stashed, self.weights(u)), kept))

    def tick(self, run_forward: bool, run_backward: bool, deferred: bool) -> Callable:
        """The scan body of a run of ticks: the forward slot, the backward slot, W where deferred, then the two
        `ppermute`s."""
        p, V, M, tables = self.p, self.V, self.st.M, self.tables
        (fwd_ok, fwd_v, fwd_m), (bwd_ok, bwd_v, bwd_m) = tables.fwd, tables.bwd

        def body(carry, t):
            act_in, grad_in, stash, cots, sums, g_rest, loss, stats_acc = carry
            sums = list(sums)
            y = self.zero_act
            if run_forward:
                v, m, ok = fwd_v[t, p], fwd_m[t, p], fwd_ok[t, p]
                y, res, stats = jax.lax.switch(v, [lambda x, m, u=u: self.forward(x, u, m) for u in range(V)],
                                               act_in, m)
                stash = [jax.lax.dynamic_update_index_in_dim(s, r.astype(s.dtype), tables.stash.res_write[t, p], 0)
                         for s, r in zip(stash, res)]
                stats_acc = _add_at(stats_acc, v, jax.tree.map(lambda a: a * (ok / M), stats))
            g_x = self.zero_act
            if run_backward:
                v, m, ok = bwd_v[t, p], bwd_m[t, p], bwd_ok[t, p]
                for u in range(V):
                    loss, g_rest, g_x, sums[u], cots = _maybe(
                        v == u, self.backward(u, stash, y, grad_in, m, ok, deferred, t),
                        (loss, g_rest, g_x, sums[u], cots))
            if deferred:  # skipped where idle: W has no collectives a neighbour waits for
                w_ok, w_v, _ = tables.w
                v = w_v[t, p]
                for u in range(V):
                    sums[u] = _maybe((w_ok[t, p] == 1) & (v == u),
                                     lambda s, u=u: _sum_into(s, self.weight_grad(stash, cots, u, t)), sums[u])
            act_out = jax.lax.ppermute(y, STAGE, self.to_next)
            grad_out = jax.lax.ppermute(g_x, STAGE, self.to_prev)
            return (act_out, grad_out, stash, cots, sums, g_rest, loss, stats_acc), None
        return body


def _one_f_one_b(graphdef, stacks, rest, data, *, mesh, schedule, loss_fn, layout, compute_dtype, moe, cast_once,
                 on_stash):
    """Circular 1F1B (and zb1): the forward slot runs a chunk under `jax.vjp` and stashes its residuals, the
    backward slot rebuilds that pullback; no chunk is computed twice. zb1's deferred ticks split the backward
    into B (input gradient; the cotangents W needs are stashed) and a W slot that runs where the table says.

    Slots run on every stage of a run of ticks that any stage needs them in; a stage whose table entry is idle
    computes on stale inputs and its results are discarded (a zero cotangent, a write to a free stash slot): in
    lockstep ticks it would otherwise wait, and collectives inside a chunk (ring attention, expert all-to-alls)
    then run on every device of the stage.

    As plain accumulation does per layer (`train.step`), the chunks' weights are cast to the compute dtype (their
    vectors to fp32) and taken apart into layers once a step, and each chunk keeps an fp32 gradient sum per layer:
    one program over a (V, ...) stack at a traced chunk v would copy the chunk's weights out, and its sums out and
    back, every tick.
    The forward slot is a `lax.switch` over the chunks (a branch reads its chunk's layers in place; the residuals it
    returns go into the stash); the backward slot is V loops of zero or one trips (`_maybe`), one per chunk, whose
    products add their fp32 weight gradients (`cast_once`'s kernels) into the chunk's sums in their epilogues, in
    place (a branch would copy the sums it passes through).
    """
    tables = _Tables.of(schedule)

    def per_stage(block, rest, data):
        p = jax.lax.axis_index(STAGE)
        blocks, to_block = _gathered(layout, block, compute_dtype)  # (V, width, ...)
        st = _Stage(graphdef, blocks, data, loss_fn, schedule.microbatches, moe, layout, p)
        read = jax.tree_util.tree_map_with_path(  # the head's and embedding's gradients summed in fp32 too
            lambda path, w: for_fp32_sums(w, path_names(path) in cast_once, compute_dtype), rest)
        ticks = _Ticks(st, read, blocks, schedule, tables, cast_once, p)
        if on_stash is not None:
            on_stash(ticks.stash)
        carry = ticks.initial()
        for start, stop, *slots_run in tables.runs:
            carry, _ = jax.lax.scan(ticks.tick(*slots_run), carry, jnp.arange(start, stop))
        _, _, _, _, sums, g_rest, loss, stats = carry
        return (jax.lax.psum(loss, STAGE), jax.lax.psum(g_rest, STAGE), to_block(_stacked(sums)),
                jax.tree.map(lambda a: a[:, None], stats))  # (V, 1, width, ...): this stage's part

    stacks_spec, rest_spec = _specs(stacks, rest, layout)
    loss, g_rest, g_stacks, stats = jax.shard_map(
        per_stage, mesh=mesh, in_specs=(stacks_spec, rest_spec, PartitionSpec()),
        out_specs=(PartitionSpec(), rest_spec, stacks_spec, PartitionSpec(None, STAGE)), axis_names={STAGE},
        check_vma=False,
    )(stacks, rest, data)
    return _metrics(loss, stats, layout), {**g_rest, **g_stacks}


def _chunk_layers(blocks, u: int, unrolled: bool) -> dict:
    """Chunk u's layers per stack, taken out of the (V, width, ...) stacks once a step: a list of layers where the
    model is unrolled (each product then reads its layer in place), else the chunk's (width, ...) rows."""
    if not unrolled:
        return {k: jax.tree.map(lambda a: a[u], tree) for k, tree in blocks.items()}
    return {k: layers_of(tree, jax.tree.leaves(tree)[0].shape[1], lambda a, j: a[u, j]) for k, tree in blocks.items()}


def _stacked(chunks: list[dict]) -> dict:
    """`_chunk_layers`' inverse over all chunks: per stack, (V, width, ...). Lists of layers are stacked in one
    concatenation: stacks of stacks keep XLA from fusing the AdamW update of the stacked weight, its moments and its
    gradient's concatenation into one pass, and it then copies the moments before updating them."""
    def one(pools):
        if not isinstance(pools[0], list):
            return stack_layers(pools)
        flat = stack_layers([layer for pool in pools for layer in pool])  # (V * width, ...)
        return jax.tree.map(lambda a: a.reshape(len(pools), -1, *a.shape[1:]), flat)
    return {k: one([chunk[k] for chunk in chunks]) for k in chunks[0]}


def _paired(layers: dict, cast_once: frozenset, always: dict[str, set[int]]) -> dict:
    """Chunk layers with each kernel in `cast_once` (paths from the parameters' root) paired with an fp32 stand-in
    for its master (`linear.stand_in`): its product reads the layer's compute-dtype weights and returns the weight
    gradient as an fp32 product, which XLA adds into the chunk's fp32 sum in the product's epilogue. Only the rows
    that every chunk runs (`always`, per stack): an optional slot's layer runs in a conditional, which returns its
    products' gradients by a copy that fp32 would double."""
    def pair(stack, layer):
        def one(path, w):
            named = (stack, *path_names(path))
            return stand_in(w) if named in cast_once else w
        return jax.tree_util.tree_map_with_path(one, layer)
    return {k: [pair(k, layer) if j in always[k] else layer for j, layer in enumerate(pool)] if isinstance(pool, list)
            else pair(k, pool) if len(always[k]) == jax.tree.leaves(pool)[0].shape[0] else pool
            for k, pool in layers.items()}


def _sum_into(acc, g):
    """`g` added to the sums `acc` in their dtype (fp32)."""
    return jax.tree.map(lambda a, x: a + x.astype(a.dtype), acc, g)


def _metrics(loss, stats_VPW, layout: ChunkLayout) -> dict:
    """The step's metrics as the plain step reports them: MoE statistics per MoE layer, in model order."""
    if not stats_VPW:
        return {"loss": loss}
    moe_layers = jnp.asarray(layout.rows("blocks"))
    return moe_metrics(loss, jax.tree.map(lambda a: a[moe_layers], layout.canonical(stats_VPW)))


def _forward_loss(graphdef, stacks, rest, *, mesh, schedule, loss_fn, layout, moe) -> Callable:
    """`loss(stacks, rest, data) -> (objective, cross-entropy, per-chunk statistics)` through the schedule's forward
    ticks (every schedule runs forward f at tick f + p), means over the batch. The chunk runs on every stage at
    every tick, its results discarded where the table says idle, so collectives inside it run on all devices.

    The stage-replicated `rest` enters in fp32 and is cast back inside, so that the psum over stages that autodiff
    puts on its gradient is fp32 (jax 0.10 lowers a bf16 psum in a partially manual shard_map with a sharding
    constraint inside the reducer, on which XLA CPU's bf16 all-reduce promotion crashes)."""
    P, V, M = schedule.stages, schedule.virtual, schedule.microbatches
    fwd_ok, fwd_v, fwd_m = _tables(schedule.forward)
    ticks = M * V + P - 1
    to_next = [(i, (i + 1) % P) for i in range(P)]
    dtypes = jax.tree.map(lambda a: a.dtype, rest)

    def per_stage(block, rest, data):
        p = jax.lax.axis_index(STAGE)
        blocks = _gathered(layout, block)[0]
        rest = jax.tree.map(lambda a, d: a.astype(d), rest, dtypes)
        st = _Stage(graphdef, blocks, data, loss_fn, M, moe, layout, p)

        def tick(carry, t):
            act_in, loss, term, stats_acc = carry
            v, m, ok = fwd_v[t, p], fwd_m[t, p], fwd_ok[t, p]
            x = jax.lax.cond((v == 0) & (p == 0), lambda: st.embed(rest, m), lambda: act_in)
            y, stats = st.chunk(rest, _at(blocks, v), x, v, m)
            loss = jax.lax.cond((v == V - 1) & (p == P - 1) & (ok == 1),
                                lambda: loss + st.loss(rest, y, m).astype(jnp.float32), lambda: loss)
            term = term + ok * st.moe_term(stats)
            stats_acc = _add_at(stats_acc, v, jax.tree.map(lambda a: a * (ok / M), stats))
            return (jax.lax.ppermute(y, STAGE, to_next), loss, term, stats_acc), None

        x0 = jax.eval_shape(lambda: st.embed(rest, 0))
        stats0 = jax.eval_shape(lambda x: st.chunk(rest, _at(blocks, 0), x, 0, 0)[1], x0)
        zero = jnp.zeros((), jnp.float32)
        init = (jnp.zeros(x0.shape, x0.dtype), zero, zero,
                _zeros(jax.tree.map(lambda a: jax.ShapeDtypeStruct((V, *a.shape), jnp.float32), stats0)))
        (_, loss, term, stats), _ = jax.lax.scan(tick, init, jnp.arange(ticks))
        loss, term = jax.lax.psum(loss, STAGE), jax.lax.psum(term, STAGE)
        return loss + term, loss, jax.tree.map(lambda a: a[:, None], stats)

    stacks_spec, rest_spec = _specs(stacks, rest, layout)
    return jax.shard_map(per_stage, mesh=mesh, in_specs=(stacks_spec, rest_spec, PartitionSpec()),
                         out_specs=(PartitionSpec(), PartitionSpec(), PartitionSpec(None, STAGE)),
                         axis_names={STAGE}, check_vma=False)


def _gpipe(graphdef, stacks, rest, data, *, mesh, schedule, loss_fn, layout, moe):
    loss_of = _forward_loss(graphdef, stacks, rest, mesh=mesh, schedule=schedule, loss_fn=loss_fn, layout=layout,
                            moe=moe)

    def objective(stacks, rest):
        total, loss, stats = loss_of(stacks, rest, data)
        return total, (loss, stats)

    (_, (loss, stats)), (g_stacks, g_rest) = jax.value_and_grad(objective, argnums=(0, 1), has_aux=True)(
        stacks, _f32(rest))
    return _metrics(loss, stats, layout), {**g_rest, **g_stacks}
