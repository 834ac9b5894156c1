"""AdamW with global-norm clipping, a learning-rate schedule and no weight decay on norms and biases."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from mlm_jax.config import OptimConfig
from mlm_jax.ops.fp8 import HISTORY

NO_DECAY = ("scale", "bias", HISTORY)  # norm scales, biases, fp8 histories (leaf names in the parameter tree)


def schedule(o: OptimConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup, then cosine to `min_lr`, warmup-stable-decay (linear to `min_lr`), or constant."""
    warmup = optax.linear_schedule(0.0, o.lr, o.warmup_steps) if o.warmup_steps else optax.constant_schedule(o.lr)
    rest = max(total_steps - o.warmup_steps, 1)
    if o.schedule == "cosine":
        after = optax.cosine_decay_schedule(o.lr, rest, alpha=o.min_lr / o.lr if o.lr else 0.0)
    elif o.schedule == "wsd":
        decay = max(round(o.decay_fraction * total_steps), 1)
        stable = max(rest - decay, 0)
        after = optax.join_schedules(
            [optax.constant_schedule(o.lr), optax.linear_schedule(o.lr, o.min_lr, decay)], [stable])
    else:
        after = optax.constant_schedule(o.lr)
    return optax.join_schedules([warmup, after], [o.warmup_steps])


def decay_mask(params):
    return jax.tree_util.tree_map_with_path(
        lambda path, _: getattr(path[-1], "key", None) not in NO_DECAY, params)


def make_optimizer(o: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    adamw = optax.adamw(schedule(o, total_steps), b1=o.beta1, b2=o.beta2, eps=o.eps, weight_decay=o.weight_decay,
                        mask=decay_mask)
    tx = optax.chain(optax.clip_by_global_norm(o.clip_grad), adamw) if o.clip_grad else adamw
    return tx if o.moments_dtype == "float32" else stored_as(tx, jnp.dtype(o.moments_dtype))


def stored_as(inner: optax.GradientTransformation, dtype) -> optax.GradientTransformation:
    """`inner` with its floating-point state (Adam's moments) kept in `dtype` between steps and updated in fp32:
    half the optimizer state's bytes in bf16, read and written once per step."""
    def cast(tree, to):
        return jax.tree.map(lambda x: x.astype(to) if jnp.issubdtype(getattr(x, "dtype", int), jnp.floating)
                            else x, tree)

    def init(params):
        return cast(inner.init(params), dtype)

    def update(updates, state, params=None):
        updates, state = inner.update(updates, cast(state, jnp.float32), params)
        return updates, cast(state, dtype)

    return optax.GradientTransformation(init, update)
