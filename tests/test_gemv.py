"""The few-row product kernel of decode steps (`layers.gemv`), interpreted on CPU: equal to XLA's einsum (fp32,
1e-5 of the result's scale) on both of its paths (summed on the CUDA cores up to 4 rows, tensor-core tiles from 5,
padded), with one or several partial products over the contracted dims and several steps in each; shapes it does
not take go to XLA's einsum. A gated MLP's down projection whose activation the kernel makes as it loads its input
(`gated`) equals XLA's product of that activation. The residual add of decode steps (`add_residual`) equals XLA's
sum, add and RMSNorm factor."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mlm_jax.layers import gemv


@pytest.mark.parametrize("rows", [1, 3, 5, 32])
@pytest.mark.parametrize("equation, x_shape, kernel_shape, config", [
    ("bsnh,nhd->bsd", (4, 16), (4, 16, 96), (16, 32, 2)),  # attention's output projection: two contracted dims
    ("bsd,df->bsf", (176,), (176, 48), (16, 16, 11)),  # one step in each of 11 partials
    ("bsd,df->bsf", (128,), (128, 48), (16, 16, 1)),  # one partial of 8 steps
])
def test_equals_xla_einsum(rows, equation, x_shape, kernel_shape, config):
    kx, kw = jax.random.split(jax.random.key(rows))
    x = jax.random.normal(kx, (rows, 1, *x_shape))
    kernel = jax.random.normal(kw, kernel_shape)
    got = gemv.einsum(equation, x, kernel, config=config, interpret=True)
    want = jnp.einsum(equation, x, kernel, precision="highest")
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * float(jnp.abs(want).max()))


@pytest.mark.parametrize("equation, x_shape, kernel_shape", [
    ("bsd,df->bsf", (1, 65, 32), (32, 16)),  # more rows than MAX_ROWS
    ("bsd,df->bsf", (1, 1, 24), (24, 16)),  # no block of 16 divides the contracted dim
    ("bsd,dbf->bsf", (2, 1, 32), (32, 2, 16)),  # not a plain matrix product
])
def test_other_shapes_go_to_xla(equation, x_shape, kernel_shape, monkeypatch):
    monkeypatch.setattr(gemv, "matmul", None)  # would fail if called
    x, kernel = jnp.ones(x_shape), jnp.ones(kernel_shape)
    np.testing.assert_array_equal(gemv.einsum(equation, x, kernel, interpret=True), jnp.einsum(equation, x, kernel))



@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
# partials one at a time or all at once (a power of two), over 3 blocks of 32 columns or one; no block: XLA
@pytest.mark.parametrize("splits, D", [(3, 96), (4, 96), (1, 64), (2, 24)])
def test_residual_add_equals_xla(dtype, splits, D, monkeypatch):
    monkeypatch.setattr(gemv, "ROW_BLOCK", 32)
    kx, kp = jax.random.split(jax.random.key(D))
    x = jax.random.normal(kx, (3, 1, D)).astype(dtype)
    partials = jax.random.normal(kp, (splits, 3, 1, D), jnp.float32)
    partials = partials if splits > 1 else partials.astype(dtype)  # XLA's product: one partial in x's dtype
    got, got_r = gemv.add_residual(x, partials, 1e-6, interpret=True)
    want = x + partials.astype(jnp.float32).sum(0).astype(dtype)
    want32 = want.astype(jnp.float32)
    want_r = jax.lax.rsqrt(jnp.mean(want32 * want32, -1, keepdims=True) + 1e-6)
    assert got.dtype == dtype and got_r.shape == (3, 1, 1)
    np.testing.assert_allclose(got.astype(jnp.float32), want32, rtol=0, atol=1e-6 if dtype == jnp.float32 else 0)
    np.testing.assert_allclose(got_r, want_r, rtol=1e-6)


def test_partials_sum_to_the_product():
    x, kernel = jax.random.normal(jax.random.key(1), (3, 1, 4, 16)), jax.random.normal(jax.random.key(2), (4, 16, 96))
    partials = gemv.einsum("bsnh,nhd->bsd", x, kernel, config=(16, 32, 2), summed=False, interpret=True)
    assert partials.shape == (2, 3, 1, 96) and partials.dtype == jnp.float32
    want = jnp.einsum("bsnh,nhd->bsd", x, kernel, precision="highest")
    np.testing.assert_allclose(partials.sum(0), want, rtol=0, atol=1e-5 * float(jnp.abs(want).max()))
    xla = gemv.einsum("bsd,df->bsf", x[..., 0, :], kernel[0], summed=False, interpret=True)  # one dim: XLA's
    np.testing.assert_array_equal(xla, jnp.einsum("bsd,df->bsf", x[..., 0, :], kernel[0])[None])


@pytest.mark.parametrize("rows", [1, 3, 5, 32])
@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
@pytest.mark.parametrize("blocks", [(16, 16, 3), (64, 16, 2)])  # 3 slices of 2 steps; blocks that do not divide: XLA
def test_gated_product_equals_xla(rows, activation, blocks, monkeypatch):
    monkeypatch.setattr(gemv, "GATED", blocks)
    kx, kw, kr = jax.random.split(jax.random.key(rows), 3)
    gate_up = jax.random.normal(kx, (rows, 1, 2, 96))
    kernel, row_scale = jax.random.normal(kw, (96, 48)), jax.random.uniform(kr, (rows, 1, 1), minval=0.5, maxval=2)
    got = gemv.einsum("bsf,fd->bsd", gate_up, kernel, summed=False, gated=(activation, row_scale), interpret=True)
    assert got.shape[1:] == (rows, 1, 48)
    h = gemv.activated(gate_up[..., 0, :], gate_up[..., 1, :], row_scale, activation)
    reference = jax.nn.silu if activation == "swiglu" else functools.partial(jax.nn.gelu, approximate=True)
    np.testing.assert_allclose(h, reference(gate_up[..., 0, :] * row_scale) * gate_up[..., 1, :] * row_scale,
                               rtol=1e-6, atol=1e-6)
    want = jnp.einsum("bsf,fd->bsd", h, kernel, precision="highest")
    np.testing.assert_allclose(got.sum(0), want, rtol=0, atol=1e-5 * float(jnp.abs(want).max()))
