"""Decoder-only transformer: embedding, stacked blocks (scanned or unrolled), final norm, output head.

Shapes: B batch, S sequence, D model, V vocabulary, L layers.

An MoE model keeps its MoE blocks stacked in `blocks` and, when some layers stay dense (`moe.first_dense_layers`,
`moe.every_n_layers`, `moe.dense_layers`), those in `dense_blocks`; the layers run in their model order, one
contiguous run of each kind (dense or MoE, sliding-window or full attention) at a time.
"""
from __future__ import annotations

import dataclasses
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
from mlm_jax.layers.mla import LatentAttentionConfig
from mlm_jax.layers.moe import MoELayerConfig
from mlm_jax.layers.norm import Norm
from mlm_jax.layers.rope import RopeConfig

REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,  # keep only block inputs, recompute everything
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep matmul outputs, recompute the rest
}


def block_config(m: ModelConfig, moe: bool = False) -> BlockConfig:
    local_rope = None
    if m.local_rope_theta is not None:  # Gemma 3: the sliding layers' own base, without the global scaling
        local_rope = RopeConfig(theta=m.local_rope_theta, rotary_dim=m.rotary_dim)
    attention = AttentionConfig(dim=m.hidden_size, num_heads=m.num_heads, kv_heads=m.kv_heads,
                                head_dim=m.dim_per_head, rope=rope_config(m), qk_norm=m.qk_norm,
                                qkv_bias=m.qkv_bias, norm_eps=m.norm_eps, impl=m.attention_impl,
                                window=m.sliding_window, local_rope=local_rope, scale=m.attention_scale,
                                norm_offset=m.norm_scale_offset)
    if m.mla.enabled:
        a = m.mla
        rope = dataclasses.replace(rope_config(m), rotary_dim=a.qk_rope_head_dim)
        attention = LatentAttentionConfig(dim=m.hidden_size, num_heads=m.num_heads, kv_rank=a.kv_lora_rank,
                                          q_rank=a.q_lora_rank, nope_dim=a.qk_nope_head_dim,
                                          rope_dim=a.qk_rope_head_dim, v_dim=a.v_head_dim, rope=rope,
                                          norm_eps=a.latent_norm_eps, impl=m.attention_impl, scale=m.attention_scale)
    return BlockConfig(attention=attention, ffn_size=m.ffn_size, activation=m.activation, norm=m.norm,
                       norm_eps=m.norm_eps, init_std=m.init_std,
                       out_std=m.init_std / math.sqrt(2 * m.num_layers), precision=m.precision,
                       moe=MoELayerConfig(m.hidden_size, m.expert_ffn, m.moe) if moe else None,
                       post_norms=m.post_norms, norm_offset=m.norm_scale_offset)


def rope_config(m: ModelConfig) -> RopeConfig:
    r = m.rope_scaling
    return RopeConfig(theta=m.rope_theta, rotary_dim=m.rotary_dim, kind=r.rope_type, factor=r.factor,
                      low_freq_factor=r.low_freq_factor, high_freq_factor=r.high_freq_factor,
                      original_context=r.original_max_position_embeddings, beta_fast=r.beta_fast,
                      beta_slow=r.beta_slow, mscale=r.mscale, mscale_all_dim=r.mscale_all_dim,
                      attention_factor=r.attention_factor, truncate=r.truncate)


def layer_runs(m: ModelConfig) -> tuple[tuple[bool, bool, int, int], ...]:
    """The layers as contiguous runs (dense, local, first index in that kind's stack, count), in model order:
    dense or MoE blocks live in separate stacks, sliding-window (local) and full layers share one."""
    runs: list[list] = []
    seen = {True: 0, False: 0}
    for i in range(m.num_layers):
        dense, local = m.moe.enabled and not m.moe.is_moe_layer(i), m.is_local(i)
        if runs and runs[-1][:2] == [dense, local]:
            runs[-1][3] += 1
        else:
            runs.append([dense, local, seen[dense], 1])
        seen[dense] += 1
    return tuple(tuple(r) for r in runs)


class Transformer(nnx.Module):
    """`model(tokens_BS) -> logits_BSV`; block parameters are stacked along a leading `layers` dim."""

    def __init__(self, m: ModelConfig, *, rngs: nnx.Rngs):
        self.remat = m.remat
        self.scan_layers = m.scan_layers
        dtype, param_dtype = jnp.dtype(m.dtype), jnp.dtype(m.param_dtype)
        bc = block_config(m)
        self.embed = Embed(m.vocab_size, m.hidden_size, std=m.init_std, dtype=dtype, param_dtype=param_dtype,
                           rngs=rngs, scale=math.sqrt(m.hidden_size) if m.scale_embeddings else 1.0)
        self.softcap = m.final_logit_softcap

        self.runs = layer_runs(m)

        def stacked(config: BlockConfig, count: int):
            @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: ax.LAYERS})
            def make(key):
                return Block(config, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(params=key))
            return make(jax.random.split(rngs.params(), count))

        dense_layers = sum(n for dense, _, _, n in self.runs if dense)
        self.local = m.is_local(0)  # of a pipeline chunk's layers: one kind in every layer (`validation`)
        self.blocks = stacked(block_config(m, moe=m.moe.enabled), m.num_layers - dense_layers)
        if dense_layers:
            self.dense_blocks = stacked(bc, dense_layers)
        self.final_norm = Norm(m.hidden_size, kind=m.norm, eps=m.norm_eps, dtype=dtype, param_dtype=param_dtype,
                               offset=m.norm_scale_offset)
        if not m.tie_embeddings:
            self.head = Linear("bsd,dv->bsv", (m.hidden_size, m.vocab_size), (ax.EMBED, ax.VOCAB),
                               std=m.init_std, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, tokens_BS: jax.Array, positions_BS: jax.Array | None = None) -> jax.Array:
        return self.forward(tokens_BS, positions_BS)[0]

    def forward(self, tokens_BS: jax.Array, positions_BS: jax.Array | None = None) -> tuple[jax.Array, dict]:
        """Logits and the MoE layers' routing statistics (each stacked along a leading MoE-layer dim; {} if dense)."""
        if positions_BS is None:
            positions_BS = default_positions(tokens_BS)
        with jax.named_scope("embed"):
            x_BSD = self.embed(tokens_BS)
        stats = []
        for dense, local, start, count in self.runs:
            run = None  # the whole stack
            if len(self.runs) > 1:
                run = jax.tree.map(lambda w: w[start:start + count],
                                   nnx.state(self.dense_blocks if dense else self.blocks))
            x_BSD, run_stats = self.run_blocks(x_BSD, positions_BS, run, dense=dense, local=local)
            if not dense:
                stats.append(run_stats)
        stats = jax.tree.map(lambda *s: jnp.concatenate(s), *stats) if len(stats) > 1 else stats[0]
        return self.logits(x_BSD), stats

    def run_blocks(self, x_BSD: jax.Array, positions_BS: jax.Array, stacked_state=None, dense: bool = False,
                   optional: jax.Array | None = None, local: bool | None = None) -> tuple[jax.Array, dict]:
        """The stacked blocks, or `stacked_state` (a slice of them: a pipeline chunk), in order; returns the
        output and the per-layer MoE statistics. `local`: sliding-window layers (default: the kind of a model
        whose layers are all of one kind). `optional` (traced bools for the last layers) skips those it
        marks False: a pipeline chunk shorter than the room its stage has for one. Unrolled, only those layers
        sit in a `lax.cond`; scanned, every layer does (one body).

        Scanned, one layer body is compiled whatever the depth; unrolled, XLA schedules and fuses across layer
        boundaries (and overlaps FSDP gathers with the previous layer), which runs faster. Parameters stay
        stacked either way, so checkpoints and shardings do not depend on the choice.
        """
        graphdef, state = nnx.split(self.dense_blocks if dense else self.blocks)
        stacked_state = state if stacked_state is None else stacked_state

        local = self.local if local is None else local

        def block(x_BSD, layer_state):
            return nnx.merge(graphdef, layer_state)(x_BSD, positions_BS, local)

        if self.remat != "none":
            block = jax.checkpoint(block, policy=REMAT_POLICIES[self.remat], prevent_cse=not self.scan_layers)

        def layer(x_BSD, xs):
            layer_state, on = xs
            if on is None:
                return block(x_BSD, layer_state)
            stats = jax.eval_shape(block, x_BSD, layer_state)[1]
            skip = lambda x, _: (x, jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), stats))  # noqa: E731
            return jax.lax.cond(on, block, skip, x_BSD, layer_state)

        n = jax.tree.leaves(stacked_state)[0].shape[0]
        fixed = n - (0 if optional is None else optional.shape[0])  # the layers that always run
        if self.scan_layers:
            active = None if optional is None else jnp.concatenate([jnp.ones(fixed, bool), optional])
            return jax.lax.scan(layer, x_BSD, (stacked_state, active))
        stats = []
        for i in range(n):
            on = None if i < fixed else optional[i - fixed]
            x_BSD, layer_stats = layer(x_BSD, (jax.tree.map(lambda w: w[i], stacked_state), on))
            stats.append(layer_stats)
        return x_BSD, jax.tree.map(lambda *s: jnp.stack(s), *stats)

    def logits(self, x_BSD: jax.Array) -> jax.Array:
        """Final norm and output head."""
        with jax.named_scope("head"):
            x_BSD = ax.constrain(self.final_norm(x_BSD), (ax.ACT_BATCH, ax.ACT_SEQ, ax.ACT_EMBED))
            logits_BSV = self.embed.attend(x_BSD) if not hasattr(self, "head") else self.head(x_BSD)
            if self.softcap is not None:
                logits_BSV = (self.softcap * jnp.tanh(logits_BSV.astype(jnp.float32) / self.softcap)).astype(
                    logits_BSV.dtype)
            return ax.constrain(logits_BSV, (ax.ACT_BATCH, ax.ACT_SEQ, ax.ACT_VOCAB))


def default_positions(tokens_BS: jax.Array) -> jax.Array:
    return jnp.broadcast_to(jnp.arange(tokens_BS.shape[1]), tokens_BS.shape)
