"""Multi-head latent attention (DeepSeek-V2/V3): queries and keys/values through low-rank latents.

Shapes: B batch, S sequence, D model, N heads, R the kv latent (`kv_lora_rank`), Q the query latent
(`q_lora_rank`), P the per-head dims without position (`qk_nope_dim`), E the decoupled RoPE dims (`qk_rope_dim`),
V the value dims.

The query is x -> (Q, normed) -> N x (P + E), or one projection without a latent. The keys and values come from one
projection to R + E: the R part is normed and expanded per head to N x (P + V); the E part is one RoPE key shared by
every head (the decoupled key). Each head's query and key are [no-position part, rotated part]. Under tensor
parallelism the per-head expansions and the output split over heads (Megatron's column/row split); the latent
projections are small and stay whole on every tensor rank.

Attention kernels take one head dim for q, k and v, so values narrower than the query/key dim are zero-padded to it
and the padding cut from the output.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from mlm_jax.layers import axes as ax
from mlm_jax.layers import kv_cache as kv
from mlm_jax.layers.attention import attend
from mlm_jax.layers.linear import Linear
from mlm_jax.layers.norm import Norm
from mlm_jax.layers.rope import RopeConfig, apply_rope


@dataclass(frozen=True)
class LatentAttentionConfig:
    dim: int
    num_heads: int
    kv_rank: int
    q_rank: int | None  # None: the query is one projection
    nope_dim: int
    rope_dim: int
    v_dim: int
    rope: RopeConfig  # over the `rope_dim` dims
    norm_eps: float  # of the latents' norms
    impl: str
    scale: float | None = None  # softmax scale; None = 1 / sqrt(nope_dim + rope_dim)


class LatentAttention(nnx.Module):
    def __init__(self, c: LatentAttentionConfig, *, std: float, out_std: float, dtype, param_dtype, rngs: nnx.Rngs,
                 precision: str = "bf16", fp8_history: int = 16):
        self.c = c
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs, precision=precision, fp8_history=fp8_history,
                  std=std)
        nkw = dict(kind="rmsnorm", eps=c.norm_eps, dtype=dtype, param_dtype=param_dtype)
        N, qk = c.num_heads, c.nope_dim + c.rope_dim
        if c.q_rank is None:
            self.q = Linear("bsd,dnh->bsnh", (c.dim, N, qk), (ax.EMBED, ax.HEADS, ax.HEAD_DIM), **kw)
        else:
            self.q_a = Linear("bsd,dr->bsr", (c.dim, c.q_rank), (ax.EMBED, None), **kw)
            self.q_a_norm = Norm(c.q_rank, **nkw)
            self.q_b = Linear("bsr,rnh->bsnh", (c.q_rank, N, qk), (None, ax.HEADS, ax.HEAD_DIM), **kw)
        self.kv_a = Linear("bsd,dr->bsr", (c.dim, c.kv_rank + c.rope_dim), (ax.EMBED, None), **kw)
        self.kv_a_norm = Norm(c.kv_rank, **nkw)
        self.kv_b = Linear("bsr,rnh->bsnh", (c.kv_rank, N, c.nope_dim + c.v_dim), (None, ax.HEADS, ax.HEAD_DIM), **kw)
        self.o = Linear("bsnh,nhd->bsd", (N, c.v_dim, c.dim), (ax.HEADS, ax.HEAD_DIM, ax.EMBED),
                        **{**kw, "std": out_std})

    def __call__(self, x_BSD: jax.Array, positions_BS: jax.Array, local: bool = False) -> jax.Array:
        q_BSNH = self.query(x_BSD, positions_BS)
        k_BSNH, v_BSNH = self.expand(*self.latent(x_BSD, positions_BS))
        return self.out(attend(q_BSNH, k_BSNH, v_BSNH, self.c.impl)[..., :self.c.v_dim])

    def prefill(self, x_BPD: jax.Array, positions_BP: jax.Array, local: bool, lengths_B: jax.Array,
                length: int) -> tuple[jax.Array, dict]:
        """As `Attention.prefill`, with a cache of the normed kv latent and the rotated shared key (`latent`,
        `rope`), not of the per-head keys and values."""
        c = self.c
        q_BPNH = self.query(x_BPD, positions_BP)
        latent_BPR, rope_BPE = self.latent(x_BPD, positions_BP)
        out_BPNH = attend(q_BPNH, *self.expand(latent_BPR, rope_BPE), c.impl)[..., :c.v_dim]
        cache = {"latent": kv.fill(latent_BPR, lengths_B, length), "rope": kv.fill(rope_BPE, lengths_B, length)}
        return self.out(out_BPNH), self._laid_out(cache)

    def decode(self, x_BTD: jax.Array, positions_BT: jax.Array, local: bool, cache: dict) -> tuple[jax.Array, dict]:
        """A decode step folds the key expansion into the query and the value expansion into the output
        (DeepSeek-V2's absorbed form), so it reads R + E numbers per cached position instead of N x (P + V)."""
        q_BTNH = self.query(x_BTD, positions_BT)
        latent_BTR, rope_BTE = self.latent(x_BTD, positions_BT)
        cache = {"latent": kv.write(cache["latent"], latent_BTR, positions_BT),
                 "rope": kv.write(cache["rope"], rope_BTE, positions_BT)}
        return self.out(self.absorbed(q_BTNH, cache["latent"], cache["rope"], positions_BT)), self._laid_out(cache)

    def out(self, out_BSNV: jax.Array) -> jax.Array:
        return self.o(ax.constrain(out_BSNV, (ax.ACT_BATCH, ax.ACT_SEQ, ax.ACT_HEADS, None)))

    @staticmethod
    def _laid_out(cache: dict) -> dict:
        return {k: ax.constrain(a, (ax.ACT_BATCH, None, None)) for k, a in cache.items()}

    def query(self, x_BSD: jax.Array, positions_BS: jax.Array) -> jax.Array:
        """Each head's [no-position part, rotated part], scaled for the kernels' 1/sqrt(P + E)."""
        c = self.c
        if c.q_rank is None:
            q_BSNH = self.q(x_BSD)
        else:
            q_BSNH = self.q_b(self.q_a_norm(ax.constrain(self.q_a(x_BSD), (ax.ACT_BATCH, ax.ACT_SEQ, None))))
        q_BSNH = ax.constrain(q_BSNH, (ax.ACT_BATCH, ax.ACT_SEQ, ax.ACT_HEADS, None))
        q_BSNH = jnp.concatenate([q_BSNH[..., :c.nope_dim],
                                  apply_rope(q_BSNH[..., c.nope_dim:], positions_BS, c.rope)], axis=-1)
        if c.scale is not None:  # every kernel divides by sqrt(head dim)
            q_BSNH = q_BSNH * jnp.asarray(c.scale * math.sqrt(c.nope_dim + c.rope_dim), q_BSNH.dtype)
        return ax.constrain(q_BSNH, (ax.ACT_BATCH, ax.ACT_SEQ, ax.ACT_HEADS, None))

    def latent(self, x_BSD: jax.Array, positions_BS: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The normed kv latent and the rotated key every head shares."""
        c = self.c
        kv_BSR = ax.constrain(self.kv_a(x_BSD), (ax.ACT_BATCH, ax.ACT_SEQ, None))
        rope_BSE = apply_rope(kv_BSR[..., None, c.kv_rank:], positions_BS, c.rope)[..., 0, :]
        return self.kv_a_norm(kv_BSR[..., :c.kv_rank]), rope_BSE

    def expand(self, latent_BSR: jax.Array, rope_BSE: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Per-head keys and values (the values zero-padded to the key width) from the latent and shared key."""
        c = self.c
        kv_BSNH = ax.constrain(self.kv_b(latent_BSR), (ax.ACT_BATCH, ax.ACT_SEQ, ax.ACT_HEADS, None))
        k_nope_BSNP, v_BSNV = kv_BSNH[..., :c.nope_dim], kv_BSNH[..., c.nope_dim:]
        k_BSNH = jnp.concatenate([k_nope_BSNP, jnp.broadcast_to(rope_BSE[..., None, :],
                                                                (*k_nope_BSNP.shape[:3], c.rope_dim))], axis=-1)
        pad = c.nope_dim + c.rope_dim - c.v_dim
        v_BSNH = jnp.pad(v_BSNV, ((0, 0), (0, 0), (0, 0), (0, pad))) if pad > 0 else v_BSNV
        heads = (ax.ACT_BATCH, ax.ACT_SEQ, ax.ACT_HEADS, None)
        return ax.constrain(k_BSNH, heads), ax.constrain(v_BSNH, heads)

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
