"""What the layout tests share: `train_or_refusal` for the sweeps, and for the equivalence tests: train a few steps under a layout and compare them with one device.

At every step, the loss the layout's train step logged within 1e-5 relative, and the gradient of every parameter
leaf within 1e-4 relative (||g - g_ref|| / ||g_ref||, so a leaf's gradient sent to another leaf, or errors that
cancel in a global norm, fail). Each step's reference loss and gradient are taken at the layout's own weights of
that step: AdamW's normalised updates turn rounding-level gradient differences into visibly different weights
within a few steps (and capacity-limited experts then drop other tokens), so later steps compare the same function
only at the same point.
"""
from dataclasses import dataclass

import jax
import numpy as np

from mlm_jax import Trainer, load_config
from mlm_jax.config import ConfigError


@dataclass
class Run:
    trainer: Trainer
    records: list[dict]  # the logged records, one per step
    params: list  # per step, the weights before the update (host arrays)
    grads: list[dict[str, np.ndarray]]  # per step, the gradient of every parameter leaf (by path) at those weights


def leaves(tree) -> dict[str, np.ndarray]:
    flat = jax.tree_util.tree_flatten_with_path(jax.device_get(tree))[0]
    return {jax.tree_util.keystr(path): np.asarray(x, np.float32) for path, x in flat}


def fit(base, overrides, num_devices, tmp_path) -> Run:
    """`base + overrides` trained on the first `num_devices` devices, one step at a time, each step's gradients
    read from the train step itself (`keep_gradients`)."""
    cfg = load_config(None, base + [f"train.output_dir={tmp_path}"] + overrides)
    trainer = Trainer(cfg, devices=jax.devices()[:num_devices], keep_gradients=True)
    run = Run(trainer, [], [], [])
    while int(trainer.state.step) < cfg.train.steps:
        run.params.append(jax.device_get(trainer.state.params))
        run.records += [r for r in trainer.fit(steps=1) if "loss" in r]
        run.grads.append(leaves(trainer.last_gradients))
    return run


def reference(base, overrides, tmp_path) -> Run:
    """The one-device trainer of `base + overrides`, untrained: `assert_matches` asks it only for its loss and
    gradients at the layout's weights of each step."""
    cfg = load_config(None, base + [f"train.output_dir={tmp_path}"] + overrides)
    return Run(Trainer(cfg, devices=jax.devices()[:1]), [], [], [])


def assert_matches(got: Run, ref: Run, steps=3):
    assert len(got.records) == len(got.grads) == steps
    for step, (params, g) in enumerate(zip(got.params, got.grads)):
        metrics, ref_grads = ref.trainer.gradients(params, step)
        np.testing.assert_allclose(got.records[step]["loss"], float(metrics["loss"]), rtol=1e-5,
                                   err_msg=f"step {step + 1}, loss")
        r = leaves(ref_grads)
        assert g.keys() == r.keys(), (sorted(g.keys() ^ r.keys()), step)
        for path in r:
            assert g[path].shape == r[path].shape, (path, step)
            error = np.linalg.norm(g[path] - r[path])
            assert error <= 1e-4 * np.linalg.norm(r[path]), (
                f"step {step + 1}, gradient of {path}: relative error "
                f"{error / max(np.linalg.norm(r[path]), 1e-30):.2e}")


def train_or_refusal(overrides, tmp_path) -> str | None:
    """None when `overrides` trained 2 finite steps on all 8 devices (with no checkpoint written), else the
    one-line refusal."""
    try:
        trainer = Trainer(load_config(None, overrides + ["train.steps=3", f"train.output_dir={tmp_path}"]),
                          devices=jax.devices())
    except ConfigError as e:
        message = str(e)
        assert message and "\n" not in message, message
        return message
    records = trainer.fit(steps=2)
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["loss"] is not None and np.isfinite(r["loss"]) for r in records), records
    return None
