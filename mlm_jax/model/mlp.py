"""Feed-forward block: SwiGLU (Llama), GeGLU with the tanh GELU (Gemma) or GeLU (GPT-2); Megatron column (in) /
row (out) split over `mlp`."""
from __future__ import annotations

import functools

import jax
from flax import nnx

from mlm_jax.model import axes as ax
from mlm_jax.model.kernels import Kernels
from mlm_jax.model.linear import Linear

GATES = {"swiglu": jax.nn.silu, "geglu": functools.partial(jax.nn.gelu, approximate=True)}  # a gated MLP's activation


class MLP(nnx.Module):
    def __init__(self, dim: int, ffn: int, *, activation: str, std: float, out_std: float, dtype, param_dtype,
                 rngs: nnx.Rngs, precision: str = "bf16", fp8_history: int = 16, kernels: Kernels = Kernels()):
        self.activation = activation
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs, precision=precision, fp8_history=fp8_history,
                  kernels=kernels)
        self.input_projections(dim, ffn, std=std, **kw)
        self.down = Linear("bsf,fd->bsd", (ffn, dim), (ax.MLP, ax.EMBED), std=out_std, **kw)

    def input_projections(self, dim: int, ffn: int, **kw) -> None:
        """The up (and gate) products (a decode-time layer builds its own form of them, `mlm_jax.infer`)."""
        self.up = Linear("bsd,df->bsf", (dim, ffn), (ax.EMBED, ax.MLP), **kw)
        if self.activation in GATES:
            self.gate = Linear("bsd,df->bsf", (dim, ffn), (ax.EMBED, ax.MLP), **kw)

    def __call__(self, x_BSD: jax.Array, row_scale_BS1: jax.Array | None = None) -> jax.Array:
        """`row_scale_BS1`: the input norm's per-row factor, its gain folded into `up` and `gate` (decode-time
        blocks)."""
        return self.down(self.hidden(x_BSD, row_scale_BS1))

    def hidden(self, x_BSD: jax.Array, row_scale_BS1: jax.Array | None = None) -> jax.Array:
        """The input of `down`: the activation of the up (and gate) product."""
        h_BSF = self.up(x_BSD, row_scale=row_scale_BS1)
        if self.activation in GATES:
            h_BSF = GATES[self.activation](self.gate(x_BSD, row_scale=row_scale_BS1)) * h_BSF
        else:
            h_BSF = jax.nn.gelu(h_BSF)
        return ax.constrain(h_BSF, (ax.ACT_BATCH, ax.ACT_SEQ, ax.ACT_MLP))
