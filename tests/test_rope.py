"""RoPE variants beyond what the Hugging Face logits tests cover: partial rotary and YaRN's attention factor."""
import dataclasses

import jax
import numpy as np

from mlm_jax.model.rope import RopeConfig, apply_rope, frequencies

X_BSNH = jax.random.normal(jax.random.key(0), (2, 12, 3, 16))
POSITIONS_BS = np.broadcast_to(np.arange(12), (2, 12))


def test_partial_rotary_rotates_the_leading_dims_and_passes_the_rest():
    full = RopeConfig(theta=10000.0, rotary_dim=8)
    out = np.asarray(apply_rope(X_BSNH, POSITIONS_BS, full))
    np.testing.assert_array_equal(out[..., 8:], np.asarray(X_BSNH)[..., 8:])
    np.testing.assert_allclose(out[..., :8], apply_rope(X_BSNH[..., :8], POSITIONS_BS, full), rtol=1e-6)
    assert not np.allclose(out[..., :8], np.asarray(X_BSNH)[..., :8])


def test_yarn_scales_cos_and_sin_by_the_mscale_ratio():
    yarn = RopeConfig(theta=10000.0, rotary_dim=16, kind="yarn", factor=40.0, original_context=64, mscale=1.0,
                      mscale_all_dim=0.5)
    inv_freq, attention = frequencies(yarn)
    expected = (0.1 * np.log(40.0) + 1) / (0.05 * np.log(40.0) + 1)
    np.testing.assert_allclose(attention, expected, rtol=1e-12)
    # the rotation keeps norms, so the output's norm is the input's times the factor
    out = apply_rope(X_BSNH, POSITIONS_BS, yarn)
    np.testing.assert_allclose(np.linalg.norm(out, axis=-1), attention * np.linalg.norm(X_BSNH, axis=-1), rtol=1e-5)
    # the highest frequency keeps its value (extrapolated), the lowest is divided by the factor (interpolated)
    plain, _ = frequencies(dataclasses.replace(yarn, kind="default"))
    np.testing.assert_allclose(inv_freq[0], plain[0], rtol=1e-6)
    np.testing.assert_allclose(inv_freq[-1], plain[-1] / 40.0, rtol=1e-6)
