"""The train step: one pure function (forward, backward, gradient accumulation, AdamW, non-finite skip)."""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

from mlm_jax.config import MoEConfig
from mlm_jax.layers import axes as ax
from mlm_jax.layers.fp8 import is_history
from mlm_jax.layers.linear import master_einsum
from mlm_jax.train.loss import head_loss
from mlm_jax.train.state import TrainState


def make_loss_fn(graphdef: nnx.GraphDef, moe: MoEConfig | None = None, loss_chunks: int = 1) -> Callable:
    """`loss_fn(params, batch) -> (objective, metrics)`: the objective adds the MoE losses to the cross-entropy,
    which `metrics["loss"]` reports alone. MoE losses are means over the MoE layers. `loss_chunks`: the head and
    cross-entropy over that many slices of the sequence (`train.loss.head_loss`)."""
    def loss_fn(params, batch) -> tuple[jax.Array, dict]:
        model = nnx.merge(graphdef, params)
        x_BSD, stats = model.hidden(batch["inputs"], batch.get("positions"))
        loss = head_loss(model, x_BSD, batch["targets"], loss_chunks)
        if not stats:
            return loss, {"loss": loss}
        aux, z = jnp.mean(stats["aux_loss"]), jnp.mean(stats["z_loss"])
        metrics = {"loss": loss, "moe_aux_loss": aux, "moe_z_loss": z, "moe_dropped": stats["dropped"],
                   "moe_load": stats["load"]}
        return loss + moe.aux_loss_coef * aux + moe.z_loss_coef * z, metrics
    return loss_fn


def load_imbalance(load_LE: jax.Array) -> jax.Array:
    """Per MoE layer, the busiest expert's load over the mean load (1 = balanced)."""
    return jnp.max(load_LE, axis=-1) * load_LE.shape[-1]


def update_router_bias(params, load_LE: jax.Array, rate: float):
    """Aux-loss-free balancing (DeepSeek-V3): raise the bias of under-loaded experts, lower the over-loaded ones."""
    router = params["blocks"]["moe"]["router"]
    step = rate * jnp.sign(jnp.mean(load_LE, axis=-1, keepdims=True) - load_LE)
    bias = (router["bias"] + step).astype(router["bias"].dtype)  # bf16 parameters stay bf16
    return {**params, "blocks": {**params["blocks"], "moe": {**params["blocks"]["moe"],
                                                              "router": {**router, "bias": bias}}}}


def make_grad_fn(graphdef, *, accum_steps: int, resolver: Callable, master_shardings, compute_shardings=None,
                 compute_dtype=jnp.float32, pipeline: Callable | None = None, moe: MoEConfig | None = None,
                 kernels: dict | None = None, prepare: Callable | None = None,
                 per_layer: tuple[str, ...] = (), loss_chunks: int = 1) -> Callable:
    """`grads(params, batch) -> (metrics, gradients)`: the mean loss and gradient over the batch, each gradient in
    its master weight's dtype and layout.

    `kernels` (by `axes` kernel name) replace layer computations that need explicit collectives; `prepare(batch)`
    rewrites the batch once before anything else (context parallelism's load-balancing permutation).

    With `compute_shardings` (ZeRO-1), the sharded fp32 master weights are cast to `compute_dtype` and gathered
    into the compute layout once per step; gradients come back reduce-scattered into the master layout.
    `pipeline(params, batch) -> (metrics, grads)` replaces autodiff and the accumulation scan: it runs the
    microbatches through the pipeline stages itself.

    `per_layer`: the stacked weight collections that the model takes apart into layers (`split_layers`, unrolled
    layers). Accumulating, each of their layers then keeps its own fp32 sum and its weight gradients come from
    fp32 products (`linear.master_einsum`), so that XLA adds a layer's gradient into its sum in the epilogue of the
    product that makes it, where the memory traffic hides under the matmul, rather than in passes of their own over
    every gradient, stacked, per microbatch. Not with ZeRO-1, whose gradients are reduce-scattered per microbatch.
    """
    loss_fn = make_loss_fn(graphdef, moe, loss_chunks)
    if pipeline is None:
        value_and_grad = jax.value_and_grad(loss_fn, has_aux=True)
    else:
        def value_and_grad(params, batch):
            metrics, grads = pipeline(params, batch)
            return (metrics["loss"], metrics), grads

    def grads_of(params, batch):
        """(metrics, gradients) of one (micro)batch."""
        if compute_shardings is None:
            (_, metrics), grads = value_and_grad(params, batch)
            return metrics, grads
        compute = jax.lax.with_sharding_constraint(jax.tree_util.tree_map_with_path(
            lambda path, p: p if is_history(path) else p.astype(compute_dtype), params), compute_shardings)
        (_, metrics), grads = value_and_grad(compute, batch)
        return metrics, to_master(grads)

    def to_master(grads):
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        return jax.lax.with_sharding_constraint(grads, master_shardings)

    def add(grad_sum, grads):
        """The microbatch's gradients added to the fp32 sums; a delayed-scaling history's "gradient" (the history
        one step on) takes the max over the microbatches instead."""
        return jax.tree_util.tree_map_with_path(
            lambda path, s, g: jnp.maximum(s, g) if is_history(path) else s + g.astype(jnp.float32), grad_sum, grads)

    def mean(grad_sum):
        return jax.tree_util.tree_map_with_path(lambda path, s: s if is_history(path) else s / accum_steps, grad_sum)

    def microbatches(batch):
        """The batch as [b / A, A, s]: row j*A + a of the batch is in microbatch a, so every microbatch keeps the
        batch's data-parallel split without moving rows."""
        return jax.tree.map(lambda x_BS: ax.constrain(x_BS.reshape(x_BS.shape[0] // accum_steps, accum_steps,
                                                                   x_BS.shape[1]), (ax.ACT_BATCH, None, None)), batch)

    def microbatch(micro, a):
        return jax.tree.map(lambda x: ax.constrain(x[:, a], (ax.ACT_BATCH, None)), micro)

    def accumulate(params, batch):
        """Mean loss and gradient over `accum_steps` microbatches (`microbatches`)."""
        micro = microbatches(batch)

        def body(grad_sum, a):
            mb = microbatch(micro, a)
            metrics, grads = grads_of(params, mb)
            return to_master(add(grad_sum, grads)), metrics

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        grad_sum, metrics_A = jax.lax.scan(body, to_master(zeros), jnp.arange(accum_steps))
        return jax.tree.map(lambda m: jnp.mean(m, axis=0), metrics_A), mean(grad_sum)

    def accumulate_per_layer(params, batch, stacks):
        """`accumulate` with one sum per layer of `stacks` (see `per_layer`)."""
        micro = microbatches(batch)
        counts = {k: jax.tree.leaves(params[k])[0].shape[0] for k in stacks}

        def spread(tree, take):
            return {**dict(tree), **{k: [jax.tree.map(lambda w, i=i: take(w, i), tree[k]) for i in range(n)]
                                     for k, n in counts.items()}}

        def gather(tree):
            return {**tree, **{k: jax.tree.map(lambda *ws: jnp.stack(ws), *tree[k]) for k in stacks}}

        layer_shardings = spread(master_shardings, lambda s, _: jax.NamedSharding(s.mesh, P(*s.spec[1:])))
        value_and_grad = jax.value_and_grad(lambda p, mb: loss_fn(gather(p), mb), has_aux=True)

        def body(grad_sum, a):
            mb = microbatch(micro, a)
            # taken apart here, each layer's weights are read where they are used (taken apart before the loop,
            # they would be copied out of the stacks)
            (_, metrics), grads = value_and_grad(spread(params, lambda w, i: w[i]), mb)
            return jax.lax.with_sharding_constraint(add(grad_sum, grads), layer_shardings), metrics

        zeros = spread(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params), lambda w, i: w[i])
        with ax.kernels(**{ax.MASTER_EINSUM: master_einsum}):
            grad_sum, metrics_A = jax.lax.scan(body, zeros, jnp.arange(accum_steps))
        return jax.tree.map(lambda m: jnp.mean(m, axis=0), metrics_A), to_master(mean(gather(grad_sum)))

    def grads_fn(params, batch):
        with ax.activation_resolver(resolver), ax.kernels(**(kernels or {})):
            if prepare is not None:
                batch = prepare(batch)
            stacks = tuple(k for k in per_layer if k in params)
            if accum_steps == 1 or pipeline is not None:
                metrics, grads = grads_of(params, batch)
            elif stacks and compute_shardings is None:
                metrics, grads = accumulate_per_layer(params, batch, stacks)
            else:
                metrics, grads = accumulate(params, batch)
        # Accumulators and the ZeRO-1 path are fp32: back to each master weight's dtype, so that the optimizer
        # state keeps the dtype it was created with (bf16 master weights with accumulation).
        return metrics, jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)

    return grads_fn


def make_train_step(tx: optax.GradientTransformation, grads_fn: Callable, *, lr_schedule: optax.Schedule,
                    moe: MoEConfig | None = None, keep_gradients: bool = False) -> Callable:
    """`step(state, batch) -> (state, metrics)`: `grads_fn` (`make_grad_fn`), then AdamW; a step whose loss or
    gradient is not finite leaves the weights and the optimizer state as they were and is counted. A
    delayed-scaling history (`fp8.is_history`) takes its "gradient", the history one step on, in place of an
    update; AdamW sees a zero gradient there (and decays no history: `optimizer.NO_DECAY`).

    `keep_gradients`: `step(state, batch) -> (state, metrics, gradients)`, the gradients as `grads_fn` returns
    them (a program output: written to memory, where AdamW alone would read them where the backward leaves them)."""

    def step(state: TrainState, batch) -> tuple:
        metrics, raw = grads_fn(state.params, batch)
        grads = jax.tree_util.tree_map_with_path(lambda path, g: jnp.zeros_like(g) if is_history(path) else g, raw)
        loss = metrics["loss"]
        with jax.named_scope("optimizer"):
            grad_norm = optax.tree.norm(grads)
            ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
            updates, opt_state = tx.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
            params = jax.tree_util.tree_map_with_path(lambda path, p, g: g if is_history(path) else p, params, raw)
            if moe is not None and moe.router_bias_update:
                params = update_router_bias(params, metrics["moe_load"], moe.router_bias_update)
            keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)  # noqa: E731
            new_state = TrainState(step=state.step + 1, params=keep(params, state.params),
                                   opt_state=keep(opt_state, state.opt_state),
                                   skipped_steps=state.skipped_steps + (~ok).astype(jnp.int32))
        metrics = {**metrics, "grad_norm": grad_norm, "lr": lr_schedule(state.step),
                   "skipped_steps": new_state.skipped_steps}
        if "moe_load" in metrics:
            metrics["moe_load_max_mean"] = load_imbalance(metrics.pop("moe_load"))
        return (new_state, metrics, raw) if keep_gradients else (new_state, metrics)

    return step


def make_eval_step(graphdef, resolver: Callable, moe: MoEConfig | None = None, kernels: dict | None = None,
                   prepare: Callable | None = None, pipeline_loss: Callable | None = None,
                   loss_chunks: int = 1) -> Callable:
    """`eval_step(params, batch) -> cross-entropy` (without the MoE losses); `pipeline_loss(params, batch)` runs
    it through the pipeline stages."""
    loss_fn = make_loss_fn(graphdef, moe, loss_chunks)

    def eval_step(params, batch):
        with ax.activation_resolver(resolver), ax.kernels(**(kernels or {})):
            if prepare is not None:
                batch = prepare(batch)
            if pipeline_loss is not None:
                return pipeline_loss(params, batch)
            return loss_fn(params, batch)[1]["loss"]

    return eval_step
