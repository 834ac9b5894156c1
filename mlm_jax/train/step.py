"""The train step: one pure function (forward, backward, gradient accumulation, AdamW, non-finite skip)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from mlm_jax.layers import axes as ax
from mlm_jax.train.loss import cross_entropy
from mlm_jax.train.state import TrainState


def make_loss_fn(graphdef: nnx.GraphDef) -> Callable:
    def loss_fn(params, batch) -> jax.Array:
        logits_BSV = nnx.merge(graphdef, params)(batch["inputs"])
        with jax.named_scope("loss"):
            return cross_entropy(logits_BSV, batch["targets"])
    return loss_fn


def make_train_step(graphdef, tx: optax.GradientTransformation, *, accum_steps: int, resolver: Callable,
                    master_shardings, compute_shardings=None, compute_dtype=jnp.float32,
                    lr_schedule: optax.Schedule, pipeline: Callable | None = None) -> Callable:
    """`step(state, batch) -> (state, metrics)`.

    With `compute_shardings` (ZeRO-1), the sharded fp32 master weights are cast to `compute_dtype` and gathered
    into the compute layout once per step; gradients come back reduce-scattered into the master layout.
    `pipeline(params, batch) -> (loss, grads)` replaces autodiff and the accumulation scan: it runs the
    microbatches through the pipeline stages itself.
    """
    loss_fn = make_loss_fn(graphdef)
    value_and_grad = pipeline or jax.value_and_grad(loss_fn)

    def grads_of(params, batch):
        if compute_shardings is None:
            return value_and_grad(params, batch)
        compute = jax.lax.with_sharding_constraint(
            jax.tree.map(lambda p: p.astype(compute_dtype), params), compute_shardings)
        loss, grads = value_and_grad(compute, batch)
        return loss, to_master(grads)

    def to_master(grads):
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        return jax.lax.with_sharding_constraint(grads, master_shardings)

    def accumulate(params, batch):
        """Mean loss and gradient over `accum_steps` microbatches; row j*A + a of the batch is in microbatch a,
        so every microbatch keeps the batch's data-parallel split without moving rows."""
        def split(x_BS):
            b, s = x_BS.shape
            return ax.constrain(x_BS.reshape(b // accum_steps, accum_steps, s), (ax.ACT_BATCH, None, None))

        micro = jax.tree.map(split, batch)

        def body(carry, a):
            loss_sum, grad_sum = carry
            mb = jax.tree.map(lambda x: ax.constrain(x[:, a], (ax.ACT_BATCH, None)), micro)
            loss, grads = grads_of(params, mb)
            grad_sum = jax.tree.map(lambda s, g: s + g.astype(jnp.float32), grad_sum, grads)
            return (loss_sum + loss, to_master(grad_sum)), None

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        (loss_sum, grad_sum), _ = jax.lax.scan(body, (jnp.zeros((), jnp.float32), to_master(zeros)),
                                               jnp.arange(accum_steps))
        return loss_sum / accum_steps, jax.tree.map(lambda g: g / accum_steps, grad_sum)

    def step(state: TrainState, batch) -> tuple[TrainState, dict[str, Any]]:
        with ax.activation_resolver(resolver):
            if accum_steps == 1 or pipeline is not None:
                loss, grads = grads_of(state.params, batch)
            else:
                loss, grads = accumulate(state.params, batch)
        with jax.named_scope("optimizer"):
            grad_norm = optax.tree.norm(grads)
            ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
            updates, opt_state = tx.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
            keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)  # noqa: E731
            new_state = TrainState(step=state.step + 1, params=keep(params, state.params),
                                   opt_state=keep(opt_state, state.opt_state),
                                   skipped_steps=state.skipped_steps + (~ok).astype(jnp.int32))
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr_schedule(state.step),
                   "skipped_steps": new_state.skipped_steps}
        return new_state, metrics

    return step


def make_eval_step(graphdef, resolver: Callable) -> Callable:
    loss_fn = make_loss_fn(graphdef)

    def eval_step(params, batch):
        with ax.activation_resolver(resolver):
            return loss_fn(params, batch)

    return eval_step
