"""The decode step kernel (`ops.flash_decode.step`), interpreted on CPU: equal to XLA's reference (the new query,
key and value times a row scale, RoPE of the query and key by `rope.apply_rope`, `kv_cache.write`,
`kv_cache.attend_cached`; fp32, 1e-5 of the output's scale) with its products on the CUDA cores and on the tensor
cores, the new values as three arrays, as one fused product and as that product's input and weight, for full and
grouped heads, spans of one or several blocks (partials combined, or one span a row and head that writes the output
itself), spans with no written slot, a partly written last block, a full ring and the new slot in its middle; the
caches it returns equal the written ones, every other slot untouched. Shapes it does not take go elsewhere."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mlm_jax.infer import kv_cache
from mlm_jax.ops import flash_decode
from mlm_jax.model.rope import RopeConfig, apply_rope, tables


# q, k and v apart, or one [B, 1, K, G + 2, H] product (with a row scale or none: a block whose norms are not folded),
# or that product's input and weight, which the kernel multiplies as partial products over two slices of 32
@pytest.mark.parametrize("form", ["apart", "fused", "fused unscaled", "product"])
@pytest.mark.parametrize("mma_rows", [1, 1000])  # products on the tensor cores, or on the CUDA cores
@pytest.mark.parametrize("programs", [512, 4])  # one block a program, spans of several; one span a row and head
@pytest.mark.parametrize("B, N, K, H, C, positions", [
    (1, 4, 4, 32, 128, [0]),  # one written slot: every span but the first empty
    (3, 8, 2, 32, 256, [5, 100, 300]),  # GQA (4 queries a K/V head); the last row's ring full (position >= C)
    (2, 4, 1, 64, 64, [63, 17]),  # MQA; a block size of 32 with G * H = 256
    (2, 16, 1, 32, 128, [40, 127]),  # as many queries a K/V head as a tensor-core product has rows
])
def test_equals_the_reference(B, N, K, H, C, positions, programs, mma_rows, form, monkeypatch):
    monkeypatch.setattr(flash_decode, "PROGRAMS", programs)
    monkeypatch.setattr(flash_decode, "MMA_ROWS", mma_rows)
    monkeypatch.setattr(flash_decode, "PRODUCT_BLOCKS", (16, 16, 2))
    keys = jax.random.split(jax.random.key(B), 8)
    q_BTNH = jax.random.normal(keys[0], (B, 1, N, H))
    k_BTKH, v_BTKH = (jax.random.normal(key, (B, 1, K, H)) for key in keys[1:3])
    if form == "product":
        x_BTD, w_DKJH = jax.random.normal(keys[6], (B, 1, 64)), jax.random.normal(keys[7], (64, K, N // K + 2, H)) / 8
        y_BTKJH = jnp.einsum("btd,dkjh->btkjh", x_BTD, w_DKJH, precision="highest")
        q_BTNH, k_BTKH, v_BTKH = y_BTKJH[..., :-2, :].reshape(B, 1, N, H), y_BTKJH[..., -2, :], y_BTKJH[..., -1, :]
    k_BCKH, v_BCKH = (jax.random.normal(key, (B, C, K, H)) for key in keys[3:5])
    row_scale_BT = jax.random.uniform(keys[5], (B, 1), minval=0.5, maxval=2.0)  # a folded norm's 1 / rms
    if form == "fused unscaled":
        row_scale_BT = None
    positions_BT = jnp.asarray(positions, jnp.int32)[:, None]
    rope = RopeConfig(theta=100.0, rotary_dim=H)
    scale = 0.3
    assert flash_decode.supports(q_BTNH.shape, k_BCKH.shape, H)
    q_BTNH_, k_BTKH_, v_BTKH_ = ((q_BTNH, k_BTKH, v_BTKH) if row_scale_BT is None else
                                 (x * row_scale_BT[..., None, None] for x in (q_BTNH, k_BTKH, v_BTKH)))
    want_k = kv_cache.write(k_BCKH, apply_rope(k_BTKH_, positions_BT, rope), positions_BT)
    want_v = kv_cache.write(v_BCKH, v_BTKH_, positions_BT)
    q_scaled = apply_rope(q_BTNH_, positions_BT, rope) * (scale * math.sqrt(H))  # the reference divides by sqrt(H)
    want = kv_cache.attend_cached(q_scaled, want_k, want_v, positions_BT, None, "xla")
    new = (q_BTNH, k_BTKH, v_BTKH)
    if form.startswith("fused"):
        new = jnp.concatenate([q_BTNH.reshape(B, 1, K, N // K, H), k_BTKH[:, :, :, None], v_BTKH[:, :, :, None]], 3)
    elif form == "product":
        new = flash_decode.Product(x_BTD, w_DKJH)
    got, got_k, got_v = jax.jit(lambda *a: flash_decode.step(*a, scale=scale, interpret=True))(
        new, *tables(positions_BT, rope), k_BCKH, v_BCKH, positions_BT, row_scale_BT)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * float(jnp.abs(want).max()))
    if form == "product":  # the kernel's sum of partials against XLA's product: fp32 rounding apart
        for got_c, want_c in ((got_k, want_k), (got_v, want_v)):
            np.testing.assert_allclose(got_c, want_c, rtol=0, atol=1e-6 * float(jnp.abs(want_c).max()))
    else:
        np.testing.assert_allclose(got_k, want_k, rtol=0, atol=1e-6)
        np.testing.assert_array_equal(got_v, want_v)


@pytest.mark.parametrize("q_shape, k_shape, rotary_dim", [
    ((2, 1, 4, 16), (2, 128, 4, 16), 16),  # rows for the tensor cores, whose products need a head dim of 32
    ((1, 2, 4, 16), (1, 128, 4, 16), 16),  # two queries a row (a prefill)
    ((1, 1, 6, 16), (1, 128, 2, 16), 16),  # three queries a K/V head
    ((1, 1, 4, 24), (1, 128, 4, 24), 24),  # head dim not a power of two
    ((1, 1, 4, 16), (1, 72, 4, 16), 16),  # no block divides the cache
    ((1, 1, 4, 16), (1, 128, 4, 16), 8),  # partial rotary
])
def test_other_shapes_are_not_taken(q_shape, k_shape, rotary_dim):
    assert not flash_decode.supports(q_shape, k_shape, rotary_dim)
