"""The train step: one pure function (forward, backward, gradient accumulation, AdamW, non-finite skip), built from
module-level functions over a small `StepPlan`."""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

from mlm_jax.config import MoEConfig
from mlm_jax.model import axes as ax
from mlm_jax.model.linear import for_fp32_sums, master_gradients, path_names
from mlm_jax.model.moe import balance_loss, moe_metrics
from mlm_jax.model.transformer import layers_of, stack_layers
from mlm_jax.ops.fp8 import is_history
from mlm_jax.train.loss import head_loss, token_count
from mlm_jax.train.state import TrainState


@dataclass(frozen=True)
class StepPlan:
    """What a step is made of. `graphdef`: the model with the kernels of the layout (and, accumulating per layer,
    products from the master weights); `layout`: the activation layout to trace under (`model.axes.layout`);
    `prepare(batch)` rewrites the batch once before anything else (context parallelism's load-balancing order).

    With `compute_shardings` (ZeRO-1), the sharded fp32 master weights are cast to `compute_dtype` and gathered
    into the compute layout once per step; gradients come back reduce-scattered into the master layout.
    `pipeline(params, batch) -> (metrics, grads)` replaces autodiff and the accumulation scan: it runs the
    microbatches through the pipeline stages itself; `pipeline_loss(params, batch)` is its forward for evaluation.

    `per_layer`: the stacked weight collections that the model takes apart into layers (`split_layers`, unrolled
    layers). Accumulating, each of their layers then keeps its own fp32 sum and its weight gradients come from
    fp32 products (`linear.master_einsum`), so that XLA adds a layer's gradient into its sum in the epilogue of the
    product that makes it, where the memory traffic hides under the matmul, rather than in passes of their own over
    every gradient, stacked, per microbatch. Not with ZeRO-1, whose gradients are reduce-scattered per microbatch.
    `cast_once`: the kernels (paths from the parameters' root) of those products and the embedding tables
    (`embed.copy_take`); a stack's copy in `compute_dtype` is made once a step before the microbatches
    (`linear.CastWeight`) rather than by each microbatch's products.
    """

    graphdef: nnx.GraphDef
    accum_steps: int
    master_shardings: Any
    layout: Callable  # () -> the context manager of the activation layout
    compute_shardings: Any = None
    compute_dtype: Any = jnp.float32
    moe: MoEConfig | None = None
    loss_chunks: int = 1
    per_layer: tuple[str, ...] = ()
    cast_once: frozenset[tuple[str, ...]] = frozenset()
    prepare: Callable | None = None
    pipeline: Callable | None = None
    pipeline_loss: Callable | None = None

    @property
    def step_loads(self) -> bool:
        """Whether the load-balancing loss needs the step's expert loads before its microbatches' gradients
        (`model.moe.aux_loss_scope=global` with accumulation)."""
        return (self.moe is not None and self.moe.aux_loss_scope == "global" and self.moe.aux_loss_coef > 0
                and self.accum_steps > 1 and self.pipeline is None)

    def per_layer_stacks(self, params) -> tuple[str, ...]:
        """The stacks accumulated one sum per layer in this step (see the class), or () for one sum per leaf."""
        stacks = tuple(k for k in self.per_layer if k in params)
        if self.accum_steps == 1 or self.pipeline is not None or self.compute_shardings is not None:
            return ()
        return stacks


def objective(plan: StepPlan, params, batch, count, share: float = 1.0, loads_LE=None) -> tuple[jax.Array, dict]:
    """(objective, metrics) of a (micro)batch: its share of the step's cross-entropy, the sum over its target tokens
    that count (`batch["loss_mask"]`, all without) over the step's `count` of them (`train.loss`), which
    `metrics["loss"]` reports alone, plus `share` (its fraction of the step's microbatches) of the MoE losses, means
    over the MoE layers; the load-balancing loss counts the step's expert loads `loads_LE` where given
    (`step_loads`), else the microbatch's. `plan.loss_chunks`: the head and cross-entropy over that many slices of
    the sequence (`train.loss.head_loss`)."""
    model = nnx.merge(plan.graphdef, params)
    x_BSD, stats = model.hidden(batch["inputs"], batch.get("positions"), batch.get("segment_ids"))
    loss = head_loss(model, x_BSD, batch["targets"], plan.loss_chunks, batch.get("loss_mask"), count)
    if not stats:
        return loss, {"loss": loss}
    metrics = moe_metrics(loss, stats)
    if loads_LE is not None:
        metrics["moe_aux_loss"] = jnp.mean(balance_loss(loads_LE, stats["probs"]))
    moe = plan.moe.aux_loss_coef * metrics["moe_aux_loss"] + plan.moe.z_loss_coef * metrics["moe_z_loss"]
    return loss + (moe if share == 1.0 else share * moe), metrics


def _combined(metrics_A: dict) -> dict:
    """A step's metrics from its microbatches': the cross-entropy shares add up, the rest are means."""
    return {k: jnp.sum(m, axis=0) if k == "loss" else jnp.mean(m, axis=0) for k, m in metrics_A.items()}


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


# -- gradients ------------------------------------------------------------------------------------------------------
def _value_and_grad(plan: StepPlan, params, batch, count, share: float = 1.0, loads_LE=None):
    """((loss, metrics), gradients) of one (micro)batch, by autodiff or through the pipeline."""
    if plan.pipeline is None:
        return jax.value_and_grad(functools.partial(objective, plan), has_aux=True)(params, batch, count, share,
                                                                                    loads_LE)
    metrics, grads = plan.pipeline(params, batch, count)
    return (metrics["loss"], metrics), grads


def _to_master(plan: StepPlan, grads):
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    return jax.lax.with_sharding_constraint(grads, plan.master_shardings)


def _compute_copy(plan: StepPlan, params):
    """The weights a forward pass reads: under ZeRO-1, cast to the compute dtype and gathered into the compute
    layout; otherwise the master weights themselves."""
    if plan.compute_shardings is None:
        return params
    return jax.lax.with_sharding_constraint(jax.tree_util.tree_map_with_path(
        lambda path, p: p if is_history(path) else p.astype(plan.compute_dtype), params), plan.compute_shardings)


def _grads_of(plan: StepPlan, params, batch, count, share: float = 1.0, loads_LE=None) -> tuple[dict, Any]:
    """(metrics, gradients) of one (micro)batch; under ZeRO-1 from the compute copy, back in the master layout."""
    (_, metrics), grads = _value_and_grad(plan, _compute_copy(plan, params), batch, count, share, loads_LE)
    return metrics, grads if plan.compute_shardings is None else _to_master(plan, grads)


def _add(grad_sum, grads):
    """The microbatch's gradients added to the fp32 sums (each microbatch's objective is its share of the step's);
    a delayed-scaling history's "gradient" (the history one step on) takes the max over the microbatches instead."""
    return jax.tree_util.tree_map_with_path(
        lambda path, s, g: jnp.maximum(s, g) if is_history(path) else s + g.astype(jnp.float32), grad_sum, grads)


def _microbatches(plan: StepPlan, batch):
    """The batch as [b / A, A, s]: row j*A + a of the batch is in microbatch a, so every microbatch keeps the
    batch's data-parallel split without moving rows."""
    A = plan.accum_steps
    return jax.tree.map(lambda x_BS: ax.constrain(x_BS.reshape(x_BS.shape[0] // A, A, x_BS.shape[1]),
                                                  (ax.ACT_BATCH, None, None)), batch)


def _microbatch(micro, a):
    return jax.tree.map(lambda x: ax.constrain(x[:, a], (ax.ACT_BATCH, None)), micro)


def _step_loads(plan: StepPlan, params, micro) -> jax.Array | None:
    """Each MoE layer's expert loads over the step's whole batch, [layers, experts], where the load-balancing loss
    counts them (`StepPlan.step_loads`): a forward pass over the microbatches, up to the last layer (no head, no
    gradient), before any of their gradients."""
    if not plan.step_loads:
        return None
    model = nnx.merge(plan.graphdef, _compute_copy(plan, params))

    def body(_, a):
        mb = _microbatch(micro, a)
        return None, model.hidden(mb["inputs"], mb.get("positions"), mb.get("segment_ids"))[1]["load"]

    _, loads_ALE = jax.lax.scan(body, None, jnp.arange(plan.accum_steps))
    return jax.lax.stop_gradient(jnp.mean(loads_ALE, axis=0))  # microbatches of equal token counts


def _accumulate(plan: StepPlan, params, batch, count):
    """The step's loss and gradient as the sums of `plan.accum_steps` microbatches' shares (`_microbatches`)."""
    micro = _microbatches(plan, batch)
    loads_LE = _step_loads(plan, params, micro)

    def body(grad_sum, a):
        metrics, grads = _grads_of(plan, params, _microbatch(micro, a), count, 1 / plan.accum_steps, loads_LE)
        return _to_master(plan, _add(grad_sum, grads)), metrics

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    grad_sum, metrics_A = jax.lax.scan(body, _to_master(plan, zeros), jnp.arange(plan.accum_steps))
    return _combined(metrics_A), grad_sum


def _accumulate_per_layer(plan: StepPlan, params, batch, count, stacks):
    """`_accumulate` with one sum per layer of `stacks` (see `StepPlan`)."""
    micro = _microbatches(plan, batch)
    counts = {k: jax.tree.leaves(params[k])[0].shape[0] for k in stacks}

    def spread(tree, take):
        return {**dict(tree), **{k: layers_of(tree[k], n, take) for k, n in counts.items()}}

    def gather(tree):
        return {**tree, **{k: stack_layers(tree[k]) for k in stacks}}

    layer_shardings = spread(plan.master_shardings, lambda s, _: jax.NamedSharding(s.mesh, P(*s.spec[1:])))
    loads_LE = _step_loads(plan, params, micro)
    copies = _compute_copies(plan, params, counts)
    value_and_grad = jax.value_and_grad(
        lambda p, mb: objective(plan, gather(p), mb, count, 1 / plan.accum_steps, loads_LE), has_aux=True)

    def body(grad_sum, a):
        mb = _microbatch(micro, a)
        # taken apart here, each layer's weights are read where they are used (taken apart before the loop,
        # they would be copied out of the stacks)
        (_, metrics), grads = value_and_grad(_paired(plan, spread(params, lambda w, i: w[i]), copies, grad_sum), mb)
        return jax.lax.with_sharding_constraint(_add(grad_sum, master_gradients(grads)), layer_shardings), metrics

    zeros = spread(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params), lambda w, i: w[i])
    grad_sum, metrics_A = jax.lax.scan(body, zeros, jnp.arange(plan.accum_steps))
    return _combined(metrics_A), _to_master(plan, gather(grad_sum))


def _compute_copies(plan: StepPlan, params, counts: dict[str, int]) -> dict[str, list[dict]]:
    """Per stack, per layer: {kernel path in the layer: its copy in the compute dtype} for `plan.cast_once`'s
    kernels whose master weights are in another dtype, cast once, before the microbatch loop."""
    copies = {}
    for k, n in counts.items():
        kernels = [(path_names(path), w) for path, w in jax.tree_util.tree_flatten_with_path(params[k])[0]
                   if (k, *path_names(path)) in plan.cast_once and w.dtype != plan.compute_dtype]
        copies[k] = [{name: w[i].astype(plan.compute_dtype) for name, w in kernels} for i in range(n)]
    return copies


def _paired(plan: StepPlan, weights, copies: dict[str, list[dict]], sums):
    """The per-layer weights `weights` as the model reads them when each microbatch's gradient is summed in fp32
    (`linear.for_fp32_sums`): a weight of `plan.cast_once` beside its fp32 master, or, for a master in the compute
    dtype, its fp32 sum in `sums` standing in for it, with its copy made once a step where `copies` has one (else
    itself, read in place), so that XLA adds its fp32 gradient into the sum in the product's epilogue."""
    def pair(k, layer, copy, sum_):
        def one(path, w, s):
            name = path_names(path)
            return for_fp32_sums(w, (k, *name) in plan.cast_once, plan.compute_dtype, copy.get(name), s)
        return jax.tree_util.tree_map_with_path(one, layer, sum_)
    return {k: [pair(k, layer, c, s) for layer, c, s in zip(tree, copies[k], sums[k])] if k in copies
            else pair(k, tree, {}, sums[k]) for k, tree in weights.items()}


def gradients(plan: StepPlan, params, batch) -> tuple[dict, Any]:
    """(metrics, gradients): the mean loss and gradient over the batch, each gradient in its master weight's dtype
    and layout."""
    with plan.layout():
        if plan.prepare is not None:
            batch = plan.prepare(batch)
        count = token_count(batch["targets"], batch.get("loss_mask"))  # the whole step's, before any split
        stacks = plan.per_layer_stacks(params)
        if plan.accum_steps == 1 or plan.pipeline is not None:
            metrics, grads = _grads_of(plan, params, batch, count)
        elif stacks:
            metrics, grads = _accumulate_per_layer(plan, params, batch, count, stacks)
        else:
            metrics, grads = _accumulate(plan, params, batch, count)
    # Accumulators and the ZeRO-1 path are fp32: back to each master weight's dtype, so that the optimizer
    # state keeps the dtype it was created with (bf16 master weights with accumulation).
    return metrics, jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)


# -- the step -------------------------------------------------------------------------------------------------------
def train_step(plan: StepPlan, tx: optax.GradientTransformation, lr_schedule: optax.Schedule, state: TrainState,
               batch, keep_gradients: bool = False) -> tuple:
    """`(state, metrics)`: `gradients`, then AdamW; a step whose loss or gradient is not finite leaves the weights
    and the optimizer state as they were and is counted. A delayed-scaling history (`fp8.is_history`) takes its
    "gradient", the history one step on, in place of an update; AdamW sees a zero gradient there (and decays no
    history: `optimizer.NO_DECAY`).

    `keep_gradients`: `(state, metrics, gradients)`, the gradients as `gradients` returns them (a program output:
    written to memory, where AdamW alone would read them where the backward leaves them)."""
    moe = plan.moe
    metrics, raw = gradients(plan, state.params, batch)
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


def eval_loss(plan: StepPlan, params, batch) -> jax.Array:
    """The batch's cross-entropy (without the MoE losses), through the pipeline stages where there are some."""
    with plan.layout():
        if plan.prepare is not None:
            batch = plan.prepare(batch)
        count = token_count(batch["targets"], batch.get("loss_mask"))
        if plan.pipeline_loss is not None:
            return plan.pipeline_loss(params, batch, count)
        return objective(plan, params, batch, count)[1]["loss"]
