"""What the equivalence tests share: train a few steps under a layout and compare them with one device, at every
step: the loss within 1e-5 relative and the gradient of every parameter leaf within 1e-4 relative
(||g - g_ref|| / ||g_ref||, so a leaf's gradient sent to another leaf, or errors that cancel in a global norm, fail).
"""
from dataclasses import dataclass

import jax
import numpy as np

from mlm_jax import Trainer, load_config


@dataclass
class Run:
    records: list[dict]  # the logged records, one per step
    grads: list[dict[str, np.ndarray]]  # per step, the gradient of every parameter leaf (by path) before the update


def leaves(tree) -> dict[str, np.ndarray]:
    flat = jax.tree_util.tree_flatten_with_path(jax.device_get(tree))[0]
    return {jax.tree_util.keystr(path): np.asarray(x, np.float32) for path, x in flat}


def fit(base, overrides, num_devices, tmp_path) -> Run:
    """`base + overrides` trained on the first `num_devices` devices, one step at a time, the gradients of each
    step's batch taken (`Trainer.gradients`) before the step."""
    cfg = load_config(None, base + [f"train.output_dir={tmp_path}"] + overrides)
    trainer = Trainer(cfg, devices=jax.devices()[:num_devices])
    run = Run([], [])
    while int(trainer.state.step) < cfg.train.steps:
        run.grads.append(leaves(trainer.gradients()[1]))
        run.records += [r for r in trainer.fit(steps=1) if "loss" in r]
    return run


def assert_matches(got: Run, ref: Run, steps=3):
    assert len(got.records) == len(ref.records) == len(got.grads) == len(ref.grads) == steps
    np.testing.assert_allclose([r["loss"] for r in got.records], [r["loss"] for r in ref.records], rtol=1e-5,
                               err_msg="loss")
    for step, (g, r) in enumerate(zip(got.grads, ref.grads), 1):
        assert g.keys() == r.keys(), (sorted(g.keys() ^ r.keys()), step)
        for path in r:
            assert g[path].shape == r[path].shape, (path, step)
            error = np.linalg.norm(g[path] - r[path])
            assert error <= 1e-4 * np.linalg.norm(r[path]), (
                f"step {step}, gradient of {path}: relative error {error / max(np.linalg.norm(r[path]), 1e-30):.2e}")
