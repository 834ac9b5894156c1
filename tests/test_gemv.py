"""The few-row product kernel of decode steps (`layers.gemv`), interpreted on CPU: equal to XLA's einsum (fp32,
1e-5 of the result's scale) on both of its paths (summed on the CUDA cores up to 4 rows, tensor-core tiles from 5,
padded), with one or several partial products over the contracted dims and several steps in each; shapes it does
not take go to XLA's einsum."""
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

