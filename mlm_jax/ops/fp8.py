"""FP8 matmuls through XLA (Hopper): e4m3 operands forward, e5m2 gradients backward, current scaling.

Each operand is scaled by its own max magnitude (taken this step, so no amax history lives in the train state),
cast to fp8 and fed to an fp8 `dot_general` that accumulates in fp32 and returns `dtype` (fp32 for float16, whose
range the unscaled product overflows); the product is then multiplied by the two scales. XLA lowers fp8 dots to
cuBLASLt fp8 GEMMs on Hopper and emulates them elsewhere, so CPU tests check the numerics of the same program.
The backward pass keeps the fp8 copies of the inputs as residuals (half the memory of bf16) and quantizes the
incoming gradient to e5m2, which has the range gradients need.

Delayed scaling (`delayed_einsum`, `model.precision=fp8_delayed`, Transformer Engine's default recipe) scales each
operand by the largest max magnitude in its history of the last steps' maxima instead: the scale is known before
the operand is, so the cast to fp8 fuses into whatever produces the operand, and this step's max magnitude (for
the history) is a reduction XLA can fuse beside it, not a pass that must finish before the cast can start. The
history is a weight of the layer (`HISTORY`, [3, length]: input, kernel, output gradient) whose gradient is the
history rolled by one step with this step's maxima in front: the trainer writes it in place of an optimizer
update (`is_history`), taking the max over microbatches.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


HISTORY = "amax_history"  # the leaf name of a delayed-scaling layer's history of max magnitudes


def quantize(x: jax.Array, fp8_dtype) -> tuple[jax.Array, jax.Array]:
    """(x / scale as fp8, scale) with scale = max|x| / fp8 max, so the largest value lands on the fp8 max."""
    scale = jax.lax.stop_gradient(scale_for(amax(x), fp8_dtype))
    return cast(x, scale, fp8_dtype), scale


def amax(x: jax.Array) -> jax.Array:
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


def scale_for(amax: jax.Array, fp8_dtype) -> jax.Array:
    """The scale that maps `amax` onto the fp8 max (1 for a zero or non-finite max: nothing to go by)."""
    return jnp.where((amax > 0) & jnp.isfinite(amax), amax / float(jnp.finfo(fp8_dtype).max), 1.0)


def cast(x: jax.Array, scale: jax.Array, fp8_dtype) -> jax.Array:
    """x / scale in fp8, clipped because e4m3fn has no infinity: a value rounded past the max would become NaN."""
    fp8_max = float(jnp.finfo(fp8_dtype).max)
    return jnp.clip(x.astype(jnp.float32) / scale, -fp8_max, fp8_max).astype(fp8_dtype)


def is_history(path) -> bool:
    """Whether a parameter tree's leaf at `path` (a `jax.tree_util` key path) is a delayed-scaling history."""
    return bool(path) and getattr(path[-1], "key", None) == HISTORY


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def delayed_einsum(equation: str, x: jax.Array, w: jax.Array, history_3T: jax.Array) -> jax.Array:
    """`fp8_einsum` with each operand scaled by the largest max magnitude of its row of `history_3T` (fp32 [3, T]:
    input, kernel, output gradient; the newest step first). Its gradient for `history_3T` is the history one step
    on: rolled by one, this step's three max magnitudes in front."""
    return _delayed_forward(equation, x, w, history_3T)[0]


def _delayed_forward(equation, x, w, history_3T):
    scales = jax.lax.stop_gradient([scale_for(a, E4M3) for a in history_3T[:2].max(axis=1)])
    xq, wq = cast(x, scales[0], E4M3), cast(w, scales[1], E4M3)
    y = _dot(equation, xq, wq, scales[0] * scales[1], x.dtype)
    return y, (xq, scales[0], wq, scales[1], history_3T, amax(x), amax(w))


def _delayed_backward(equation, residuals, g):
    xq, sx, wq, sw, history_3T, amax_x, amax_w = residuals
    x, w, out = operands(equation)
    sg = scale_for(history_3T[2].max(), E5M2)
    gq = cast(g, sg, E5M2)
    dx = _dot(f"{out},{w}->{x}", gq, wq, sg * sw, g.dtype)
    dw = _dot(f"{x},{out}->{w}", xq, gq, sx * sg, g.dtype)
    newest_3 = jnp.stack([amax_x, amax_w, amax(g)])
    return dx, dw, jnp.concatenate([newest_3[:, None], history_3T[:, :-1]], axis=1)


delayed_einsum.defvjp(_delayed_forward, _delayed_backward)
