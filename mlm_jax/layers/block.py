"""Pre-norm decoder block: x + attn(norm(x)), then x + ffn(norm(x)), optionally with norms on the sublayer outputs
too (x + norm(attn(norm(x))), Gemma); the FFN is dense (`mlp`) or experts (`moe`)."""
from __future__ import annotations

from dataclasses import dataclass

import jax
from flax import nnx

from mlm_jax.layers import axes as ax
from mlm_jax.layers.attention import Attention, AttentionConfig
from mlm_jax.layers.mla import LatentAttention, LatentAttentionConfig
from mlm_jax.layers.mlp import MLP
from mlm_jax.layers.moe import MoE, MoELayerConfig
from mlm_jax.layers.norm import Norm

RESIDUAL = (ax.ACT_BATCH, ax.ACT_SEQ_SP, ax.ACT_EMBED)  # sequence-parallel region
GATHERED = (ax.ACT_BATCH, ax.ACT_SEQ, ax.ACT_EMBED)  # input of the tensor-parallel matmuls


@dataclass(frozen=True)
class BlockConfig:
    attention: AttentionConfig | LatentAttentionConfig  # the latter: multi-head latent attention (`layers.mla`)
    ffn_size: int
    activation: str
    norm: str
    norm_eps: float
    init_std: float
    out_std: float  # output projections are scaled down with depth (GPT-2 / Megatron init)
    precision: str = "bf16"  # of the block's matmuls (the output head stays in `dtype`)
    moe: MoELayerConfig | None = None  # experts instead of the dense FFN
    post_norms: bool = False  # norms on the attention and FFN outputs too (Gemma 2, 3)
    norm_offset: float = 0.0  # `Norm`'s scale offset


class Block(nnx.Module):
    def __init__(self, c: BlockConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        nkw = dict(kind=c.norm, eps=c.norm_eps, dtype=dtype, param_dtype=param_dtype, offset=c.norm_offset)
        kw = dict(std=c.init_std, out_std=c.out_std, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                  precision=c.precision)
        self.attn_norm = Norm(c.attention.dim, **nkw)
        latent = isinstance(c.attention, LatentAttentionConfig)
        self.attn = (LatentAttention if latent else Attention)(c.attention, **kw)
        self.mlp_norm = Norm(c.attention.dim, **nkw)
        if c.post_norms:
            self.attn_post_norm, self.mlp_post_norm = Norm(c.attention.dim, **nkw), Norm(c.attention.dim, **nkw)
        if c.moe is None:
            self.mlp = MLP(c.attention.dim, c.ffn_size, activation=c.activation, **kw)
        else:
            self.moe = MoE(c.moe, **kw)

    def __call__(self, x_BSD: jax.Array, positions_BS: jax.Array, local: bool = False) -> tuple[jax.Array, dict]:
        """The block's output and, for an MoE block, its routing statistics (`MoE.route`); `local`: a
        sliding-window layer."""
        x_BSD, stats, _ = self.run(x_BSD, lambda h_BSD: (self.attn(h_BSD, positions_BS, local), None))
        return x_BSD, stats

    def prefill(self, x_BPD: jax.Array, positions_BP: jax.Array, local: bool, lengths_B: jax.Array,
                length: int) -> tuple[jax.Array, dict]:
        """The block over right-padded prompts, and its attention's key/value cache (`Attention.prefill`)."""
        x_BPD, _, cache = self.run(x_BPD, lambda h: self.attn.prefill(h, positions_BP, local, lengths_B, length))
        return x_BPD, cache

    def decode(self, x_BTD: jax.Array, positions_BT: jax.Array, local: bool, cache: dict) -> tuple[jax.Array, dict]:
        """The block at new positions, with its attention's cache (`Attention.decode`): its output and the cache."""
        x_BTD, _, cache = self.run(x_BTD, lambda h_BTD: self.attn.decode(h_BTD, positions_BT, local, cache))
        return x_BTD, cache

    def run(self, x_BSD: jax.Array, attention) -> tuple[jax.Array, dict, object]:
        """The block around `attention(h_BSD) -> (output, extra)`; returns (output, statistics, extra)."""
        with jax.named_scope("attention"):  # scopes name the kernels in profiles and HLO dumps
            h_BSD = ax.constrain(self.attn_norm(x_BSD), GATHERED)
            a_BSD, extra = attention(h_BSD)
            x_BSD = ax.constrain(x_BSD + self.post(a_BSD, "attn"), RESIDUAL)
        with jax.named_scope("mlp"):
            h_BSD = ax.constrain(self.mlp_norm(x_BSD), GATHERED)
            y_BSD, stats = (self.mlp(h_BSD), {}) if hasattr(self, "mlp") else self.moe(h_BSD)
            return ax.constrain(x_BSD + self.post(y_BSD, "mlp"), RESIDUAL), stats, extra

    def post(self, y_BSD: jax.Array, part: str) -> jax.Array:
        """A sublayer's output, through its post-norm if the block has them."""
        if not hasattr(self, f"{part}_post_norm"):
            return y_BSD
        return getattr(self, f"{part}_post_norm")(ax.constrain(y_BSD, RESIDUAL))
