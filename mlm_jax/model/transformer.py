"""Decoder-only transformer: embedding, stacked blocks (scanned or unrolled), final norm, output head.

Shapes: B batch, S sequence, D model, V vocabulary, L layers.

An MoE model keeps its MoE blocks stacked in `blocks` and, when some layers stay dense (`moe.first_dense_layers`,
`moe.every_n_layers`, `moe.dense_layers`), those in `dense_blocks`; the layers run in their model order, one
contiguous run of each kind (dense or MoE, sliding-window or full attention) at a time. A pipeline chunk
(`parallel.stages.run_chunk`) may hold layers of several kinds, which can differ from chunk to chunk.

The model only models: pipeline stages run its layers through `block_fn` (`parallel.stages`), and decoding builds
decode-time blocks of its own from the weights (`mlm_jax.infer`).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from mlm_jax.config import ModelConfig
from mlm_jax.model import axes as ax
from mlm_jax.model.attention import AttentionConfig
from mlm_jax.model.block import Block, BlockConfig
from mlm_jax.model.embed import Embed
from mlm_jax.model.kernels import Kernels
from mlm_jax.model.linear import PRODUCT, Linear
from mlm_jax.model.mla import LatentAttentionConfig
from mlm_jax.model.moe import MoELayerConfig
from mlm_jax.model.norm import Norm
from mlm_jax.model.rope import RopeConfig

REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,  # keep only block inputs, recompute everything
    # keep matmul outputs (the layers' and experts' products, `linear.PRODUCT`, whichever kernel makes them), recompute
    # the rest
    "dots": jax.checkpoint_policies.save_from_both_policies(jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
                                                            jax.checkpoint_policies.save_only_these_names(PRODUCT)),
}


def block_config(m: ModelConfig, moe: bool = False) -> BlockConfig:
    local_rope = None
    if m.local_rope_theta is not None:  # Gemma 3: the sliding layers' own base, without the global scaling
        local_rope = RopeConfig(theta=m.local_rope_theta, rotary_dim=m.rotary_dim)
    attention = AttentionConfig(dim=m.hidden_size, num_heads=m.num_heads, kv_heads=m.kv_heads,
                                head_dim=m.dim_per_head, rope=rope_config(m), qk_norm=m.qk_norm,
                                qkv_bias=m.qkv_bias, norm_eps=m.norm_eps,
                                window=m.sliding_window, local_rope=local_rope, scale=m.attention_scale,
                                norm_offset=m.norm_scale_offset)
    if m.mla.enabled:
        a = m.mla
        rope = dataclasses.replace(rope_config(m), rotary_dim=a.qk_rope_head_dim)
        attention = LatentAttentionConfig(dim=m.hidden_size, num_heads=m.num_heads, kv_rank=a.kv_lora_rank,
                                          q_rank=a.q_lora_rank, nope_dim=a.qk_nope_head_dim,
                                          rope_dim=a.qk_rope_head_dim, v_dim=a.v_head_dim, rope=rope,
                                          norm_eps=a.latent_norm_eps, scale=m.attention_scale)
    return BlockConfig(attention=attention, ffn_size=m.ffn_size, activation=m.activation, norm=m.norm,
                       norm_eps=m.norm_eps, init_std=m.init_std,
                       out_std=m.init_std / math.sqrt(2 * m.num_layers), precision=m.precision,
                       fp8_history=m.fp8_amax_history,
                       moe=MoELayerConfig(m.hidden_size, m.expert_ffn, moe_layer(m.moe)) if moe else None,
                       post_norms=m.post_norms, norm_offset=m.norm_scale_offset)


def moe_layer(moe):
    """The MoE settings a layer uses: without which layers are dense (the model's concern), so that the module's
    static configuration stays hashable (a list is not) and jitted programs are cached by it."""
    return dataclasses.replace(moe, dense_layers=None)


def rope_config(m: ModelConfig) -> RopeConfig:
    r = m.rope_scaling
    return RopeConfig(theta=m.rope_theta, rotary_dim=m.rotary_dim, kind=r.rope_type, factor=r.factor,
                      low_freq_factor=r.low_freq_factor, high_freq_factor=r.high_freq_factor,
                      original_context=r.original_max_position_embeddings, beta_fast=r.beta_fast,
                      beta_slow=r.beta_slow, mscale=r.mscale, mscale_all_dim=r.mscale_all_dim,
                      attention_factor=r.attention_factor, truncate=r.truncate)


STACKS = ("blocks", "dense_blocks")  # the collections of stacked layer weights
Kind = tuple[str, bool]  # a layer's stack (`blocks` or `dense_blocks`) and whether it attends through the window


def layer_kinds(m: ModelConfig) -> tuple[Kind, ...]:
    """Each layer's kind, in model order: an MoE model's dense layers live in `dense_blocks`, every other layer in
    `blocks`; sliding-window (local) and full layers share their stack."""
    return tuple(("dense_blocks" if m.moe.enabled and not m.moe.is_moe_layer(i) else "blocks", m.is_local(i))
                 for i in range(m.num_layers))


def layer_runs(m: ModelConfig) -> tuple[tuple[Kind, int, int], ...]:
    """The layers as contiguous runs of one kind (kind, first index in its stack, count), in model order."""
    runs: list[list] = []
    seen = {"blocks": 0, "dense_blocks": 0}
    for kind in layer_kinds(m):
        if runs and runs[-1][0] == kind:
            runs[-1][2] += 1
        else:
            runs.append([kind, seen[kind[0]], 1])
        seen[kind[0]] += 1
    return tuple(tuple(r) for r in runs)


class Transformer(nnx.Module):
    """`model(tokens_BS) -> logits_BSV`; block parameters are stacked along a leading `layers` dim. `kernels`: the
    implementations every layer runs (`model.kernels`; the default is XLA's reference everywhere)."""

    def __init__(self, m: ModelConfig, *, rngs: nnx.Rngs, kernels: Kernels = Kernels()):
        self.remat = m.remat
        self.scan_layers = m.scan_layers
        self.kernels = kernels
        dtype, param_dtype = jnp.dtype(m.dtype), jnp.dtype(m.param_dtype)
        bc = block_config(m)
        self.embed = Embed(m.vocab_size, m.hidden_size, std=m.init_std, dtype=dtype, param_dtype=param_dtype,
                           rngs=rngs, scale=math.sqrt(m.hidden_size) if m.scale_embeddings else 1.0,
                           master=kernels.master)
        self.softcap = m.final_logit_softcap

        self.runs = layer_runs(m)

        def stacked(config: BlockConfig, count: int):
            @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: ax.LAYERS})
            def make(key):
                return Block(config, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(params=key), kernels=kernels)
            return make(jax.random.split(rngs.params(), count))

        dense_layers = sum(n for (stack, _), _, n in self.runs if stack == "dense_blocks")
        self.blocks = stacked(block_config(m, moe=m.moe.enabled), m.num_layers - dense_layers)
        if dense_layers:
            self.dense_blocks = stacked(bc, dense_layers)
        self.final_norm = Norm(m.hidden_size, kind=m.norm, eps=m.norm_eps, dtype=dtype, param_dtype=param_dtype,
                               offset=m.norm_scale_offset)
        if not m.tie_embeddings:
            self.head = Linear("bsd,dv->bsv", (m.hidden_size, m.vocab_size), (ax.EMBED, ax.VOCAB),
                               std=m.init_std, dtype=dtype, param_dtype=param_dtype, rngs=rngs, kernels=kernels)

    def __call__(self, tokens_BS: jax.Array, positions_BS: jax.Array | None = None,
                 segment_ids_BS: jax.Array | None = None) -> jax.Array:
        """Logits. `segment_ids_BS`: each token's document (several may share a row; each sees only itself);
        `positions_BS`: each token's RoPE position, by default counted from the start of its segment."""
        return self.forward(tokens_BS, positions_BS, segment_ids_BS)[0]

    def forward(self, tokens_BS: jax.Array, positions_BS: jax.Array | None = None,
                segment_ids_BS: jax.Array | None = None) -> tuple[jax.Array, dict]:
        """Logits and the MoE layers' routing statistics (each stacked along a leading MoE-layer dim; {} if dense)."""
        x_BSD, stats = self.hidden(tokens_BS, positions_BS, segment_ids_BS)
        return self.logits(x_BSD), stats

    def hidden(self, tokens_BS: jax.Array, positions_BS: jax.Array | None = None,
               segment_ids_BS: jax.Array | None = None) -> tuple[jax.Array, dict]:
        """The last block's output (before the final norm) and the routing statistics of `forward`."""
        if positions_BS is None:
            positions_BS = default_positions(tokens_BS) if segment_ids_BS is None else segment_positions(segment_ids_BS)
        with jax.named_scope("embed"):
            x_BSD = self.embed(tokens_BS)
        stats, per_layer = [], {}
        for kind, start, count in self.runs:
            stack = nnx.state(getattr(self, kind[0]))
            if not self.scan_layers:
                if kind[0] not in per_layer:
                    per_layer[kind[0]] = split_layers(stack)
                stack = per_layer[kind[0]][start:start + count]
            elif len(self.runs) > 1:
                stack = jax.tree.map(lambda w: w[start:start + count], stack)
            x_BSD, run_stats = self.run_blocks(x_BSD, positions_BS, stack, kind, segment_ids_BS)
            if run_stats:
                stats.append(run_stats)
        stats = jax.tree.map(lambda *s: jnp.concatenate(s), *stats) if len(stats) > 1 else (stats or [{}])[0]
        return x_BSD, stats

    def block_fn(self, kind: Kind):
        """`(x_BSD, positions_BS, layer_state, segment_ids_BS=None) -> (x_BSD, MoE statistics)`: one layer of
        `kind`, with the model's recompute policy."""
        stack, local = kind
        graphdef = nnx.graphdef(getattr(self, stack))

        def block(x_BSD, positions_BS, layer_state, segment_ids_BS=None):
            return nnx.merge(graphdef, layer_state)(x_BSD, positions_BS, local, segment_ids_BS)

        if self.remat != "none":
            block = jax.checkpoint(block, policy=REMAT_POLICIES[self.remat], prevent_cse=not self.scan_layers)
        return block

    def run_blocks(self, x_BSD: jax.Array, positions_BS: jax.Array, layers, kind: Kind,
                   segment_ids_BS: jax.Array | None = None) -> tuple[jax.Array, dict]:
        """Layers of one kind in order (`layers`: their stacked weights, scanned, or a list of each layer's
        weights, `split_layers`, unrolled); returns the output and the per-layer MoE statistics.

        Scanned, one layer body is compiled whatever the depth; unrolled, XLA schedules and fuses across layer
        boundaries (and overlaps FSDP gathers with the previous layer), which runs faster. Parameters stay
        stacked either way, so checkpoints and shardings do not depend on the choice.
        """
        block = self.block_fn(kind)
        layer = lambda x_BSD, layer_state: block(x_BSD, positions_BS, layer_state, segment_ids_BS)  # noqa: E731
        if self.scan_layers:
            return jax.lax.scan(layer, x_BSD, layers)
        stats = []
        for layer_state in layers:
            x_BSD, layer_stats = layer(x_BSD, layer_state)
            stats.append(layer_stats)
        return x_BSD, jax.tree.map(lambda *s: jnp.stack(s), *stats)

    def head_input(self, x_BSD: jax.Array) -> tuple[jax.Array, jax.Array, bool]:
        """What the output head multiplies, for a loss that runs the head itself (`train.loss.head_loss`): the final
        norm's output in the compute dtype, the head's stored weight ([D, V], or the [V, D] embedding table when
        tied; a `linear.CastWeight` where the step pairs it with a copy) and whether it is tied. `softcap` caps the
        products as `logits` does."""
        x_BSD = ax.constrain(self.final_norm(x_BSD), (ax.ACT_BATCH, ax.ACT_SEQ, ax.ACT_EMBED))
        if hasattr(self, "head"):
            return x_BSD.astype(self.head.dtype), self.head.kernel.get_value(), False
        return x_BSD.astype(self.embed.dtype), self.embed.embedding.get_value(), True

    def logits(self, x_BSD: jax.Array) -> jax.Array:
        """Final norm and output head."""
        with jax.named_scope("head"):
            x_BSD = ax.constrain(self.final_norm(x_BSD), (ax.ACT_BATCH, ax.ACT_SEQ, ax.ACT_EMBED))
            logits_BSV = self.embed.attend(x_BSD) if not hasattr(self, "head") else self.head(x_BSD)
            if self.softcap is not None:
                logits_BSV = (self.softcap * jnp.tanh(logits_BSV.astype(jnp.float32) / self.softcap)).astype(
                    logits_BSV.dtype)
            return ax.constrain(logits_BSV, (ax.ACT_BATCH, ax.ACT_SEQ, ax.ACT_VOCAB))


@jax.custom_vjp
def _unstack(w_L: jax.Array) -> tuple[jax.Array, ...]:
    return tuple(w_L[i] for i in range(w_L.shape[0]))


_unstack.defvjp(lambda w_L: (_unstack(w_L), None), lambda _, grads: (jnp.stack(grads),))


def split_layers(stacked) -> list:
    """Each layer's weights out of the stacked ones, through one op per leaf whose gradient stacks the layers'
    gradients: a slice per layer would have as gradient a zero-padded stack per layer, summed, which XLA does not
    turn back into the layers' own gradients; this one it does where the stack was itself built from per-layer
    arrays (`train.step`'s gradient accumulation keeps one sum per layer)."""
    leaves, treedef = jax.tree.flatten(stacked)
    parts = [_unstack(w) for w in leaves]
    return [jax.tree.unflatten(treedef, [p[i] for p in parts]) for i in range(len(parts[0]))]


def layers_of(stack, n: int, take=lambda w, i: w[i]) -> list:
    """A stacked tree's n layers, each a tree of the stack's structure (`take(leaf, i)`: layer i of a leaf): what
    gradient accumulation per layer (`train.step`) and the pipeline's chunks (`parallel.pipeline`) take apart once a
    step, so that each layer's products read its weights, and add into its gradient sum, in place."""
    return [jax.tree.map(lambda w, i=i: take(w, i), stack) for i in range(n)]


def stack_layers(layers: list):
    """`layers_of`'s inverse: the layers' trees stacked along a new leading dim."""
    return jax.tree.map(lambda *ws: jnp.stack(ws), *layers)


def default_positions(tokens_BS: jax.Array) -> jax.Array:
    return jnp.broadcast_to(jnp.arange(tokens_BS.shape[1]), tokens_BS.shape)


def segment_positions(segment_ids_BS: jax.Array) -> jax.Array:
    """Each token's position within its segment (a run of equal ids): RoPE restarts at every document."""
    index_BS = default_positions(segment_ids_BS)
    starts_BS = jnp.concatenate([jnp.ones_like(segment_ids_BS[:, :1], bool),
                                 segment_ids_BS[:, 1:] != segment_ids_BS[:, :-1]], axis=1)
    return index_BS - jax.lax.cummax(jnp.where(starts_BS, index_BS, 0), axis=1)


class ModelSpec(NamedTuple):
    graphdef: nnx.GraphDef
    shapes: Any  # nested dict of ShapeDtypeStruct
    names: Any  # nested dict of PartitionSpec holding logical dim names


def model_spec(m: ModelConfig, kernels: Kernels = Kernels()) -> ModelSpec:
    """The model's structure (with `kernels`), parameter shapes and logical names, without allocating anything."""
    abstract = nnx.eval_shape(lambda: Transformer(m, rngs=nnx.Rngs(0), kernels=kernels))
    graphdef, state = nnx.split(abstract)
    return ModelSpec(graphdef, nnx.to_pure_dict(state), nnx.to_pure_dict(nnx.get_partition_spec(state)))
