"""Pipeline stages train with bf16 weights in them (stored so, or cast from fp32 masters by ZeRO-1 for bf16
compute), for both schedules. tests/test_pipeline.py checks the numerics in fp32; this checks that these traces
compile and take finite steps (the 1F1B backward's branches once disagreed on gradient dtypes, and GPipe's bf16
psum over stages crashed XLA CPU).
"""
import math

import jax
import pytest

from mlm_jax import Trainer, load_config

BASE = ["model.num_layers=4", "model.hidden_size=64", "train.steps=2", "train.log_every=1", "train.eval_every=0",
        "train.global_batch_size=8", "train.seq_len=16", "log.progress=never", "data.max_bytes=600000",
        "checkpoint.resume=none"]

FSDP2 = ["parallel.stage=2", "parallel.fsdp=2", "parallel.data=2"]
VIRTUAL2 = ["parallel.stage=2", "parallel.virtual_stages=2", "parallel.data=4"]

CASES = {  # bf16 compute (the default) unless said otherwise
    "fsdp2-zero1-m4": FSDP2 + ["parallel.shard_optimizer=true", "train.num_microbatches=4",
                               "train.global_batch_size=16"],
    "virtual2-fp32-compute-bf16-weights": VIRTUAL2 + ["model.param_dtype=bfloat16", "model.dtype=float32"],
}


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("case", list(CASES))
def test_pipeline_trains_in_low_precision(case, schedule, tmp_path):
    cfg = load_config(None, BASE + CASES[case] + [f"parallel.pipeline_schedule={schedule}",
                                                  f"train.output_dir={tmp_path}"])
    trainer = Trainer(cfg, devices=jax.devices()[:8])
    losses = [r["loss"] for r in trainer.fit() if "loss" in r]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), losses
    assert int(trainer.state.skipped_steps) == 0  # the gradients were finite too
