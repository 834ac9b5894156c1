"""Pipeline parallelism in one SPMD program: a `shard_map` over the `stage` axis around `lax.scan`s of ticks.

Block parameters are stored canonically as (L, ...), their layer dim sharded over `stage`, and viewed here as
(V, P, L/(V*P), ...): chunk c = v*P + p (layers c*Lc .. c*Lc+Lc-1) lives on stage p. Every other axis (data,
fsdp, tensor, ...) stays automatic inside each stage. Each tick runs the schedule's forward slot, then its backward
slot, then two `ppermute`s: activations to the next stage and gradients to the previous one, both wrapping
around (stage P-1 feeds chunk v+1 on stage 0).

1F1B schedules backward passes itself: the forward slot runs the chunk under `jax.vjp` and stashes the pullback's
residuals (at most 2*V*P chunks' worth, whatever the number of microbatches), the backward slot rebuilds the
pullback from them, so no chunk is computed twice. GPipe runs only the forward ticks and lets autodiff produce the
backward (all microbatches stay alive); it is the reference the 1F1B executor is tested against.

Shapes: M microbatches, b rows each, S sequence, D model.
"""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from mlm_jax.layers import axes as ax
from mlm_jax.layers.transformer import default_positions
from mlm_jax.parallel.schedule import Schedule, forward_index

STAGE = "stage"


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


def pipeline_value_and_grad(graphdef: nnx.GraphDef, params, batch, *, mesh: Mesh, schedule: Schedule,
                            loss_fn: Callable, compute_dtype=jnp.float32) -> tuple[jax.Array, dict]:
    """Mean loss over the batch and its gradient with respect to `params`, computed by `schedule`."""
    P, V, M = schedule.stages, schedule.virtual, schedule.microbatches
    L = jax.tree.leaves(params["blocks"])[0].shape[0]
    Lc = L // (V * P)
    blocks = jax.tree.map(lambda a: a.reshape(V, P, Lc, *a.shape[1:]), params["blocks"])
    rest = {k: v for k, v in params.items() if k != "blocks"}
    positions_BS = batch["positions"] if "positions" in batch else default_positions(batch["inputs"])
    data = {"tokens": _split_microbatches(batch["inputs"], M, ax.ACT_SEQ_SP),  # the embedding's output layout
            "targets": _split_microbatches(batch["targets"], M, ax.ACT_SEQ),  # the logits' layout
            "positions": _split_microbatches(positions_BS, M, ax.ACT_SEQ)}
    if schedule.kind == "gpipe":
        return _gpipe(graphdef, blocks, rest, data, mesh=mesh, schedule=schedule, loss_fn=loss_fn, layers=L)
    return _one_f_one_b(graphdef, blocks, rest, data, mesh=mesh, schedule=schedule, loss_fn=loss_fn, layers=L,
                        compute_dtype=compute_dtype)


class _Stage:
    """The model pieces one stage runs, as functions of explicit parameters."""

    def __init__(self, graphdef, blocks_local, data, loss_fn, M):
        self.graphdef, self.loss_fn, self.M = graphdef, loss_fn, M
        self.tokens, self.targets, self.positions = data["tokens"], data["targets"], data["positions"]
        self.placeholder = _at(blocks_local, 0)  # merge needs some blocks; the chunk's own are passed explicitly

    def model(self, rest):
        return nnx.merge(self.graphdef, {**rest, "blocks": self.placeholder})

    def embed(self, rest, m):
        return self.model(rest).embed(self.tokens[m])

    def chunk(self, rest, chunk_blocks, x_bSD, m):
        x_bSD = ax.constrain(x_bSD, (ax.ACT_BATCH, ax.ACT_SEQ_SP, ax.ACT_EMBED))
        return self.model(rest).run_blocks(x_bSD, self.positions[m], chunk_blocks)[0]

    def loss(self, rest, y_bSD, m):
        """This microbatch's share of the mean loss (all microbatches have the same number of tokens)."""
        return self.loss_fn(self.model(rest).logits(y_bSD), self.targets[m]) / self.M


def _specs(blocks, rest):
    return (jax.tree.map(lambda _: PartitionSpec(None, STAGE), blocks), jax.tree.map(lambda _: PartitionSpec(), rest))


def _cast_floating(tree, dtype):
    return jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


# Elementwise and layout primitives: what the backward recomputes from the stashed values rather than stash.
_RECOMPUTED = frozenset({
    "abs", "add", "add_any", "and", "broadcast_in_dim", "concatenate", "convert_element_type", "copy", "cos", "div",
    "eq", "exp", "expand_dims", "ge", "gt", "integer_pow", "iota", "le", "log", "logistic", "lt", "max", "min",
    "mul", "ne", "neg", "not", "or", "reshape", "rsqrt", "select_n", "sin", "slice", "sqrt", "square", "squeeze",
    "stop_gradient", "sub", "tanh", "transpose"})


def stash_policy(prim, *_, **__) -> bool:
    """What a chunk's forward keeps for its backward: the outputs of matmuls, attention kernels, reductions and
    collectives. Elementwise results (norm and activation intermediates, fp32 upcasts, casts and transposes of the
    weights) are recomputed inside the backward's fusions, as XLA does in a program that holds forward and
    backward together; stashing them would copy 3x the bytes into the stash at every tick (measured at
    llama-1b: the copies took 20% of the step)."""
    return prim.name not in _RECOMPUTED


def _segments(schedule: Schedule) -> list[tuple[int, int, bool, bool]]:
    """The ticks as runs (start, stop, forward slot runs, backward slot runs): a slot that no stage uses over a run
    of ticks (the warm-up's backward, the cool-down's forward) is left out of that run's program."""
    runs: list[list] = []
    for t, (fw, bw) in enumerate(zip(schedule.forward, schedule.backward)):
        kind = (any(w is not None for w in fw), any(w is not None for w in bw))
        if runs and tuple(runs[-1][2:]) == kind:
            runs[-1][1] = t + 1
        else:
            runs.append([t, t + 1, *kind])
    return [tuple(r) for r in runs]


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


def _one_f_one_b(graphdef, blocks, rest, data, *, mesh, schedule, loss_fn, layers, compute_dtype):
    """Circular 1F1B: the forward slot runs a chunk under `jax.vjp` and stashes its residuals, the backward slot
    rebuilds that pullback; no chunk is computed twice.

    Slots run on every stage of a run of ticks that any stage needs them in; a stage whose table entry is idle
    computes on stale inputs and its results are discarded (a zero cotangent, a write to a spare stash slot): in
    lockstep ticks it would otherwise wait, and collectives inside a chunk (ring attention, expert all-to-alls)
    then run on every device. The chunks' weights are cast to the compute dtype once per step, so the pullback
    holds the cast weights by identity (filtered out of the stash) rather than a copy per microbatch.
    """
    P, V, M = schedule.stages, schedule.virtual, schedule.microbatches
    (fwd_ok, fwd_v, fwd_m), (bwd_ok, bwd_v, bwd_m) = _tables(schedule.forward), _tables(schedule.backward)
    slots = 2 * V * P  # live stash entries; one more slot takes the writes of idle forward slots
    to_next = [(i, (i + 1) % P) for i in range(P)]
    to_prev = [(i, (i - 1) % P) for i in range(P)]
    slot_of = np.full((V, M), slots, np.int32)
    for v in range(V):
        for m in range(M):
            slot_of[v, m] = forward_index(P, V, v, m) % slots
    slot_of = jnp.asarray(slot_of)

    def per_stage(blocks, rest, data):
        blocks = _cast_floating(jax.tree.map(lambda a: a[:, 0], blocks), compute_dtype)  # (V, Lc, ...)
        st = _Stage(graphdef, blocks, data, loss_fn, M)
        p = jax.lax.axis_index(STAGE)
        residuals = Residuals()

        def forward(act_in, v, m):
            """(chunk output, stashable residuals)."""
            x = jax.lax.cond((v == 0) & (p == 0), lambda: st.embed(rest, m), lambda: act_in)
            weights = _at(blocks, v)
            chunk = jax.checkpoint(lambda w, x: st.chunk(rest, w, x, m), policy=stash_policy, prevent_cse=False)
            y, pullback = jax.vjp(chunk, weights, x)
            return y, residuals.split(pullback, weights)

        y0, res0 = jax.eval_shape(forward, jax.eval_shape(lambda: st.embed(rest, 0)), 0, 0)
        zero_act = jnp.zeros(y0.shape, y0.dtype)

        def head(y, g_rest, ok, m):
            """The loss of the last chunk's output, its cotangent (scaled by `ok`: 0 for an idle slot) and the
            head's gradient added to `g_rest`."""
            loss, pullback = jax.vjp(lambda r, y: st.loss(r, y, m), rest, y)
            g_r, g_y = pullback(ok.astype(loss.dtype))
            return (ok * loss.astype(jnp.float32), jax.tree.map(lambda a, g: a + g.astype(a.dtype), g_rest, g_r),
                    g_y.astype(zero_act.dtype))

        def backward(stashed, y, g_in, g_rest, v, m, ok):
            is_last = (v == V - 1) & (p == P - 1)
            loss, g_rest, g_y = jax.lax.cond(
                is_last, lambda: head(y, g_rest, ok, m),
                lambda: (jnp.zeros((), jnp.float32), g_rest, g_in * ok.astype(g_in.dtype)))
            g_w, g_x = residuals.join(stashed, _at(blocks, v))(g_y)

            def embedding_grad():
                _, pullback = jax.vjp(lambda r: st.embed(r, m), rest)
                return jax.tree.map(lambda a, g: a + g.astype(a.dtype), g_rest, pullback(g_x)[0])

            g_rest = jax.lax.cond((v == 0) & (p == 0) & (ok == 1), embedding_grad, lambda: g_rest)
            return loss, g_w, g_rest, g_x

        def tick(run_forward, run_backward):
            def body(carry, t):
                act_in, grad_in, stash, g_blocks, g_rest, loss = carry
                y = zero_act
                if run_forward:
                    v, m = fwd_v[t, p], fwd_m[t, p]
                    y, res = forward(act_in, v, m)
                    slot = jnp.where(fwd_ok[t, p] == 1, slot_of[v, m], slots)
                    stash = [jax.lax.dynamic_update_index_in_dim(s, r.astype(s.dtype), slot, 0)
                             for s, r in zip(stash, res)]
                g_x = zero_act
                if run_backward:
                    v, m = bwd_v[t, p], bwd_m[t, p]
                    stashed = [jax.lax.dynamic_index_in_dim(s, slot_of[v, m], 0, keepdims=False) for s in stash]
                    l, g_w, g_rest, g_x = backward(stashed, y, grad_in, g_rest, v, m, bwd_ok[t, p])
                    g_blocks = _add_at(g_blocks, v, g_w)
                    loss = loss + l
                act_out = jax.lax.ppermute(y, STAGE, to_next)
                grad_out = jax.lax.ppermute(g_x.astype(zero_act.dtype), STAGE, to_prev)
                return (act_out, grad_out, stash, g_blocks, g_rest, loss), None
            return body

        carry = (zero_act, zero_act, [jnp.zeros((slots + 1, *r.shape), r.dtype) for r in res0],
                 _zeros(blocks, jnp.float32), _zeros(rest, jnp.float32), jnp.zeros((), jnp.float32))
        for start, stop, run_forward, run_backward in _segments(schedule):
            carry, _ = jax.lax.scan(tick(run_forward, run_backward), carry, jnp.arange(start, stop))
        _, _, _, g_blocks, g_rest, loss = carry
        g_blocks = jax.tree.map(lambda a: a[:, None], g_blocks)
        return jax.lax.psum(loss, STAGE), jax.lax.psum(g_rest, STAGE), g_blocks

    blocks_spec, rest_spec = _specs(blocks, rest)
    loss, g_rest, g_blocks = jax.shard_map(
        per_stage, mesh=mesh, in_specs=(blocks_spec, rest_spec, PartitionSpec()),
        out_specs=(PartitionSpec(), rest_spec, blocks_spec), axis_names={STAGE}, check_vma=False,
    )(blocks, rest, data)
    g_blocks = jax.tree.map(lambda a: a.reshape(layers, *a.shape[3:]), g_blocks)
    return loss, {**g_rest, "blocks": g_blocks}


def _gpipe(graphdef, blocks, rest, data, *, mesh, schedule, loss_fn, layers):
    P, V, M = schedule.stages, schedule.virtual, schedule.microbatches
    fwd_ok, fwd_v, fwd_m = _tables(schedule.forward)
    ticks = M * V + P - 1  # the forward half of the table; autodiff runs the rest
    to_next = [(i, (i + 1) % P) for i in range(P)]

    # The stage-replicated `rest` enters in fp32 and is cast back inside, so that the psum over stages that autodiff
    # puts on its gradient is fp32: jax (0.10) lowers a bf16 psum in a partially manual shard_map with a sharding
    # constraint inside the reducer, on which XLA CPU's bf16 all-reduce promotion crashes.
    dtypes = jax.tree.map(lambda a: a.dtype, rest)

    def per_stage(blocks, rest, data):
        blocks = jax.tree.map(lambda a: a[:, 0], blocks)
        rest = jax.tree.map(lambda a, d: a.astype(d), rest, dtypes)
        st = _Stage(graphdef, blocks, data, loss_fn, M)
        p = jax.lax.axis_index(STAGE)
        x0 = jax.eval_shape(lambda: st.embed(rest, 0))
        zero_act = jnp.zeros(x0.shape, x0.dtype)

        def forward(act_in, v, m):
            x = jax.lax.cond((v == 0) & (p == 0), lambda: st.embed(rest, m), lambda: act_in)
            y = st.chunk(rest, _at(blocks, v), x, m)
            loss = jax.lax.cond((v == V - 1) & (p == P - 1), lambda: st.loss(rest, y, m).astype(jnp.float32),
                                lambda: jnp.zeros((), jnp.float32))
            return y, loss

        def tick(carry, t):
            act_in, loss = carry
            y, l = jax.lax.cond(fwd_ok[t, p] == 1, forward, lambda a, v, m: (zero_act, jnp.zeros((), jnp.float32)),
                                act_in, fwd_v[t, p], fwd_m[t, p])
            return (jax.lax.ppermute(y, STAGE, to_next), loss + l), None

        (_, loss), _ = jax.lax.scan(tick, (zero_act, jnp.zeros((), jnp.float32)), jnp.arange(ticks))
        return jax.lax.psum(loss, STAGE)

    blocks_spec, rest_spec = _specs(blocks, rest)
    pipeline_loss = jax.shard_map(per_stage, mesh=mesh, in_specs=(blocks_spec, rest_spec, PartitionSpec()),
                                  out_specs=PartitionSpec(), axis_names={STAGE}, check_vma=False)
    loss, (g_blocks, g_rest) = jax.value_and_grad(lambda b, r: pipeline_loss(b, r, data), argnums=(0, 1))(
        blocks, _f32(rest))
    g_blocks = jax.tree.map(lambda a: a.reshape(layers, *a.shape[3:]), g_blocks)
    return loss, {**g_rest, "blocks": g_blocks}
