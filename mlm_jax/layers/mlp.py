"""Feed-forward block: SwiGLU (Llama), GeGLU with the tanh GELU (Gemma) or GeLU (GPT-2); Megatron column (in) /
row (out) split over `mlp`."""
from __future__ import annotations

import jax
from flax import nnx

from mlm_jax.layers import axes as ax
from mlm_jax.layers.linear import Linear


class MLP(nnx.Module):
    def __init__(self, dim: int, ffn: int, *, activation: str, std: float, out_std: float, dtype, param_dtype,
                 rngs: nnx.Rngs, precision: str = "bf16"):
        self.activation = activation
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs, precision=precision)
        self.up = Linear("bsd,df->bsf", (dim, ffn), (ax.EMBED, ax.MLP), std=std, **kw)
        if activation in ("swiglu", "geglu"):
            self.gate = Linear("bsd,df->bsf", (dim, ffn), (ax.EMBED, ax.MLP), std=std, **kw)
        self.down = Linear("bsf,fd->bsd", (ffn, dim), (ax.MLP, ax.EMBED), std=out_std, **kw)

    def __call__(self, x_BSD: jax.Array, row_scale_BS1: jax.Array | None = None) -> jax.Array:
        """`row_scale_BS1`: the input norm's per-row factor, its gain folded into `up` and `gate`."""
        h_BSF = self.up(x_BSD, row_scale=row_scale_BS1)
        if self.activation == "swiglu":
            h_BSF = jax.nn.silu(self.gate(x_BSD, row_scale=row_scale_BS1)) * h_BSF
        elif self.activation == "geglu":
            h_BSF = jax.nn.gelu(self.gate(x_BSD, row_scale=row_scale_BS1), approximate=True) * h_BSF
        else:
            h_BSF = jax.nn.gelu(h_BSF)
        h_BSF = ax.constrain(h_BSF, (ax.ACT_BATCH, ax.ACT_SEQ, ax.ACT_MLP))
        return self.down(h_BSF)
