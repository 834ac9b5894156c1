"""Pre-norm decoder block: x + attn(norm(x)), then x + ffn(norm(x)), optionally with norms on the sublayer outputs
too (x + norm(attn(norm(x))), Gemma); the FFN is dense (`mlp`) or experts (`moe`)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
from flax import nnx

from mlm_jax.model import axes as ax
from mlm_jax.model.attention import Attention, AttentionConfig
from mlm_jax.model.kernels import Kernels
from mlm_jax.model.mla import LatentAttention, LatentAttentionConfig
from mlm_jax.model.mlp import MLP
from mlm_jax.model.moe import MoE, MoELayerConfig
from mlm_jax.model.norm import Norm

RESIDUAL = (ax.ACT_BATCH, ax.ACT_SEQ_SP, ax.ACT_EMBED)  # sequence-parallel region
GATHERED = (ax.ACT_BATCH, ax.ACT_SEQ, ax.ACT_EMBED)  # input of the tensor-parallel matmuls


@dataclass(frozen=True)
class BlockConfig:
    attention: AttentionConfig | LatentAttentionConfig  # the latter: multi-head latent attention (`model.mla`)
    ffn_size: int
    activation: str
    norm: str
    norm_eps: float
    init_std: float
    out_std: float  # output projections are scaled down with depth (GPT-2 / Megatron init)
    precision: str = "bf16"  # of the block's matmuls (the output head stays in `dtype`)
    fp8_history: int = 16  # steps of max magnitudes a delayed-scaling (fp8_delayed) product scales by
    moe: MoELayerConfig | None = None  # experts instead of the dense FFN
    post_norms: bool = False  # norms on the attention and FFN outputs too (Gemma 2, 3)
    norm_offset: float = 0.0  # `Norm`'s scale offset


@dataclass(frozen=True)
class Sublayers:
    """The classes a block builds its sublayers from (decode-time blocks pass their own, `mlm_jax.infer`)."""

    attention: Callable = Attention
    latent_attention: Callable = LatentAttention
    mlp: Callable = MLP


class Block(nnx.Module):
    def __init__(self, c: BlockConfig, *, dtype, param_dtype, rngs: nnx.Rngs, kernels: Kernels = Kernels(),
                 sublayers: Sublayers = Sublayers()):
        nkw = dict(kind=c.norm, eps=c.norm_eps, dtype=dtype, param_dtype=param_dtype, offset=c.norm_offset)
        self.c, self.precision = c, c.precision
        kw = dict(std=c.init_std, out_std=c.out_std, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                  precision=c.precision, fp8_history=c.fp8_history, kernels=kernels)
        self.attn_norm = Norm(c.attention.dim, **nkw)
        latent = isinstance(c.attention, LatentAttentionConfig)
        self.attn = (sublayers.latent_attention if latent else sublayers.attention)(c.attention, **kw)
        self.mlp_norm = Norm(c.attention.dim, **nkw)
        if c.post_norms:
            self.attn_post_norm, self.mlp_post_norm = Norm(c.attention.dim, **nkw), Norm(c.attention.dim, **nkw)
        if c.moe is None:
            self.mlp = sublayers.mlp(c.attention.dim, c.ffn_size, activation=c.activation, **kw)
        else:
            self.moe = MoE(c.moe, **kw)

    def __call__(self, x_BSD: jax.Array, positions_BS: jax.Array, local: bool = False,
                 segment_ids_BS: jax.Array | None = None) -> tuple[jax.Array, dict]:
        """The block's output and, for an MoE block, its routing statistics (`MoE.route`); `local`: a
        sliding-window layer; `segment_ids_BS`: each token's document, which attention keeps apart."""
        x_BSD, stats, _ = self.run(x_BSD, lambda h_BSD, _: (self.attn(h_BSD, positions_BS, local, segment_ids_BS),
                                                           None))
        return x_BSD, stats

    def run(self, x_BSD: jax.Array, attention, folded: bool = False) -> tuple[jax.Array, dict, object]:
        """The block around `attention(h_BSD, row_scale_BS1) -> (output, extra)`; returns (output, statistics,
        extra). `folded`: the norms' gains folded into the products they feed (decode-time blocks, `mlm_jax.infer`),
        the sublayers get the un-normed rows and 1 / rms."""
        with jax.named_scope("attention"):  # scopes name the kernels in profiles and HLO dumps
            h_BSD, r_BS1 = self.normed(self.attn_norm, x_BSD, folded)
            a_BSD, extra = attention(h_BSD, r_BS1)
            x_BSD = ax.constrain(x_BSD + self.post(a_BSD, "attn"), RESIDUAL)
        with jax.named_scope("mlp"):
            h_BSD, r_BS1 = self.normed(self.mlp_norm, x_BSD, folded)
            y_BSD, stats = (self.mlp(h_BSD, r_BS1), {}) if hasattr(self, "mlp") else self.moe(h_BSD)
            return ax.constrain(x_BSD + self.post(y_BSD, "mlp"), RESIDUAL), stats, extra

    @staticmethod
    def normed(norm: Norm, x_BSD: jax.Array, folded: bool) -> tuple[jax.Array, jax.Array | None]:
        """A sublayer's input and the row scale of its products."""
        if folded:
            return ax.constrain(x_BSD.astype(norm.dtype), GATHERED), norm.factor(x_BSD)
        return ax.constrain(norm(x_BSD), GATHERED), None

    def post(self, y_BSD: jax.Array, part: str) -> jax.Array:
        """A sublayer's output, through its post-norm if the block has them."""
        if not hasattr(self, f"{part}_post_norm"):
            return y_BSD
        return getattr(self, f"{part}_post_norm")(ax.constrain(y_BSD, RESIDUAL))

