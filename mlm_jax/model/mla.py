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

from mlm_jax.model import axes as ax
from mlm_jax.model.attention import attend
from mlm_jax.model.kernels import Kernels
from mlm_jax.model.linear import Linear
from mlm_jax.model.norm import Norm
from mlm_jax.model.rope import RopeConfig, apply_rope


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
    scale: float | None = None  # softmax scale; None = 1 / sqrt(nope_dim + rope_dim)


class LatentAttention(nnx.Module):
    def __init__(self, c: LatentAttentionConfig, *, std: float, out_std: float, dtype, param_dtype, rngs: nnx.Rngs,
                 precision: str = "bf16", fp8_history: int = 16, kernels: Kernels = Kernels()):
        self.c, self.kernels = c, kernels
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs, precision=precision, fp8_history=fp8_history,
                  std=std, kernels=kernels)
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

    def __call__(self, x_BSD: jax.Array, positions_BS: jax.Array, local: bool = False,
                 segment_ids_BS: jax.Array | None = None) -> jax.Array:
        q_BSNH = self.query(x_BSD, positions_BS)
        k_BSNH, v_BSNH = self.expand(*self.latent(x_BSD, positions_BS))
        return self.out(attend(q_BSNH, k_BSNH, v_BSNH, self.kernels, segment_ids_BS=segment_ids_BS)[..., :self.c.v_dim])

    def out(self, out_BSNV: jax.Array) -> jax.Array:
        return self.o(ax.constrain(out_BSNV, (ax.ACT_BATCH, ax.ACT_SEQ, ax.ACT_HEADS, None)))

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
