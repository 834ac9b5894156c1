"""The few-row product kernel of decode steps (`ops.gemv`), interpreted on CPU: equal to XLA's einsum (fp32,
1e-5 of the result's scale) on both of its paths (summed on the CUDA cores up to 4 rows, tensor-core tiles from 5,
padded), with one or several partial products over the contracted dims and several steps in each; shapes it does
not take go to XLA's einsum. The residual add of decode steps (`add_residual`) equals XLA's sum, add and RMSNorm
factor; a gated MLP's hidden rows from its fused gate/up product (`gated`) equal `MLP.hidden`'s."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mlm_jax.infer.blocks import DecodeMLP
from mlm_jax.model.kernels import Kernels
from mlm_jax.ops import gemv


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
# partials one at a time or all at once (a power of two), in 3 blocks of 32 columns or one; no block: XLA
@pytest.mark.parametrize("splits, D", [(3, 96), (4, 96), (1, 32), (2, 24)])
def test_residual_add_equals_xla(dtype, splits, D, monkeypatch):
    monkeypatch.setattr(gemv, "RESIDUAL_BLOCK", 32)
    kx, kp = jax.random.split(jax.random.key(D))
    x = jax.random.normal(kx, (3, 1, D)).astype(dtype)
    partials = jax.random.normal(kp, (splits, 3, 1, D), jnp.float32)
    partials = partials if splits > 1 else partials.astype(dtype)  # XLA's product: one partial in x's dtype
    got, got_r = gemv.add_residual(x, partials, 1e-6, interpret=True)
    got_r = gemv.factor(got_r)  # a kernel's sums of squares, or XLA's factor
    want = x + partials.astype(jnp.float32).sum(0).astype(dtype)
    want32 = want.astype(jnp.float32)
    want_r = jax.lax.rsqrt(jnp.mean(want32 * want32, -1, keepdims=True) + 1e-6)
    assert got.dtype == dtype and got_r.shape == (3, 1, 1)
    np.testing.assert_allclose(got.astype(jnp.float32), want32, rtol=0, atol=1e-6 if dtype == jnp.float32 else 0)
    np.testing.assert_allclose(got_r, want_r, rtol=1e-6)


@pytest.mark.parametrize("rows", [3, 32])
@pytest.mark.parametrize("equation, x_shape, kernel_shape, split, partials", [
    ("bsnh,nhd->bsd", (4, 16), (4, 16, 96), None, {3: 2, 32: 4}),  # two contracted dims: FEW's blocks, MANY's
    ("bsd,df->bsf", (64,), (64, 96), (16, 32, 2), {3: 2, 32: 2}),  # one: SPLIT's blocks
    ("bsd,df->bsf", (64,), (64, 96), (16, 32, 8), {3: 1, 32: 1}),  # blocks that do not divide it: XLA's product
])
def test_partials_sum_to_the_product(rows, equation, x_shape, kernel_shape, split, partials, monkeypatch):
    monkeypatch.setattr(gemv, "SPLIT", split)
    monkeypatch.setattr(gemv, "MANY", (16, 32, None))  # one step of 16 a partial
    kx, kw = jax.random.split(jax.random.key(rows))
    x, kernel = jax.random.normal(kx, (rows, 1, *x_shape)), jax.random.normal(kw, kernel_shape)
    got = gemv.einsum(equation, x, kernel, summed=False, interpret=True)
    want = jnp.einsum(equation, x, kernel, precision="highest")
    assert got.shape == (partials[rows], *want.shape)
    np.testing.assert_allclose(got.sum(0), want, rtol=0, atol=1e-5 * float(jnp.abs(want).max()))


@pytest.mark.parametrize("rows", [3, 32])  # padded to a tensor-core tile, or not
@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
# no row scale, an array of them, a residual kernel's sums of squares that the kernel finishes (a power of two of
# them) or that XLA finishes first
@pytest.mark.parametrize("scale", [None, "array", 4, 3])
def test_gated_equals_the_mlp(rows, activation, scale, monkeypatch):
    monkeypatch.setattr(gemv, "GATED", (16, 32, 4, 3))  # 4 steps a program, 3 column blocks
    calls = []
    kw = dict(activation=activation, fused=True, std=0.2, out_std=0.2, dtype=jnp.float32, param_dtype=jnp.float32)
    mlp = DecodeMLP(64, 96, rngs=nnx.Rngs(rows), **kw)
    with_kernel = DecodeMLP(64, 96, rngs=nnx.Rngs(rows), **kw, kernels=Kernels(
        gated=lambda *a: calls.append(1) or gemv.gated(*a, interpret=True)))
    kx, ks = jax.random.split(jax.random.key(rows))
    x = jax.random.normal(kx, (rows, 1, 64))
    row_scale = {None: None, "array": jax.random.uniform(ks, (rows, 1, 1), minval=0.5, maxval=2.0)}.get(scale)
    if isinstance(scale, int):
        row_scale = gemv.RowFactor(jax.random.uniform(ks, (rows, 1, scale), minval=8.0, maxval=64.0), 64, 1e-5)
    want = mlp.hidden(x, gemv.factor(row_scale))
    got = with_kernel.hidden(x, row_scale)
    assert calls and got.shape == want.shape == (rows, 1, 96)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * float(jnp.abs(want).max()))


@pytest.mark.parametrize("x_shape, w_shape, dtype, interpret", [
    ((65, 1, 64), (64, 2, 96), jnp.bfloat16, False),  # more rows than MAX_ROWS
    ((4, 1, 64), (64, 2, 96), jnp.float32, False),  # fp32 on a GPU
    ((4, 1, 64), (64, 2, 80), jnp.float32, True),  # no block of 32 divides the hidden dim
])
def test_gated_leaves_other_shapes_to_xla(x_shape, w_shape, dtype, interpret, monkeypatch):
    monkeypatch.setattr(gemv, "GATED", (16, 32, 4, 3))
    x, w = jnp.ones(x_shape, dtype), jnp.ones(w_shape, dtype)
    assert gemv.gated(x, w, None, jax.nn.silu, interpret=interpret) is None


def test_an_mlp_that_is_not_gated_leaves_the_kernel_alone():
    calls = []
    mlp = DecodeMLP(64, 96, activation="gelu", fused=True, std=0.2, out_std=0.2, dtype=jnp.float32,
                    param_dtype=jnp.float32, rngs=nnx.Rngs(0),
                    kernels=Kernels(gated=lambda *a: calls.append(1) or gemv.gated(*a, interpret=True)))
    x = jax.random.normal(jax.random.key(0), (4, 1, 64))
    got = mlp.hidden(x)
    assert not calls
    np.testing.assert_array_equal(got, jax.nn.gelu(mlp.up(x)))
