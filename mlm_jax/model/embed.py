"""Token embedding (vocab-parallel when `vocab` maps to the tensor axis) and the output head."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from mlm_jax.model import axes as ax
from mlm_jax.model.linear import CastWeight, copy_einsum, master_einsum, param


class Embed(nnx.Module):
    def __init__(self, vocab_size: int, dim: int, *, std: float, dtype, param_dtype, rngs: nnx.Rngs,
                 scale: float = 1.0, master: bool = False):
        self.dtype, self.scale = dtype, scale  # embeddings are multiplied by `scale` (Gemma: sqrt(dim))
        self.master = master  # read the master table as `Kernels.master` says (FSDP: cast before the gather)
        self.embedding = param(std * jax.random.normal(rngs.params(), (vocab_size, dim), param_dtype),
                               (ax.VOCAB, ax.EMBED))

    def __call__(self, tokens_BS: jax.Array) -> jax.Array:
        # The lookup reads a whole table: a gather from a table split over its vocabulary would make XLA move
        # the token ids between devices (collective permutes) instead of gathering the table once.
        # Gathered in the parameter dtype, so repeated tokens' gradients add up in fp32 (under FSDP, `master_take`
        # gathers the compute dtype and adds them up in fp32 itself).
        table = self.embedding.get_value()
        if isinstance(table, CastWeight):  # a compute-dtype table beside an fp32 stand-in (per-layer accumulation)
            x_BSD = copy_take(table.master, table.copy, tokens_BS)
        elif self.master:  # a layout that casts master weights before gathering them
            x_BSD = master_take(table, tokens_BS, jnp.dtype(self.dtype))
        else:
            x_BSD = jnp.take(ax.constrain(table, (None, None)), tokens_BS, axis=0)
        x_BSD = (x_BSD * jnp.asarray(self.scale, x_BSD.dtype) if self.scale != 1.0 else x_BSD).astype(self.dtype)
        return ax.constrain(x_BSD, (ax.ACT_BATCH, ax.ACT_SEQ_SP, ax.ACT_EMBED))

    def attend(self, x_BSD: jax.Array) -> jax.Array:
        """Logits through the transposed embedding (tied embeddings)."""
        table = self.embedding.get_value()
        if isinstance(table, CastWeight):
            return copy_einsum("bsd,vd->bsv", x_BSD.astype(self.dtype), table.master, table.copy)
        if self.master:
            return master_einsum("bsd,vd->bsv", x_BSD.astype(self.dtype), table)
        return jnp.einsum("bsd,vd->bsv", x_BSD, table.astype(self.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def master_take(master_VD: jax.Array, tokens_BS: jax.Array, dtype) -> jax.Array:
    """The tokens' rows of the master table cast to `dtype`: cast on its shard, then gathered whole (16-bit bytes
    under FSDP); the gradient adds repeated tokens' rows up in fp32 and returns in the master's dtype."""
    table_VD = ax.constrain(master_VD.astype(dtype), (ax.VOCAB, ax.EMBED))  # cast where the master lies
    return jnp.take(ax.constrain(table_VD, (None, None)), tokens_BS, axis=0)


def _take_fwd(master_VD, tokens_BS, dtype):
    return master_take(master_VD, tokens_BS, dtype), (master_VD, tokens_BS)


def _take_bwd(dtype, residuals, dx_BSD):
    master_VD, tokens_BS = residuals
    return _table_gradient(master_VD, tokens_BS, dx_BSD), None


def _table_gradient(master_VD, tokens_BS, dx_BSD):
    """The rows' gradients `dx_BSD` added up per token in fp32, as the master table's gradient in its dtype."""
    grad_VD = jnp.zeros(master_VD.shape, jnp.float32).at[tokens_BS].add(dx_BSD.astype(jnp.float32))
    return ax.constrain(grad_VD, (None, None)).astype(master_VD.dtype)


master_take.defvjp(_take_fwd, _take_bwd)


@jax.custom_vjp
def copy_take(master_VD: jax.Array, copy_VD: jax.Array, tokens_BS: jax.Array) -> jax.Array:
    """`master_take` from a copy of the master table in the compute dtype (`linear.CastWeight`): the gradient, with
    repeated tokens' rows added up in fp32, returns in the master's dtype (an fp32 stand-in's: the step adds it into
    its fp32 sum unrounded); the copy gets none, as in `linear.copy_einsum`."""
    return jnp.take(ax.constrain(copy_VD, (None, None)), tokens_BS, axis=0)


def _copy_take_fwd(master_VD, copy_VD, tokens_BS):
    return copy_take(master_VD, copy_VD, tokens_BS), (master_VD, copy_VD, tokens_BS)


def _copy_take_bwd(residuals, dx_BSD):
    master_VD, copy_VD, tokens_BS = residuals
    return _table_gradient(master_VD, tokens_BS, dx_BSD), jnp.zeros_like(copy_VD), None


copy_take.defvjp(_copy_take_fwd, _copy_take_bwd)


def master_tables(module: nnx.Module) -> frozenset[tuple[str, ...]]:
    """The paths of the tables in `module` that lookups read as masters (`Embed.master`), which a step may pair
    with a copy made beforehand as it does `linear.master_kernels`'s kernels."""
    return frozenset((*map(str, path), "embedding") for path, m in nnx.iter_modules(module)
                     if isinstance(m, Embed) and m.master)
