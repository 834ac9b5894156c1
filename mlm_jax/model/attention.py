"""Causal self-attention with GQA/MQA, RoPE, optional QK-norm and sliding windows; one kernel entry point, `attend`."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from mlm_jax.model import axes as ax
from mlm_jax.model.kernels import Kernels
from mlm_jax.model.linear import Linear
from mlm_jax.model.norm import Norm
from mlm_jax.model.rope import RopeConfig, apply_rope
from mlm_jax.ops import packed_attention, te


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
    window: int | None = None  # sliding-window layers: each query sees itself and the `window - 1` before it
    local_rope: RopeConfig | None = None  # RoPE of the sliding-window layers (Gemma 3's own base); None = `rope`
    scale: float | None = None  # softmax scale; None = 1 / sqrt(head_dim)
    norm_offset: float = 0.0  # of the QK-norms (`Norm`)


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


def attend(q_BSNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, kernels: Kernels, window: int | None = None,
           local: bool | jax.Array = True, segment_ids_BS: jax.Array | None = None) -> jax.Array:
    """Causal attention, within a sliding `window` where `local` (a traced bool in a pipeline chunk whose layers
    differ by kind from chunk to chunk), and within each token's segment where `segment_ids_BS` says (documents
    packed in a row see only themselves); K/V heads may be fewer than query heads (GQA), never repeated in memory.

    Through the layout's own attention where `kernels.attend` names one (context parallelism, which gets the sequence
    in its load-balanced order; pipeline stages), with the kernel `kernels.attention` names; every one takes
    `window`, `local` and `segment_ids`.
    """
    if local is False or window is None:
        window, local = None, True
    # the packed layout's bound travels only where the plan set one (never to context-parallel attention)
    packed = {"packed_segments": kernels.packed_segments} if kernels.packed_segments else {}
    return (kernels.attend or local_attention)(q_BSNH, k_BSKH, v_BSKH, impl=kernels.attention, window=window,
                                               local=local, segment_ids=segment_ids_BS, **packed)


def local_attention(q_BSNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, *, impl: str,
                    window: int | None = None, local: bool | jax.Array = True,
                    segment_ids: jax.Array | None = None, packed_segments: int = 0) -> jax.Array:
    """Causal attention through the kernel `impl` names (cudnn, xla or te), with no collective of its own. A
    window is cuDNN's local window on GPUs (blocks outside it are skipped), a mask in XLA; a traced `local` picks
    windowed or full attention in a `lax.cond` (inside a pipeline stage, in the kernel's fully manual region).
    `segment_ids` ([B, S]) keep segments apart: through cuDNN's packed layout for rows of up to `packed_segments`
    segments (`ops.packed_attention`), else a mask, so a query sees only the keys of its own segment."""
    if impl == "te":
        if segment_ids is not None:  # `validation.plan` refuses the run; here for a model called directly
            raise ValueError("Transformer Engine attention (model.attention_impl=te) keeps no segments apart")
        return te.attend(q_BSNH, k_BSKH, v_BSKH)

    def masked(window, q_BSNH, k_BSKH, v_BSKH, segment_ids):
        mask_B1SS = None if segment_ids is None else segment_mask(segment_ids, segment_ids)
        return jax.nn.dot_product_attention(q_BSNH, k_BSKH, v_BSKH, mask=mask_B1SS, is_causal=True,
                                            implementation=impl,
                                            local_window_size=None if window is None else (window - 1, 0))

    def kernel(window):
        if segment_ids is None or not packed_segments:
            return masked(window, q_BSNH, k_BSKH, v_BSKH, segment_ids)
        return packed_attention.attend(q_BSNH, k_BSKH, v_BSKH, segment_ids, max_segments=packed_segments,
                                       window=window, masked=functools.partial(masked, window))
    if window is None or local is True:
        return kernel(window)
    return jax.lax.cond(local, lambda: kernel(window), lambda: kernel(None))


def segment_mask(q_segment_ids_BT: jax.Array, k_segment_ids_BS: jax.Array) -> jax.Array:
    """[B, 1, T, S]: whether query t and key s are in the same segment."""
    return (q_segment_ids_BT[:, None, :, None] == k_segment_ids_BS[:, None, None, :])


class Attention(nnx.Module):
    def __init__(self, c: AttentionConfig, *, std: float, out_std: float, dtype, param_dtype, rngs: nnx.Rngs,
                 precision: str = "bf16", fp8_history: int = 16, kernels: Kernels = Kernels()):
        self.c, self.kernels = c, kernels
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs, precision=precision, fp8_history=fp8_history,
                  kernels=kernels)
        self.input_projections(c, std=std, **kw)
        self.o = Linear("bsnh,nhd->bsd", (c.num_heads, c.head_dim, c.dim), (ax.HEADS, ax.HEAD_DIM, ax.EMBED),
                        std=out_std, **kw)
        if c.qk_norm:
            nkw = dict(kind="rmsnorm", eps=c.norm_eps, dtype=dtype, param_dtype=param_dtype, offset=c.norm_offset)
            self.q_norm, self.k_norm = Norm(c.head_dim, **nkw), Norm(c.head_dim, **nkw)

    def input_projections(self, c: AttentionConfig, **kw) -> None:
        """The q, k and v products (a decode-time layer builds its own form of them, `mlm_jax.infer`)."""
        qkv = dict(bias_dims=2 if c.qkv_bias else 0, **kw)
        self.q = Linear("bsd,dnh->bsnh", (c.dim, c.num_heads, c.head_dim), (ax.EMBED, ax.HEADS, ax.HEAD_DIM), **qkv)
        self.k = Linear("bsd,dkh->bskh", (c.dim, c.kv_heads, c.head_dim), (ax.EMBED, ax.KV_HEADS, ax.HEAD_DIM),
                        **qkv)
        self.v = Linear("bsd,dkh->bskh", (c.dim, c.kv_heads, c.head_dim), (ax.EMBED, ax.KV_HEADS, ax.HEAD_DIM),
                        **qkv)

    def __call__(self, x_BSD: jax.Array, positions_BS: jax.Array, local: bool | jax.Array = False,
                 segment_ids_BS: jax.Array | None = None) -> jax.Array:
        """`local`: a sliding-window layer (its window and RoPE), or a traced bool saying so (a pipeline chunk,
        `parallel.stages.run_chunk`); `segment_ids_BS`: each token's segment (`attend`)."""
        q_BSNH, k_BSKH, v_BSKH = self.project(x_BSD, positions_BS, local)
        return self.out(attend(q_BSNH, k_BSKH, v_BSKH, self.kernels, self.c.window, local, segment_ids_BS))

    def project(self, x_BSD: jax.Array, positions_BS: jax.Array, local,
                row_scale_BS1: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries (scaled for the kernels' 1/sqrt(head_dim)), keys and values, normed and rotated; each product
        times `row_scale_BS1` (see `Linear`) if given."""
        q_BSNH, k_BSKH, v_BSKH = self.products(x_BSD, row_scale_BS1)
        return (*self.rotated(q_BSNH, k_BSKH, positions_BS, local), v_BSKH)

    def products(self, x_BSD: jax.Array, row_scale_BS1: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries, keys and values, normed (QK-norm) but not rotated."""
        scale = None if row_scale_BS1 is None else row_scale_BS1[..., None]
        q_BSNH, k_BSKH, v_BSKH = (self.q(x_BSD, row_scale=scale), self.k(x_BSD, row_scale=scale),
                                  self.v(x_BSD, row_scale=scale))
        return self.normed(q_BSNH, k_BSKH, v_BSKH)

    def normed(self, q_BSNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The products laid out by heads, queries and keys through the QK-norms where the layer has them."""
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
