"""Train state and its sharded creation: eval_shape -> shardings -> jit(init, out_shardings=...)."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mlm_jax.config import ModelConfig
from mlm_jax.checkpoint.state import TrainState
from mlm_jax.model.transformer import Transformer


def init_params(m: ModelConfig, seed: int, shardings) -> Any:
    """Parameters created directly in their shards (never whole on one device)."""
    def init():
        return nnx.to_pure_dict(nnx.state(Transformer(m, rngs=nnx.Rngs(seed)), nnx.Param))
    return jax.jit(init, out_shardings=shardings)()


def opt_state_shardings(tx: optax.GradientTransformation, params_shapes, param_shardings, mesh: Mesh):
    """Moments follow their parameter's sharding; counters and other scalars are replicated."""
    shapes = jax.eval_shape(tx.init, params_shapes)
    replicated = NamedSharding(mesh, PartitionSpec())
    return optax.tree_map_params(tx, lambda _, s: s, shapes, param_shardings,
                                 transform_non_params=lambda _: replicated)


def init_state(tx, params, opt_shardings, mesh: Mesh) -> TrainState:
    opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(params)
    replicated = NamedSharding(mesh, PartitionSpec())
    step, skipped = (jax.device_put(jnp.zeros((), jnp.int32), replicated) for _ in range(2))  # distinct buffers
    return TrainState(step=step, params=params, opt_state=opt_state, skipped_steps=skipped)


def abstract_state(tx, params_shapes, param_shardings, opt_shardings, mesh: Mesh) -> TrainState:
    """Shapes, dtypes and target shardings of the whole state: what a checkpoint is restored into."""
    def sds(x, sharding):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    scalar = sds(jax.ShapeDtypeStruct((), jnp.int32), NamedSharding(mesh, PartitionSpec()))
    return TrainState(step=scalar, params=jax.tree.map(sds, params_shapes, param_shardings),
                      opt_state=jax.tree.map(sds, jax.eval_shape(tx.init, params_shapes), opt_shardings),
                      skipped_steps=scalar)


def state_shardings(state: TrainState):
    return jax.tree.map(lambda x: x.sharding, state)
