"""FP8 matmuls through XLA (Hopper): e4m3 operands forward, e5m2 gradients backward, current scaling.

Each operand is scaled by its own max magnitude (taken this step, so no amax history lives in the train state),
cast to fp8 and fed to an fp8 `dot_general` that accumulates in fp32 and returns `dtype` (fp32 for float16, whose
range the unscaled product overflows); the product is then multiplied by the two scales. XLA lowers fp8 dots to
cuBLASLt fp8 GEMMs on Hopper and emulates them elsewhere, so CPU tests check the numerics of the same program.
The backward pass keeps the fp8 copies of the inputs as residuals (half the memory of bf16) and quantizes the
incoming gradient to e5m2, which has the range gradients need.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def quantize(x: jax.Array, fp8_dtype) -> tuple[jax.Array, jax.Array]:
    """(x / scale as fp8, scale) with scale = max|x| / fp8 max, so the largest value lands on the fp8 max."""
    fp8_max = float(jnp.finfo(fp8_dtype).max)
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    scale = jax.lax.stop_gradient(jnp.where(amax > 0, amax / fp8_max, 1.0))
    # Clipped because e4m3fn has no infinity: a value rounded past the max would become NaN.
    return jnp.clip(x.astype(jnp.float32) / scale, -fp8_max, fp8_max).astype(fp8_dtype), scale


def operands(equation: str) -> tuple[str, str, str]:
    """'bsd,df->bsf' -> ('bsd', 'df', 'bsf')."""
    inputs, out = equation.replace(" ", "").split("->")
    x, w = inputs.split(",")
    return x, w, out


def _dot(equation: str, a, b, scale, dtype) -> jax.Array:
    """The fp8 product times `scale`, in `dtype`.

    The unscaled product reaches (fp8 max)^2 * contraction size (448^2 * 2048 = 4e8), past float16's 65504, so a
    float16 product comes out of the dot in fp32 and is scaled there. bfloat16 has fp32's range and stays the
    dot's output type: on an H200 XLA fuses the scale into the cuBLASLt fp8 GEMM with either output, but an fp32
    one doubles what the GEMM writes and adds a cast pass (8192x2048x8192: 306 us with bf16 out, 408 with fp32).
    """
    out = jnp.float32 if dtype == jnp.float16 else dtype
    return (jnp.einsum(equation, a, b, preferred_element_type=out) * scale.astype(out)).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def fp8_einsum(equation: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """`einsum(equation, x, w)` for x and w of one dtype (also the output's), every index in two of (x, w, out)."""
    return _forward(equation, x, w)[0]


def _forward(equation, x, w):
    xq, sx = quantize(x, E4M3)
    wq, sw = quantize(w, E4M3)
    return _dot(equation, xq, wq, sx * sw, x.dtype), (xq, sx, wq, sw)


def _backward(equation, residuals, g):
    xq, sx, wq, sw = residuals
    x, w, out = operands(equation)
    gq, sg = quantize(g, E5M2)
    dx = _dot(f"{out},{w}->{x}", gq, wq, sg * sw, g.dtype)
    dw = _dot(f"{x},{out}->{w}", xq, gq, sx * sg, g.dtype)
    return dx, dw


fp8_einsum.defvjp(_forward, _backward)
