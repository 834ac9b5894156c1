"""The few-row decode attention kernel (`layers.flash_decode`), interpreted on CPU: equal to the cache's reference
attention (`kv_cache.attend_cached` through XLA, fp32, 1e-5 of the output's scale) for full and grouped heads,
spans of one or several blocks, spans with no written slot, a partly written last block and a full ring; shapes it
does not take go elsewhere."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mlm_jax.layers import axes as ax
from mlm_jax.layers import flash_decode, kv_cache


@pytest.mark.parametrize("programs", [flash_decode.PROGRAMS, 4])  # one block a program; spans of several
@pytest.mark.parametrize("B, N, K, H, C, positions", [
    (1, 4, 4, 16, 128, [0]),  # one written slot: every span but the first empty
    (3, 8, 2, 32, 256, [5, 100, 300]),  # GQA (4 queries a K/V head); the last row's ring full (position >= C)
    (2, 4, 1, 64, 64, [63, 17]),  # MQA; a block size of 32 with G * H = 256
])
def test_equals_the_reference(B, N, K, H, C, positions, programs, monkeypatch):
    monkeypatch.setattr(flash_decode, "PROGRAMS", programs)
    kq, kk, kv = jax.random.split(jax.random.key(B), 3)
    q_BTNH = jax.random.normal(kq, (B, 1, N, H))
    k_BCKH, v_BCKH = jax.random.normal(kk, (B, C, K, H)), jax.random.normal(kv, (B, C, K, H))
    positions_BT = jnp.asarray(positions, jnp.int32)[:, None]
    assert flash_decode.supports(q_BTNH, k_BCKH)
    want = kv_cache.attend_cached(q_BTNH, k_BCKH, v_BCKH, positions_BT, None, "xla")
    with ax.kernels(**{ax.CACHED_ATTENTION: lambda *a: flash_decode.attend(*a, interpret=True)}):
        got = kv_cache.attend_cached(q_BTNH, k_BCKH, v_BCKH, positions_BT, None, "xla")
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * float(jnp.abs(want).max()))


@pytest.mark.parametrize("q_shape, k_shape", [
    ((5, 1, 4, 16), (5, 128, 4, 16)),  # more rows than MAX_ROWS
    ((1, 2, 4, 16), (1, 128, 4, 16)),  # two queries a row (a prefill)
    ((1, 1, 6, 16), (1, 128, 2, 16)),  # three queries a K/V head
    ((1, 1, 4, 24), (1, 128, 4, 24)),  # head dim not a power of two
    ((1, 1, 4, 16), (1, 72, 4, 16)),  # no block divides the cache
])
def test_other_shapes_are_not_taken(q_shape, k_shape):
    assert not flash_decode.supports(jnp.zeros(q_shape), jnp.zeros(k_shape))
