"""Token embedding (vocab-parallel when `vocab` maps to the tensor axis) and the output head."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mlm_jax.layers import axes as ax
from mlm_jax.layers.linear import param


class Embed(nnx.Module):
    def __init__(self, vocab_size: int, dim: int, *, std: float, dtype, param_dtype, rngs: nnx.Rngs,
                 scale: float = 1.0):
        self.dtype, self.scale = dtype, scale  # embeddings are multiplied by `scale` (Gemma: sqrt(dim))
        self.embedding = param(std * jax.random.normal(rngs.params(), (vocab_size, dim), param_dtype),
                               (ax.VOCAB, ax.EMBED))

    def __call__(self, tokens_BS: jax.Array) -> jax.Array:
        # The lookup reads a whole table: a gather from a table split over its vocabulary would make XLA move
        # the token ids between devices (collective permutes) instead of gathering the table once.
        # Gathered in the parameter dtype, so repeated tokens' gradients add up in fp32.
        table_VD = ax.constrain(self.embedding[...], (None, None))
        x_BSD = jnp.take(table_VD, tokens_BS, axis=0)
        x_BSD = (x_BSD * jnp.asarray(self.scale, x_BSD.dtype) if self.scale != 1.0 else x_BSD).astype(self.dtype)
        return ax.constrain(x_BSD, (ax.ACT_BATCH, ax.ACT_SEQ_SP, ax.ACT_EMBED))

    def attend(self, x_BSD: jax.Array) -> jax.Array:
        """Logits through the transposed embedding (tied embeddings)."""
        return jnp.einsum("bsd,vd->bsv", x_BSD, self.embedding[...].astype(self.dtype))
