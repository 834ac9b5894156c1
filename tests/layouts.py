"""What the equivalence tests share: train a few logged steps under a layout, and compare them with one device
(loss within 1e-5, gradient norm within 1e-4 relative, at every step)."""
import jax
import numpy as np

from mlm_jax import Trainer, load_config


def fit(base, overrides, num_devices, tmp_path) -> list[dict]:
    """The logged records of `base + overrides` trained on the first `num_devices` devices."""
    cfg = load_config(None, base + [f"train.output_dir={tmp_path}"] + overrides)
    return Trainer(cfg, devices=jax.devices()[:num_devices]).fit()


def losses_and_grad_norms(records) -> np.ndarray:
    return np.array([[r["loss"], r["grad_norm"]] for r in records])


def assert_matches(got, ref, steps=3):
    assert got.shape == ref.shape == (steps, 2)
    np.testing.assert_allclose(got[:, 0], ref[:, 0], rtol=1e-5, err_msg="loss")
    np.testing.assert_allclose(got[:, 1], ref[:, 1], rtol=1e-4, err_msg="grad norm")
