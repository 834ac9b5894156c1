"""Feed-forward block: SwiGLU (Llama), GeGLU with the tanh GELU (Gemma) or GeLU (GPT-2); Megatron column (in) /
row (out) split over `mlp`."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from mlm_jax.layers import axes as ax
from mlm_jax.layers import gemv
from mlm_jax.layers.linear import Linear

GATES = {"swiglu": jax.nn.silu, "geglu": functools.partial(jax.nn.gelu, approximate=True)}  # a gated MLP's activation


class MLP(nnx.Module):
    def __init__(self, dim: int, ffn: int, *, activation: str, std: float, out_std: float, dtype, param_dtype,
                 rngs: nnx.Rngs, precision: str = "bf16", fp8_history: int = 16):
        self.activation = activation
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs, precision=precision, fp8_history=fp8_history)
        self.up = Linear("bsd,df->bsf", (dim, ffn), (ax.EMBED, ax.MLP), std=std, **kw)
        if activation in ("swiglu", "geglu"):
            self.gate = Linear("bsd,df->bsf", (dim, ffn), (ax.EMBED, ax.MLP), std=std, **kw)
        self.down = Linear("bsf,fd->bsd", (ffn, dim), (ax.MLP, ax.EMBED), std=out_std, **kw)

    def __call__(self, x_BSD: jax.Array, row_scale_BS1: jax.Array | None = None) -> jax.Array:
        """`row_scale_BS1`: the input norm's per-row factor, its gain folded into `up` and `gate`."""
        return self.down(self.hidden(x_BSD, row_scale_BS1))

    def hidden(self, x_BSD: jax.Array, row_scale_BS1: jax.Array | gemv.RowFactor | None = None) -> jax.Array:
        """The input of `down`: the activation of the up (and gate) product. A fused gate/up product goes, with its
        activation, to the kernel installed as `axes.GATED` (`layers.gemv.gated`, which finishes a residual
        kernel's `gemv.RowFactor`) where it takes it."""
        gated = ax.kernel(ax.GATED)
        if gated is not None and hasattr(self, "gate_up"):
            h_BSF = gated(x_BSD.astype(self.gate_up.dtype), self.gate_up.kernel[...].astype(self.gate_up.dtype),
                          row_scale_BS1, GATES[self.activation])
            if h_BSF is not None:
                return ax.constrain(h_BSF, (ax.ACT_BATCH, ax.ACT_SEQ, ax.ACT_MLP))
        row_scale_BS1 = gemv.factor(row_scale_BS1)
        if hasattr(self, "gate_up"):
            scale = None if row_scale_BS1 is None else row_scale_BS1[..., None]
            y_BS2F = self.gate_up(x_BSD, row_scale=scale)
            g_BSF, h_BSF = y_BS2F[..., 0, :], y_BS2F[..., 1, :]
        else:
            h_BSF = self.up(x_BSD, row_scale=row_scale_BS1)
            g_BSF = self.gate(x_BSD, row_scale=row_scale_BS1) if hasattr(self, "gate") else None
        h_BSF = GATES[self.activation](g_BSF) * h_BSF if self.activation in GATES else jax.nn.gelu(h_BSF)
        return ax.constrain(h_BSF, (ax.ACT_BATCH, ax.ACT_SEQ, ax.ACT_MLP))

    def fuse_projections(self) -> None:
        """A gated MLP's gate and up as one product `gate_up` over a [D, 2, F] kernel (a split over F keeps each
        column's pair), the same function: a decode step reads both weights in one pass."""
        kernel = jnp.stack([self.gate.kernel[...], self.up.kernel[...]], axis=1)
        self.gate_up = self.gate.refit("bsd,dcf->bscf", kernel, (ax.EMBED, None, ax.MLP))
        del self.gate, self.up
