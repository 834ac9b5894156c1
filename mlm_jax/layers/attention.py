"""Causal self-attention with GQA/MQA, RoPE, optional QK-norm and sliding windows; one kernel entry point, `attend`."""
from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from mlm_jax.layers import axes as ax
from mlm_jax.layers.linear import Linear
from mlm_jax.layers.norm import Norm
from mlm_jax.layers.rope import RopeConfig, apply_rope


@dataclass(frozen=True)
class AttentionConfig:
    dim: int
    num_heads: int
    kv_heads: int
    head_dim: int
    rope: RopeConfig
    qk_norm: bool
    qkv_bias: bool
    norm_eps: float
    impl: str  # auto | cudnn | xla | te
    window: int | None = None  # sliding-window layers: each query sees itself and the `window - 1` before it
    local_rope: RopeConfig | None = None  # RoPE of the sliding-window layers (Gemma 3's own base); None = `rope`
    scale: float | None = None  # softmax scale; None = 1 / sqrt(head_dim)
    norm_offset: float = 0.0  # of the QK-norms (`Norm`)


def kernel_for(impl: str, dtype, platform: str | None = None) -> str:
    """'auto' takes cuDNN flash attention on GPUs for 16-bit inputs and XLA's fused softmax elsewhere."""
    if impl != "auto":
        return impl
    on_gpu = (platform or jax.default_backend()) == "gpu"
    return "cudnn" if on_gpu and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) else "xla"


def unavailable(kernel: str, dtype, platform: str) -> str | None:
    """Why `kernel` cannot run `dtype` inputs on `platform` devices, or None (asked by `mlm_jax.validation`)."""
    if kernel == "cudnn" and platform != "gpu":
        return f"cuDNN attention needs an NVIDIA GPU, and this run has {platform} devices; use auto or xla"
    if kernel == "cudnn" and jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
        return f"cuDNN attention needs bfloat16 or float16 inputs (model.dtype), not {dtype}; use auto or xla"
    if kernel == "xla" and platform == "cpu" and jnp.dtype(dtype) == jnp.float16:
        return ("XLA's CPU backend has no float16 matmul with float32 accumulation, which attention needs; "
                "use bfloat16 or float32 on CPUs")
    return None


def attend(q_BSNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, impl: str, window: int | None = None) -> jax.Array:
    """Causal attention, within a sliding `window` if given; K/V heads may be fewer than query heads (GQA), never
    repeated in memory.

    Under context parallelism the trainer installs its own kernel (`axes.ATTENTION`), which gets the sequence in
    its load-balanced order and the kernel this one would have used.
    """
    if (replacement := ax.kernel(ax.ATTENTION)) is not None:
        return replacement(q_BSNH, k_BSKH, v_BSKH, impl=kernel_for(impl, q_BSNH.dtype), window=window)
    return local_attention(q_BSNH, k_BSKH, v_BSKH, impl=kernel_for(impl, q_BSNH.dtype), window=window)


def local_attention(q_BSNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, *, impl: str,
                    window: int | None = None) -> jax.Array:
    """Causal attention through the kernel `impl` names (cudnn, xla or te), with no collective of its own. A
    window is cuDNN's local window on GPUs (blocks outside it are skipped), a mask in XLA."""
    if impl == "te":
        from mlm_jax.layers import te  # optional backend, imported only when chosen
        return te.attend(q_BSNH, k_BSKH, v_BSKH)
    return jax.nn.dot_product_attention(q_BSNH, k_BSKH, v_BSKH, is_causal=True, implementation=impl,
                                        local_window_size=None if window is None else (window - 1, 0))


class Attention(nnx.Module):
    def __init__(self, c: AttentionConfig, *, std: float, out_std: float, dtype, param_dtype, rngs: nnx.Rngs,
                 precision: str = "bf16"):
        self.c = c
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs, precision=precision)
        qkv = dict(std=std, bias_dims=2 if c.qkv_bias else 0, **kw)
        self.q = Linear("bsd,dnh->bsnh", (c.dim, c.num_heads, c.head_dim), (ax.EMBED, ax.HEADS, ax.HEAD_DIM), **qkv)
        self.k = Linear("bsd,dkh->bskh", (c.dim, c.kv_heads, c.head_dim), (ax.EMBED, ax.KV_HEADS, ax.HEAD_DIM),
                        **qkv)
        self.v = Linear("bsd,dkh->bskh", (c.dim, c.kv_heads, c.head_dim), (ax.EMBED, ax.KV_HEADS, ax.HEAD_DIM),
                        **qkv)
        self.o = Linear("bsnh,nhd->bsd", (c.num_heads, c.head_dim, c.dim), (ax.HEADS, ax.HEAD_DIM, ax.EMBED),
                        std=out_std, **kw)
        if c.qk_norm:
            nkw = dict(kind="rmsnorm", eps=c.norm_eps, dtype=dtype, param_dtype=param_dtype, offset=c.norm_offset)
            self.q_norm, self.k_norm = Norm(c.head_dim, **nkw), Norm(c.head_dim, **nkw)

    def __call__(self, x_BSD: jax.Array, positions_BS: jax.Array, local: bool = False) -> jax.Array:
        """`local`: a sliding-window layer (its window and RoPE)."""
        rope = (self.c.local_rope or self.c.rope) if local else self.c.rope
        q_BSNH = ax.constrain(self.q(x_BSD), (ax.ACT_BATCH, ax.ACT_SEQ, ax.ACT_HEADS, None))
        k_BSKH = ax.constrain(self.k(x_BSD), (ax.ACT_BATCH, ax.ACT_SEQ, ax.ACT_KV_HEADS, None))
        v_BSKH = ax.constrain(self.v(x_BSD), (ax.ACT_BATCH, ax.ACT_SEQ, ax.ACT_KV_HEADS, None))
        if self.c.qk_norm:
            q_BSNH, k_BSKH = self.q_norm(q_BSNH), self.k_norm(k_BSKH)
        q_BSNH = apply_rope(q_BSNH, positions_BS, rope)
        k_BSKH = apply_rope(k_BSKH, positions_BS, rope)
        if self.c.scale is not None:  # every kernel divides by sqrt(head_dim)
            q_BSNH = q_BSNH * jnp.asarray(self.c.scale * math.sqrt(self.c.head_dim), q_BSNH.dtype)
        out_BSNH = attend(q_BSNH, k_BSKH, v_BSKH, self.c.impl, self.c.window if local else None)
        out_BSNH = ax.constrain(out_BSNH, (ax.ACT_BATCH, ax.ACT_SEQ, ax.ACT_HEADS, None))
        return self.o(out_BSNH)
