"""TensorBoard and Weights & Biases: what a run writes there is what metrics.jsonl holds."""
import glob
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator

from mlm_jax import Trainer, load_config
from mlm_jax.config import ConfigError
from mlm_jax.train.dashboards import scalars
from mlm_jax.validation import plan as plan_lib

BASE = ["train.steps=3", "train.log_every=1", "train.eval_every=2", "train.eval_batches=1",
        "train.global_batch_size=4", "train.seq_len=32", "log.progress=never", "data.max_bytes=2000000"]


def run(tmp_path, *overrides):
    cfg = load_config(None, BASE + [f"train.output_dir={tmp_path}", *overrides])
    Trainer(cfg, devices=jax.devices()[:1]).fit()
    with open(tmp_path / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def read_events(directory):
    acc = event_accumulator.EventAccumulator(str(directory), size_guidance={event_accumulator.SCALARS: 0,
                                                                             event_accumulator.TENSORS: 0})
    acc.Reload()
    return acc


def test_tensorboard_holds_the_scalars_of_metrics_jsonl_and_the_config(tmp_path):
    records = run(tmp_path, "model.moe.num_experts=4", "model.moe.top_k=2")
    acc = read_events(tmp_path / "tensorboard")
    wanted = {}
    for rec in records:
        for name, value in scalars(rec).items():
            wanted.setdefault(name, {})[rec["step"]] = value
    assert {"loss", "eval_loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "moe_aux_loss",
            "moe_load_max_mean/0", "moe_dropped/1"} <= set(wanted)
    assert set(acc.Tags()["scalars"]) == set(wanted)
    for name, by_step in wanted.items():
        got = {e.step: e.value for e in acc.Scalars(name)}
        assert got.keys() == by_step.keys(), name
        for step, value in by_step.items():
            assert got[step] == np.float32(value), (name, step)
    text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "num_experts: 4" in text and f"output_dir: {tmp_path}" in text


def test_the_tensorboard_writer_comes_without_torch_and_leaves_it_importable():
    """tensorboardX imports torch where it is installed (seconds of every run's start-up); the writer is imported
    without it, and torch stays importable afterwards."""
    check = ("import importlib.util, sys\n"
             "from mlm_jax.train.dashboards import _summary_writer\n"
             "_summary_writer()\n"
             "assert 'tensorboardX' in sys.modules and 'torch' not in sys.modules\n"
             "assert importlib.util.find_spec('torch') is not None\n")
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_tensorboard_off_writes_none(tmp_path):
    run(tmp_path, "train.steps=1", "log.tensorboard=false")
    assert not (tmp_path / "tensorboard").exists()


def test_wandb_offline_writes_a_run_that_a_second_fit_continues(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config(None, BASE + [f"train.output_dir={tmp_path}", "log.wandb_project=mlm-jax-test",
                                    "log.tensorboard=false"])
    trainer = Trainer(cfg, devices=jax.devices()[:1])
    trainer.fit(2)
    run_id = (tmp_path / "wandb_id").read_text().strip()
    runs = glob.glob(str(tmp_path / "wandb" / f"offline-run-*-{run_id}"))
    assert len(runs) == 1 and glob.glob(os.path.join(runs[0], f"run-{run_id}.wandb")), os.listdir(tmp_path / "wandb")
    trainer.fit(1)
    assert (tmp_path / "wandb_id").read_text().strip() == run_id  # the same W&B run, resumed


@pytest.mark.parametrize("missing, overrides, message", [
    ("wandb", ["log.wandb_project=p"],
     r"^log\.wandb_project=p: the wandb package is not installed \(pip install 'mlm_jax\[wandb\]'\)$"),
    ("tensorboardX", [], r"^log\.tensorboard=true: the tensorboardX package is not installed \(pip install -e \., "
                         r"or log\.tensorboard=false\)$"),
])
def test_a_dashboard_without_its_package_is_refused(missing, overrides, message, monkeypatch):
    real = plan_lib.importlib.util.find_spec
    monkeypatch.setattr(plan_lib.importlib.util, "find_spec", lambda name, *a: None if name == missing else
                        real(name, *a))
    with pytest.raises(ConfigError, match=message):
        plan_lib.plan(load_config(None, overrides), jax.devices()[:1])
    plan_lib.plan(load_config(None, overrides + ["log.tensorboard=false", "log.wandb_project=null"]),
                  jax.devices()[:1])
