"""Decoder-only transformer: embedding, stacked blocks (scanned or unrolled), final norm, output head.

Shapes: B batch, S sequence, D model, V vocabulary, L layers.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from mlm_jax.config import ModelConfig
from mlm_jax.layers import axes as ax
from mlm_jax.layers.attention import AttentionConfig
from mlm_jax.layers.block import Block, BlockConfig
from mlm_jax.layers.embed import Embed
from mlm_jax.layers.linear import Linear
from mlm_jax.layers.norm import Norm

REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,  # keep only block inputs, recompute everything
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep matmul outputs, recompute the rest
}


def block_config(m: ModelConfig) -> BlockConfig:
    attention = AttentionConfig(dim=m.hidden_size, num_heads=m.num_heads, kv_heads=m.kv_heads,
                                head_dim=m.dim_per_head, rope_theta=m.rope_theta, qk_norm=m.qk_norm, qkv_bias=m.qkv_bias,
                                norm_eps=m.norm_eps, impl=m.attention_impl)
    return BlockConfig(attention=attention, ffn_size=m.ffn_size, activation=m.activation, norm=m.norm,
                       norm_eps=m.norm_eps, init_std=m.init_std,
                       out_std=m.init_std / math.sqrt(2 * m.num_layers), precision=m.precision)


class Transformer(nnx.Module):
    """`model(tokens_BS) -> logits_BSV`; block parameters are stacked along a leading `layers` dim."""

    def __init__(self, m: ModelConfig, *, rngs: nnx.Rngs):
        self.remat = m.remat
        self.scan_layers = m.scan_layers
        dtype, param_dtype = jnp.dtype(m.dtype), jnp.dtype(m.param_dtype)
        bc = block_config(m)
        self.embed = Embed(m.vocab_size, m.hidden_size, std=m.init_std, dtype=dtype, param_dtype=param_dtype,
                           rngs=rngs)

        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: ax.LAYERS})
        def stacked(key):
            return Block(bc, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(params=key))

        self.blocks = stacked(jax.random.split(rngs.params(), m.num_layers))
        self.final_norm = Norm(m.hidden_size, kind=m.norm, eps=m.norm_eps, dtype=dtype, param_dtype=param_dtype)
        if not m.tie_embeddings:
            self.head = Linear("bsd,dv->bsv", (m.hidden_size, m.vocab_size), (ax.EMBED, ax.VOCAB),
                               std=m.init_std, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, tokens_BS: jax.Array, positions_BS: jax.Array | None = None) -> jax.Array:
        if positions_BS is None:
            positions_BS = default_positions(tokens_BS)
        with jax.named_scope("embed"):
            x_BSD = self.embed(tokens_BS)
        x_BSD = self.run_blocks(x_BSD, positions_BS)
        return self.logits(x_BSD)

    def run_blocks(self, x_BSD: jax.Array, positions_BS: jax.Array, stacked_state=None) -> jax.Array:
        """The stacked blocks, or `stacked_state` (a slice of them: a pipeline chunk), in order.

        Scanned, one layer body is compiled whatever the depth; unrolled, XLA schedules and fuses across layer
        boundaries (and overlaps FSDP gathers with the previous layer), which runs faster. Parameters stay
        stacked either way, so checkpoints and shardings do not depend on the choice.
        """
        graphdef, state = nnx.split(self.blocks)
        stacked_state = state if stacked_state is None else stacked_state

        def layer(x_BSD, layer_state):
            return nnx.merge(graphdef, layer_state)(x_BSD, positions_BS)

        if self.remat != "none":
            layer = jax.checkpoint(layer, policy=REMAT_POLICIES[self.remat], prevent_cse=not self.scan_layers)
        if self.scan_layers:
            x_BSD, _ = jax.lax.scan(lambda x, s: (layer(x, s), None), x_BSD, stacked_state)
            return x_BSD
        for i in range(jax.tree.leaves(stacked_state)[0].shape[0]):
            x_BSD = layer(x_BSD, jax.tree.map(lambda w: w[i], stacked_state))
        return x_BSD

    def logits(self, x_BSD: jax.Array) -> jax.Array:
        """Final norm and output head."""
        with jax.named_scope("head"):
            x_BSD = ax.constrain(self.final_norm(x_BSD), (ax.ACT_BATCH, ax.ACT_SEQ, ax.ACT_EMBED))
            logits_BSV = self.embed.attend(x_BSD) if not hasattr(self, "head") else self.head(x_BSD)
            return ax.constrain(logits_BSV, (ax.ACT_BATCH, ax.ACT_SEQ, ax.ACT_VOCAB))


def default_positions(tokens_BS: jax.Array) -> jax.Array:
    return jnp.broadcast_to(jnp.arange(tokens_BS.shape[1]), tokens_BS.shape)
