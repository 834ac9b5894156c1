"""Pre-norm decoder block: x + attn(norm(x)), then x + ffn(norm(x)), optionally with norms on the sublayer outputs
too (x + norm(attn(norm(x))), Gemma); the FFN is dense (`mlp`) or experts (`moe`)."""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
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
    fp8_history: int = 16  # steps of max magnitudes a delayed-scaling (fp8_delayed) product scales by
    moe: MoELayerConfig | None = None  # experts instead of the dense FFN
    post_norms: bool = False  # norms on the attention and FFN outputs too (Gemma 2, 3)
    norm_offset: float = 0.0  # `Norm`'s scale offset


class Block(nnx.Module):
    def __init__(self, c: BlockConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        nkw = dict(kind=c.norm, eps=c.norm_eps, dtype=dtype, param_dtype=param_dtype, offset=c.norm_offset)
        self.precision = c.precision
        kw = dict(std=c.init_std, out_std=c.out_std, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                  precision=c.precision, fp8_history=c.fp8_history)
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
        x_BSD, stats, _ = self.run(x_BSD, lambda h_BSD, _: (self.attn(h_BSD, positions_BS, local), None))
        return x_BSD, stats

    def prefill(self, x_BPD: jax.Array, positions_BP: jax.Array, local: bool, lengths_B: jax.Array,
                length: int) -> tuple[jax.Array, dict]:
        """The block over right-padded prompts, and its attention's key/value cache (`Attention.prefill`). Takes
        a block of `Transformer.layer_states` (norms folded, `fold_norms`)."""
        x_BPD, _, cache = self.run(x_BPD, lambda h, r: self.attn.prefill(h, positions_BP, local, lengths_B, length,
                                                                          **scaled(r)), self.foldable)
        return x_BPD, cache

    def decode(self, x_BTD: jax.Array, positions_BT: jax.Array, local: bool, cache: dict,
               row_scale_BT1=None) -> tuple[jax.Array, dict, object]:
        """The block at new positions, with its attention's cache (`Attention.decode`): its output, the cache, and
        the output's attention-norm factor where the kernel installed as `axes.RESIDUAL` made it (an array or a
        `gemv.RowFactor`), else None (the next block's `row_scale_BT1`, its input's factor if known: a model's
        blocks share their norms' eps). Takes a block of `Transformer.layer_states` (norms folded, `fold_norms`)."""
        residual = ax.kernel(ax.RESIDUAL)
        if residual is None or not self.foldable or hasattr(self, "attn_post_norm"):
            x_BTD, _, cache = self.run(x_BTD, lambda h, r: self.attn.decode(h, positions_BT, local, cache,
                                                                            **scaled(r)), self.foldable)
            return x_BTD, cache, None
        # each residual add and the next norm's factor in one kernel, which sums the product's partials itself
        with jax.named_scope("attention"):
            if row_scale_BT1 is None:
                h_BTD, row_scale_BT1 = self.normed(self.attn_norm, x_BTD, True)
            else:
                h_BTD = ax.constrain(x_BTD.astype(self.attn_norm.dtype), GATHERED)
            out_BTNH, cache = self.attn.decode_heads(h_BTD, positions_BT, local, cache, row_scale=row_scale_BT1)
            x_BTD, row_scale_BT1 = residual(x_BTD, self.attn.o.partial_sums(out_BTNH), self.mlp_norm.eps)
        with jax.named_scope("mlp"):
            h_BTF = self.mlp.hidden(ax.constrain(x_BTD.astype(self.mlp_norm.dtype), GATHERED), row_scale_BT1)
            x_BTD, row_scale_BT1 = residual(x_BTD, self.mlp.down.partial_sums(h_BTF), self.attn_norm.eps)
        return x_BTD, cache, row_scale_BT1

    @property
    def foldable(self) -> bool:
        """Whether both norms are RMSNorms feeding only products (attention's q, k, v and a dense MLP) whose
        scales follow their weights (not delayed fp8 scaling, whose kernel scales come from past steps)."""
        return (self.attn_norm.kind == "rmsnorm" and isinstance(self.attn, Attention) and hasattr(self, "mlp")
                and self.precision != "fp8_delayed")

    def fold_norms(self) -> None:
        """Each pre-norm's gain multiplied into the weights its output feeds, the norm's scale set to the identity
        (the block computes the same function). A folded block's `prefill` and `decode` then skip the norms'
        application: a product of the un-normed rows times each row's 1 / rms, which fuses into its consumer."""
        assert self.foldable
        mlp = [self.mlp.up] + ([self.mlp.gate] if hasattr(self.mlp, "gate") else [])
        for norm, linears in ((self.attn_norm, (self.attn.q, self.attn.k, self.attn.v)), (self.mlp_norm, mlp)):
            gain_D = norm.gain()
            for linear in linears:
                w = linear.kernel[...]
                linear.kernel[...] = (w.astype(jnp.float32) * gain_D.reshape(-1, *(1,) * (w.ndim - 1))).astype(w.dtype)
            norm.scale[...] = jnp.full_like(norm.scale[...], 1.0 - norm.offset)

    def fuse_projections(self) -> None:
        """Products sharing an input as one (`Attention.fuse_projections`, `MLP.fuse_projections`), for 16-bit
        products (an fp8 product's scale is the whole kernel's); the block computes the same function."""
        if self.precision != "bf16":
            return
        self.attn.fuse_projections()
        if hasattr(self, "mlp") and hasattr(self.mlp, "gate"):
            self.mlp.fuse_projections()

    def run(self, x_BSD: jax.Array, attention, folded: bool = False) -> tuple[jax.Array, dict, object]:
        """The block around `attention(h_BSD, row_scale_BS1) -> (output, extra)`; returns (output, statistics,
        extra). `folded`: norms folded (`fold_norms`), the sublayers get the un-normed rows and 1 / rms."""
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


def scaled(row_scale: jax.Array | None) -> dict:
    """The keyword of a folded block's row scale for `Attention.prefill` and `decode` (none for the others)."""
    return {} if row_scale is None else {"row_scale": row_scale}
