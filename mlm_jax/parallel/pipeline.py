"""Pipeline parallelism in one SPMD program: a `shard_map` over the `stage` axis around a `lax.scan` of ticks.

Block parameters are stored canonically as (L, ...), their layer dim sharded over `stage`, and viewed here as
(V, P, L/(V*P), ...): chunk c = v*P + p (layers c*Lc .. c*Lc+Lc-1) lives on stage p. Every other axis (data,
fsdp, tensor, ...) stays automatic inside each stage. Each tick runs the schedule's forward slot, then its backward
slot, then two `ppermute`s: activations to the next stage and gradients to the previous one, both wrapping
around (stage P-1 feeds chunk v+1 on stage 0). Idle slots are skipped with `lax.cond`.

1F1B schedules backward passes itself: the forward slot stashes its chunk input, the backward slot recomputes the
chunk from it with `jax.vjp`, so a stage holds at most 2*V*P chunk inputs whatever the number of microbatches.
GPipe runs only the forward ticks and lets autodiff produce the backward (all microbatches stay alive); it is the
reference the 1F1B executor is tested against.

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
                            loss_fn: Callable) -> tuple[jax.Array, dict]:
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
    run = _one_f_one_b if schedule.kind == "1f1b" else _gpipe
    return run(graphdef, blocks, rest, data, mesh=mesh, schedule=schedule, loss_fn=loss_fn, layers=L)


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


def _one_f_one_b(graphdef, blocks, rest, data, *, mesh, schedule, loss_fn, layers):
    P, V, M = schedule.stages, schedule.virtual, schedule.microbatches
    (fwd_ok, fwd_v, fwd_m), (bwd_ok, bwd_v, bwd_m) = _tables(schedule.forward), _tables(schedule.backward)
    slots = 2 * V * P
    to_next = [(i, (i + 1) % P) for i in range(P)]
    to_prev = [(i, (i - 1) % P) for i in range(P)]

    def per_stage(blocks, rest, data):
        blocks = jax.tree.map(lambda a: a[:, 0], blocks)  # (V, Lc, ...): this stage's chunks
        st = _Stage(graphdef, blocks, data, loss_fn, M)
        p = jax.lax.axis_index(STAGE)
        x0 = jax.eval_shape(lambda: st.embed(rest, 0))
        zero_act = jnp.zeros(x0.shape, x0.dtype)
        zero_rest = _zeros(rest, jnp.float32)
        zero_blocks = _zeros(_at(blocks, 0), jnp.float32)

        def forward(act_in, v, m):
            x = jax.lax.cond((v == 0) & (p == 0), lambda: st.embed(rest, m), lambda: act_in)
            return x, st.chunk(rest, _at(blocks, v), x, m)

        def backward_last(x, g, v, m):
            def f(chunk_blocks, rest, x):
                return st.loss(rest, st.chunk(rest, chunk_blocks, x, m), m)
            loss, vjp = jax.vjp(f, _at(blocks, v), rest, x)
            g_blocks, g_rest, g_x = vjp(jnp.ones_like(loss))
            # fp32 whatever the weights' dtype (bf16 weights, or ZeRO-1's bf16 copies): every branch of the `cond`s
            # returns the fp32 accumulators' dtype, which the idle branches' zeros have
            return loss.astype(jnp.float32), _f32(g_blocks), _f32(g_rest), g_x

        def backward_mid(x, g, v, m):
            _, vjp = jax.vjp(lambda cb, x: st.chunk(rest, cb, x, m), _at(blocks, v), x)
            g_blocks, g_x = vjp(g)
            return jnp.zeros((), jnp.float32), _f32(g_blocks), zero_rest, g_x

        def backward(x, g, v, m):
            loss, g_blocks, g_rest, g_x = jax.lax.cond((v == V - 1) & (p == P - 1), backward_last, backward_mid,
                                                       x, g, v, m)

            def embedding_grad():
                _, vjp = jax.vjp(lambda r: st.embed(r, m), rest)
                return jax.tree.map(jnp.add, g_rest, _f32(vjp(g_x)[0]))

            g_rest = jax.lax.cond((v == 0) & (p == 0), embedding_grad, lambda: g_rest)
            return loss, g_blocks, g_rest, g_x

        def tick(carry, t):
            act_in, grad_in, stash, g_blocks, g_rest, loss = carry
            v, m = fwd_v[t, p], fwd_m[t, p]
            x, y = jax.lax.cond(fwd_ok[t, p] == 1, forward, lambda a, v, m: (zero_act, zero_act), act_in, v, m)
            slot = forward_index(P, V, v, m) % slots
            stash = jax.lax.cond(fwd_ok[t, p] == 1, lambda s: s.at[slot].set(x), lambda s: s, stash)

            v, m = bwd_v[t, p], bwd_m[t, p]
            x_stashed = stash[forward_index(P, V, v, m) % slots]
            l, gb, gr, g_x = jax.lax.cond(
                bwd_ok[t, p] == 1, backward,
                lambda x, g, v, m: (jnp.zeros((), jnp.float32), zero_blocks, zero_rest, zero_act),
                x_stashed, grad_in, v, m)
            g_blocks = _add_at(g_blocks, v, gb)
            g_rest = jax.tree.map(jnp.add, g_rest, gr)
            act_out = jax.lax.ppermute(y, STAGE, to_next)
            grad_out = jax.lax.ppermute(g_x.astype(zero_act.dtype), STAGE, to_prev)
            return (act_out, grad_out, stash, g_blocks, g_rest, loss + l), None

        init = (zero_act, zero_act, jnp.zeros((slots, *zero_act.shape), zero_act.dtype),
                _zeros(blocks, jnp.float32), zero_rest, jnp.zeros((), jnp.float32))
        (_, _, _, g_blocks, g_rest, loss), _ = jax.lax.scan(tick, init, jnp.arange(schedule.ticks))
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
