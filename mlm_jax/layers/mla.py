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
                 precision: str = "bf16"):
        self.c = c
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs, precision=precision, std=std)
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
        c = self.c
        heads = (ax.ACT_BATCH, ax.ACT_SEQ, ax.ACT_HEADS, None)
        latent = (ax.ACT_BATCH, ax.ACT_SEQ, None)
        if c.q_rank is None:
            q_BSNH = self.q(x_BSD)
        else:
            q_BSNH = self.q_b(self.q_a_norm(ax.constrain(self.q_a(x_BSD), latent)))
        q_BSNH = ax.constrain(q_BSNH, heads)
        kv_BSR = ax.constrain(self.kv_a(x_BSD), latent)
        k_rope_BS1E = apply_rope(kv_BSR[..., None, c.kv_rank:], positions_BS, c.rope)
        kv_BSNH = ax.constrain(self.kv_b(self.kv_a_norm(kv_BSR[..., :c.kv_rank])), heads)
        k_nope_BSNP, v_BSNV = kv_BSNH[..., :c.nope_dim], kv_BSNH[..., c.nope_dim:]
        q_BSNH = jnp.concatenate([q_BSNH[..., :c.nope_dim],
                                  apply_rope(q_BSNH[..., c.nope_dim:], positions_BS, c.rope)], axis=-1)
        k_BSNH = jnp.concatenate([k_nope_BSNP, jnp.broadcast_to(k_rope_BS1E, (*k_nope_BSNP.shape[:3], c.rope_dim))],
                                 axis=-1)
        qk = c.nope_dim + c.rope_dim
        if c.scale is not None:  # every kernel divides by sqrt(head dim)
            q_BSNH = q_BSNH * jnp.asarray(c.scale * math.sqrt(qk), q_BSNH.dtype)
        pad = qk - c.v_dim
        v_BSNH = jnp.pad(v_BSNV, ((0, 0), (0, 0), (0, 0), (0, pad))) if pad > 0 else v_BSNV
        out_BSNH = attend(ax.constrain(q_BSNH, heads), ax.constrain(k_BSNH, heads), ax.constrain(v_BSNH, heads),
                          c.impl)
        return self.o(ax.constrain(out_BSNH[..., :c.v_dim], heads))
