"""Causal self-attention with GQA/MQA, RoPE, optional QK-norm and sliding windows; one kernel entry point, `attend`."""
from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from mlm_jax.layers import axes as ax
from mlm_jax.layers import flash_decode, gemv
from mlm_jax.layers import kv_cache as kv
from mlm_jax.layers.linear import Linear
from mlm_jax.layers.norm import Norm
from mlm_jax.layers.rope import RopeConfig, apply_rope, tables


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


def attend(q_BSNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, impl: str, window: int | None = None,
           local: bool | jax.Array = True) -> jax.Array:
    """Causal attention, within a sliding `window` where `local` (a traced bool in a pipeline chunk whose layers
    differ by kind from chunk to chunk); K/V heads may be fewer than query heads (GQA), never repeated in memory.

    Under context parallelism the trainer installs its own kernel (`axes.ATTENTION`), which gets the sequence in
    its load-balanced order and the kernel this one would have used; every kernel takes `window` and `local`.
    """
    if local is False or window is None:
        window, local = None, True
    kernel = ax.kernel(ax.ATTENTION) or local_attention
    return kernel(q_BSNH, k_BSKH, v_BSKH, impl=kernel_for(impl, q_BSNH.dtype), window=window, local=local)


def local_attention(q_BSNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, *, impl: str,
                    window: int | None = None, local: bool | jax.Array = True) -> jax.Array:
    """Causal attention through the kernel `impl` names (cudnn, xla or te), with no collective of its own. A
    window is cuDNN's local window on GPUs (blocks outside it are skipped), a mask in XLA; a traced `local` picks
    windowed or full attention in a `lax.cond` (inside a pipeline stage, in the kernel's fully manual region)."""
    if impl == "te":
        from mlm_jax.layers import te  # optional backend, imported only when chosen
        return te.attend(q_BSNH, k_BSKH, v_BSKH)

    def kernel(window):
        return jax.nn.dot_product_attention(q_BSNH, k_BSKH, v_BSKH, is_causal=True, implementation=impl,
                                            local_window_size=None if window is None else (window - 1, 0))
    if window is None or local is True:
        return kernel(window)
    return jax.lax.cond(local, lambda: kernel(window), lambda: kernel(None))


class Attention(nnx.Module):
    def __init__(self, c: AttentionConfig, *, std: float, out_std: float, dtype, param_dtype, rngs: nnx.Rngs,
                 precision: str = "bf16", fp8_history: int = 16):
        self.c = c
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs, precision=precision, fp8_history=fp8_history)
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

    def __call__(self, x_BSD: jax.Array, positions_BS: jax.Array, local: bool | jax.Array = False) -> jax.Array:
        """`local`: a sliding-window layer (its window and RoPE), or a traced bool saying so (a pipeline chunk,
        `Transformer.run_chunk`)."""
        q_BSNH, k_BSKH, v_BSKH = self.project(x_BSD, positions_BS, local)
        return self.out(attend(q_BSNH, k_BSKH, v_BSKH, self.c.impl, self.c.window, local))

    def prefill(self, x_BPD: jax.Array, positions_BP: jax.Array, local: bool, lengths_B: jax.Array,
                length: int, row_scale: jax.Array | None = None) -> tuple[jax.Array, dict]:
        """Attention over right-padded prompts of `lengths_B` tokens, as in training, and the key/value cache
        (`layers.kv_cache`) it leaves for sequences of up to `length` positions. `row_scale` ([B, P, 1]): the
        input norm's per-row factor, its gain folded into the projections (`project`)."""
        q_BPNH, k_BPKH, v_BPKH = self.project(x_BPD, positions_BP, local, row_scale)
        out_BPNH = attend(q_BPNH, k_BPKH, v_BPKH, self.c.impl, self.c.window, local)
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
        a row goes to the kernel installed as `axes.CACHED_ATTENTION` (`layers.flash_decode.step`: rotation, cache
        writes and attention in one) where it takes the shapes; `row_scale` may be a residual kernel's
        `gemv.RowFactor` (finished by XLA here: inside that kernel it cost 11 us a layer, RESULTS.md)."""
        window = self.c.window if local else None
        rope = self.rope(local)
        one_row = ax.kernel(ax.CACHED_ATTENTION)
        C = cache["k"].shape[1]
        q_shape = (*x_BTD.shape[:2], self.c.num_heads, self.c.head_dim)
        if (one_row is not None and kv.sees_every_slot(C, window)
                and flash_decode.supports(q_shape, cache["k"].shape, rope.rotary_dim)):
            # the row scale, where it is the products' last step, goes with them into the kernel
            plain = not (self.c.qk_norm or self.c.qkv_bias)
            inside = row_scale is not None and plain
            if plain and hasattr(self, "qkv"):  # the fused product, which the kernel runs and sums itself
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
        # a layout that replaces the attention kernel (`axes.ATTENTION`) attends through XLA's products, which
        # partition under any layout
        impl = "xla" if ax.kernel(ax.ATTENTION) else kernel_for(self.c.impl, q_BTNH.dtype)
        out_BTNH = kv.attend_cached(q_BTNH, cache["k"], cache["v"], positions_BT, window, impl)
        return self.heads(out_BTNH), self._laid_out(cache)

    @staticmethod
    def _laid_out(cache: dict) -> dict:
        return {k: ax.constrain(a, (ax.ACT_BATCH, None, ax.ACT_KV_HEADS, None)) for k, a in cache.items()}

    def project(self, x_BSD: jax.Array, positions_BS: jax.Array, local,
                row_scale_BS1: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries (scaled for the kernels' 1/sqrt(head_dim)), keys and values, normed and rotated; each product
        times `row_scale_BS1` (see `Linear`) if given."""
        q_BSNH, k_BSKH, v_BSKH = self.products(x_BSD, row_scale_BS1)
        return (*self.rotated(q_BSNH, k_BSKH, positions_BS, local), v_BSKH)

    def products(self, x_BSD: jax.Array, row_scale_BS1: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries, keys and values, normed (QK-norm) but not rotated."""
        if hasattr(self, "qkv"):
            scale = None if row_scale_BS1 is None else row_scale_BS1[..., None, None]
            y_BSKJH = self.qkv(x_BSD, row_scale=scale)  # J: a K/V head's G query heads, its key, its value
            G = self.c.num_heads // self.c.kv_heads
            q_BSNH = y_BSKJH[..., :G, :].reshape(*y_BSKJH.shape[:2], self.c.num_heads, self.c.head_dim)
            k_BSKH, v_BSKH = y_BSKJH[..., G, :], y_BSKJH[..., G + 1, :]
        else:
            scale = None if row_scale_BS1 is None else row_scale_BS1[..., None]
            q_BSNH, k_BSKH, v_BSKH = (self.q(x_BSD, row_scale=scale), self.k(x_BSD, row_scale=scale),
                                      self.v(x_BSD, row_scale=scale))
        q_BSNH = ax.constrain(q_BSNH, (ax.ACT_BATCH, ax.ACT_SEQ, ax.ACT_HEADS, None))
        k_BSKH = ax.constrain(k_BSKH, (ax.ACT_BATCH, ax.ACT_SEQ, ax.ACT_KV_HEADS, None))
        v_BSKH = ax.constrain(v_BSKH, (ax.ACT_BATCH, ax.ACT_SEQ, ax.ACT_KV_HEADS, None))
        if self.c.qk_norm:
            q_BSNH, k_BSKH = self.q_norm(q_BSNH), self.k_norm(k_BSKH)
        return q_BSNH, k_BSKH, v_BSKH

    def rotated(self, q_BSNH: jax.Array, k_BSKH: jax.Array, positions_BS: jax.Array,
                local) -> tuple[jax.Array, jax.Array]:
        """Queries and keys rotated, the queries scaled for the kernels' 1/sqrt(head_dim)."""
        q_BSNH, k_BSKH = self.rotate(q_BSNH, positions_BS, local), self.rotate(k_BSKH, positions_BS, local)
        if self.c.scale is not None:  # every kernel divides by sqrt(head_dim)
            q_BSNH = q_BSNH * jnp.asarray(self.c.scale * math.sqrt(self.c.head_dim), q_BSNH.dtype)
        return q_BSNH, k_BSKH

    def fuse_projections(self) -> None:
        """q, k and v as one product `qkv` over a [D, K, G + 2, H] kernel (each K/V head's G query heads, its key,
        its value: a split over K/V heads keeps each group whole), the same function: a decode step reads the
        three weights in one pass."""
        c = self.c
        D, K, G, H = c.dim, c.kv_heads, c.num_heads // c.kv_heads, c.head_dim
        parts = (self.q.kernel[...].reshape(D, K, G, H), self.k.kernel[...][:, :, None], self.v.kernel[...][:, :, None])
        bias = None
        if c.qkv_bias:
            bias = jnp.concatenate([self.q.bias[...].reshape(K, G, H), self.k.bias[...][:, None],
                                    self.v.bias[...][:, None]], axis=1)
        self.qkv = self.q.refit("bsd,dkjh->bskjh", jnp.concatenate(parts, axis=2),
                                (ax.EMBED, ax.KV_HEADS, None, ax.HEAD_DIM), bias)
        del self.q, self.k, self.v

    def out(self, out_BSNH: jax.Array) -> jax.Array:
        return self.o(self.heads(out_BSNH))

    @staticmethod
    def heads(out_BSNH: jax.Array) -> jax.Array:
        return ax.constrain(out_BSNH, (ax.ACT_BATCH, ax.ACT_SEQ, ax.ACT_HEADS, None))

    def rope(self, local: bool) -> RopeConfig:
        """The RoPE of a sliding-window layer (its own base, where it has one) or of a full one."""
        return (self.c.local_rope or self.c.rope) if local is True else self.c.rope

    def rotate(self, x_BSNH: jax.Array, positions_BS: jax.Array, local: bool | jax.Array) -> jax.Array:
        """RoPE of a local or full layer (`rope`); both, then a select, for a traced `local`."""
        local_rope = self.c.local_rope or self.c.rope
        if isinstance(local, bool) or local_rope == self.c.rope:
            return apply_rope(x_BSNH, positions_BS, self.rope(local))
        return jnp.where(local, apply_rope(x_BSNH, positions_BS, local_rope), apply_rope(x_BSNH, positions_BS,
                                                                                        self.c.rope))
