"""Decode-time blocks: a trained layer in the form generation runs it, with a key/value cache (`infer.kv_cache`).

They are built from a trained model's weights (`infer.decode.layer_states`) and never touch the training modules:
each is a training layer's class with the decode methods added (`prefill` over right-padded prompts, `decode` of new
positions), and, where it can be, a different form of the same function:

- folded (`Block`s of RMSNorms feeding only products): each pre-norm's gain multiplied into the weights its output
  feeds and the norm's scale set to the identity; the sublayers then take the un-normed rows and each row's
  1 / rms, which fuses into its consumer;
- fused (16-bit products): q, k and v as one product `qkv` over a [D, K, G + 2, H] kernel (each K/V head's G query
  heads, its key, its value: a split over K/V heads keeps each group whole), gate and up as one `gate_up` over a
  [D, 2, F] kernel: a decode step reads the weights of a shared input in one pass.

The kernels they run are passed in (`model.kernels.Kernels`): the few-row products, the attention over the cache,
the residual add with the next norm's factor and the gated MLP's product (`ops.gemv`, `ops.flash_decode`) on one
GPU; XLA elsewhere.

Shapes: B batch, P prompt (padded), T new positions, C cache slots, D model, N query heads, K kv heads, G query
heads per kv head, H head dim, F ffn, R the latent.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from mlm_jax.infer import kv_cache as kv
from mlm_jax.model import axes as ax
from mlm_jax.model.attention import Attention, AttentionConfig, attend
from mlm_jax.model.block import GATHERED, Block, BlockConfig, Sublayers
from mlm_jax.model.kernels import Kernels
from mlm_jax.model.linear import Linear
from mlm_jax.model.mla import LatentAttention
from mlm_jax.model.mlp import GATES, MLP
from mlm_jax.model.rope import tables
from mlm_jax.ops import flash_decode, gemv


def foldable(c: BlockConfig) -> bool:
    """Whether a block's norms fold into its products: both RMSNorms feeding only products (attention's q, k, v and
    a dense MLP) whose scales follow their weights (not delayed fp8 scaling, whose kernel scales come from past
    steps)."""
    return (c.norm == "rmsnorm" and isinstance(c.attention, AttentionConfig) and c.moe is None
            and c.precision != "fp8_delayed")


def fusable(c: BlockConfig) -> bool:
    """Whether a foldable block's products sharing an input fuse: 16-bit products (an fp8 product's scale is the
    whole kernel's)."""
    return foldable(c) and c.precision == "bf16"


class CachedAttention(Attention):
    """`Attention` with a key/value cache; q, k and v as one product `qkv` where `fused`."""

    def __init__(self, c: AttentionConfig, *, fused: bool = False, **kw):
        self.fused = fused
        super().__init__(c, **kw)

    def input_projections(self, c: AttentionConfig, **kw) -> None:
        if not self.fused:
            return super().input_projections(c, **kw)
        D, K, G, H = c.dim, c.kv_heads, c.num_heads // c.kv_heads, c.head_dim
        self.qkv = Linear("bsd,dkjh->bskjh", (D, K, G + 2, H), (ax.EMBED, ax.KV_HEADS, None, ax.HEAD_DIM),
                          bias_dims=3 if c.qkv_bias else 0, **kw)

    def products(self, x_BSD: jax.Array, row_scale_BS1: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
        if not self.fused:
            return super().products(x_BSD, row_scale_BS1)
        scale = None if row_scale_BS1 is None else row_scale_BS1[..., None, None]
        y_BSKJH = self.qkv(x_BSD, row_scale=scale)  # J: a K/V head's G query heads, its key, its value
        G = self.c.num_heads // self.c.kv_heads
        q_BSNH = y_BSKJH[..., :G, :].reshape(*y_BSKJH.shape[:2], self.c.num_heads, self.c.head_dim)
        return self.normed(q_BSNH, y_BSKJH[..., G, :], y_BSKJH[..., G + 1, :])

    def prefill(self, x_BPD: jax.Array, positions_BP: jax.Array, local: bool, lengths_B: jax.Array,
                length: int, row_scale: jax.Array | None = None) -> tuple[jax.Array, dict]:
        """Attention over right-padded prompts of `lengths_B` tokens, as in training, and the key/value cache it
        leaves for sequences of up to `length` positions. `row_scale` ([B, P, 1]): the input norm's per-row factor,
        its gain folded into the projections."""
        q_BPNH, k_BPKH, v_BPKH = self.project(x_BPD, positions_BP, local, row_scale)
        out_BPNH = attend(q_BPNH, k_BPKH, v_BPKH, self.kernels, self.c.window, local)
        C = kv.slots(length, self.c.window if local else None)
        return self.out(out_BPNH), self._laid_out({"k": kv.fill(k_BPKH, lengths_B, C),
                                                   "v": kv.fill(v_BPKH, lengths_B, C)})

    def decode(self, x_BTD: jax.Array, positions_BT: jax.Array, local: bool, cache: dict,
               row_scale: jax.Array | None = None) -> tuple[jax.Array, dict]:
        """New positions `positions_BT`: written to the cache, then attending over it (`row_scale` as in
        `prefill`); the output and the cache."""
        out_BTNH, cache = self.decode_heads(x_BTD, positions_BT, local, cache, row_scale)
        return self.out(out_BTNH), cache

    def decode_heads(self, x_BTD: jax.Array, positions_BT: jax.Array, local: bool, cache: dict,
                     row_scale: jax.Array | gemv.RowFactor | None = None) -> tuple[jax.Array, dict]:
        """`decode` before the output projection: each head's output [B, T, N, H], and the cache. One new position
        a row goes to the kernel `Kernels.cached_attention` names (`ops.flash_decode.step`: rotation, cache writes
        and attention in one) where it takes the shapes; `row_scale` may be a residual kernel's `gemv.RowFactor`
        (finished by XLA here: inside that kernel it cost 11 us a layer, RESULTS.md)."""
        window = self.c.window if local else None
        rope = self.rope(local)
        one_row = self.kernels.cached_attention
        C = cache["k"].shape[1]
        q_shape = (*x_BTD.shape[:2], self.c.num_heads, self.c.head_dim)
        if (one_row is not None and kv.sees_every_slot(C, window)
                and flash_decode.supports(q_shape, cache["k"].shape, rope.rotary_dim)):
            # the row scale, where it is the products' last step, goes with them into the kernel
            plain = not (self.c.qk_norm or self.c.qkv_bias)
            inside = row_scale is not None and plain
            if plain and self.fused:  # the fused product, which the kernel runs and sums itself
                new = flash_decode.Product(x_BTD.astype(self.qkv.dtype), self.qkv.kernel[...].astype(self.qkv.dtype))
            else:
                new = self.products(x_BTD, None if inside else gemv.factor(row_scale))
            scale = self.c.scale if self.c.scale is not None else 1 / math.sqrt(self.c.head_dim)
            out_BTNH, k_BCKH, v_BCKH = one_row(new, *tables(positions_BT, rope), cache["k"], cache["v"],
                                               positions_BT, gemv.factor(row_scale)[..., 0] if inside else None,
                                               scale=scale)
            return self.heads(out_BTNH), self._laid_out({"k": k_BCKH, "v": v_BCKH})
        q_BTNH, k_BTKH, v_BTKH = self.products(x_BTD, gemv.factor(row_scale))
        q_BTNH, k_BTKH = self.rotated(q_BTNH, k_BTKH, positions_BT, local)
        cache = {"k": kv.write(cache["k"], k_BTKH, positions_BT), "v": kv.write(cache["v"], v_BTKH, positions_BT)}
        # a layout with its own attention (`Kernels.attend`) attends through XLA's products, which partition under
        # any layout
        impl = "xla" if self.kernels.attend else self.kernels.attention
        out_BTNH = kv.attend_cached(q_BTNH, cache["k"], cache["v"], positions_BT, window, impl)
        return self.heads(out_BTNH), self._laid_out(cache)

    @staticmethod
    def _laid_out(cache: dict) -> dict:
        return {k: ax.constrain(a, (ax.ACT_BATCH, None, ax.ACT_KV_HEADS, None)) for k, a in cache.items()}


class CachedLatentAttention(LatentAttention):
    """`LatentAttention` with a cache of the normed kv latent and the rotated shared key (`latent`, `rope`), not of
    the per-head keys and values. Never folded (`row_scale` is None)."""

    def prefill(self, x_BPD: jax.Array, positions_BP: jax.Array, local: bool, lengths_B: jax.Array,
                length: int, row_scale: None = None) -> tuple[jax.Array, dict]:
        """As `CachedAttention.prefill`."""
        c = self.c
        q_BPNH = self.query(x_BPD, positions_BP)
        latent_BPR, rope_BPE = self.latent(x_BPD, positions_BP)
        out_BPNH = attend(q_BPNH, *self.expand(latent_BPR, rope_BPE), self.kernels)[..., :c.v_dim]
        cache = {"latent": kv.fill(latent_BPR, lengths_B, length), "rope": kv.fill(rope_BPE, lengths_B, length)}
        return self.out(out_BPNH), self._laid_out(cache)

    def decode(self, x_BTD: jax.Array, positions_BT: jax.Array, local: bool, cache: dict,
               row_scale: None = None) -> tuple[jax.Array, dict]:
        """A decode step folds the key expansion into the query and the value expansion into the output
        (DeepSeek-V2's absorbed form), so it reads R + E numbers per cached position instead of N x (P + V)."""
        q_BTNH = self.query(x_BTD, positions_BT)
        latent_BTR, rope_BTE = self.latent(x_BTD, positions_BT)
        cache = {"latent": kv.write(cache["latent"], latent_BTR, positions_BT),
                 "rope": kv.write(cache["rope"], rope_BTE, positions_BT)}
        return self.out(self.absorbed(q_BTNH, cache["latent"], cache["rope"], positions_BT)), self._laid_out(cache)

    @staticmethod
    def _laid_out(cache: dict) -> dict:
        return {k: ax.constrain(a, (ax.ACT_BATCH, None, None)) for k, a in cache.items()}

    def absorbed(self, q_BTNH: jax.Array, latent_BCR: jax.Array, rope_BCE: jax.Array,
                 positions_BT: jax.Array) -> jax.Array:
        """Decode attention over the latent cache: q_nope . (W_k c) = (W_k^T q_nope) . c, and the output
        W_v (sum_j p_j c_j); the softmax in fp32."""
        c = self.c
        w_RNH = self.kv_b.kernel[...].astype(q_BTNH.dtype)
        w_k_RNP, w_v_RNV = w_RNH[..., :c.nope_dim], w_RNH[..., c.nope_dim:]
        q_BTNR = jnp.einsum("btnp,rnp->btnr", q_BTNH[..., :c.nope_dim], w_k_RNP)
        scores_BNTC = (jnp.einsum("btnr,bcr->bntc", q_BTNR, latent_BCR, preferred_element_type=jnp.float32)
                       + jnp.einsum("btne,bce->bntc", q_BTNH[..., c.nope_dim:], rope_BCE,
                                    preferred_element_type=jnp.float32))
        scores_BNTC = scores_BNTC / jnp.sqrt(jnp.float32(c.nope_dim + c.rope_dim))
        mask_B1TC = kv.visible(positions_BT, latent_BCR.shape[1], None)[:, None]
        probs_BNTC = jax.nn.softmax(jnp.where(mask_B1TC, scores_BNTC, -jnp.inf), axis=-1).astype(latent_BCR.dtype)
        return jnp.einsum("btnr,rnv->btnv", jnp.einsum("bntc,bcr->btnr", probs_BNTC, latent_BCR), w_v_RNV)


class DecodeMLP(MLP):
    """`MLP` with gate and up as one product `gate_up` where `fused`, and the gated kernel (`Kernels.gated`)."""

    def __init__(self, dim: int, ffn: int, *, activation: str, fused: bool = False, **kw):
        self.fused = fused and activation in GATES
        super().__init__(dim, ffn, activation=activation, **kw)

    def input_projections(self, dim: int, ffn: int, **kw) -> None:
        if not self.fused:
            return super().input_projections(dim, ffn, **kw)
        self.gate_up = Linear("bsd,dcf->bscf", (dim, 2, ffn), (ax.EMBED, None, ax.MLP), **kw)

    def hidden(self, x_BSD: jax.Array, row_scale_BS1: jax.Array | gemv.RowFactor | None = None) -> jax.Array:
        """The input of `down`. A fused gate/up product goes, with its activation, to the kernel `Kernels.gated`
        names (`ops.gemv.gated`, which finishes a residual kernel's `gemv.RowFactor`) where it takes it."""
        if not self.fused:
            return super().hidden(x_BSD, gemv.factor(row_scale_BS1))
        gated = self.gate_up.kernels.gated
        if gated is not None:
            h_BSF = gated(x_BSD.astype(self.gate_up.dtype), self.gate_up.kernel[...].astype(self.gate_up.dtype),
                          row_scale_BS1, GATES[self.activation])
            if h_BSF is not None:
                return ax.constrain(h_BSF, (ax.ACT_BATCH, ax.ACT_SEQ, ax.ACT_MLP))
        row_scale_BS1 = gemv.factor(row_scale_BS1)
        scale = None if row_scale_BS1 is None else row_scale_BS1[..., None]
        y_BS2F = self.gate_up(x_BSD, row_scale=scale)
        h_BSF = GATES[self.activation](y_BS2F[..., 0, :]) * y_BS2F[..., 1, :]
        return ax.constrain(h_BSF, (ax.ACT_BATCH, ax.ACT_SEQ, ax.ACT_MLP))


class DecodeBlock(Block):
    """A `Block` of decode-time sublayers; `folded`: its norms folded into its products (see the module)."""

    def __init__(self, c: BlockConfig, *, folded: bool, fused: bool, dtype, param_dtype, rngs: nnx.Rngs,
                 kernels: Kernels = Kernels()):
        sub = Sublayers(attention=functools.partial(CachedAttention, fused=fused),
                        latent_attention=CachedLatentAttention, mlp=functools.partial(DecodeMLP, fused=fused))
        super().__init__(c, dtype=dtype, param_dtype=param_dtype, rngs=rngs, kernels=kernels, sublayers=sub)
        self.foldable = folded
        self.kernels = kernels

    def prefill(self, x_BPD: jax.Array, positions_BP: jax.Array, local: bool, lengths_B: jax.Array,
                length: int) -> tuple[jax.Array, dict]:
        """The block over right-padded prompts, and its attention's key/value cache (`CachedAttention.prefill`)."""
        x_BPD, _, cache = self.run(x_BPD, lambda h, r: self.attn.prefill(h, positions_BP, local, lengths_B, length,
                                                                          row_scale=r), self.foldable)
        return x_BPD, cache

    def decode(self, x_BTD: jax.Array, positions_BT: jax.Array, local: bool, cache: dict,
               row_scale_BT1=None) -> tuple[jax.Array, dict, object]:
        """The block at new positions, with its attention's cache (`CachedAttention.decode`): its output, the
        cache, and the output's attention-norm factor where the kernel `Kernels.residual` made it (an array or a
        `gemv.RowFactor`), else None (the next block's `row_scale_BT1`, its input's factor if known: a model's
        blocks share their norms' eps)."""
        residual = self.kernels.residual
        if residual is None or not self.foldable or hasattr(self, "attn_post_norm"):
            x_BTD, _, cache = self.run(x_BTD, lambda h, r: self.attn.decode(h, positions_BT, local, cache,
                                                                            row_scale=r), self.foldable)
            return x_BTD, cache, None
        # each residual add and the next norm's factor in one kernel, which sums the product's partials itself
        with jax.named_scope("attention"):
            if row_scale_BT1 is None:
                h_BTD, row_scale_BT1 = self.normed(self.attn_norm, x_BTD, True)
            else:
                h_BTD = ax.constrain(x_BTD.astype(self.attn_norm.dtype), GATHERED)
            out_BTNH, cache = self.attn.decode_heads(h_BTD, positions_BT, local, cache, row_scale=row_scale_BT1)
            x_BTD, row_scale_BT1 = residual(x_BTD, partial_sums(self.attn.o, out_BTNH), self.mlp_norm.eps)
        with jax.named_scope("mlp"):
            h_BTF = self.mlp.hidden(ax.constrain(x_BTD.astype(self.mlp_norm.dtype), GATHERED), row_scale_BT1)
            x_BTD, row_scale_BT1 = residual(x_BTD, partial_sums(self.mlp.down, h_BTF), self.attn_norm.eps)
        return x_BTD, cache, row_scale_BT1


def partial_sums(linear: Linear, x: jax.Array) -> jax.Array:
    """`linear(x)` as partial products over slices of the contracted dims, [S, *output's shape], whose fp32 sum
    rounded to its dtype is `linear(x)`, for a consumer that sums them itself (`Kernels.residual`): from the
    few-row kernel (fp32 partials) where the layer multiplies through it, else `linear(x)` as the one partial."""
    few = linear.kernels.few_rows
    if few is None or linear.precision != "bf16" or hasattr(linear, "bias") or linear.kernels.master:
        return linear(x)[None]
    return few(linear.equation, x.astype(linear.dtype), linear.kernel[...].astype(linear.dtype), summed=False)
