"""Pipeline parallelism computes the same function as one device, for both schedules and composed with the rest.

fp32, 8 layers, global batch 16, 3 steps of AdamW: loss within 1e-5, every leaf's gradient within 1e-4 relative.
"""
import pytest

from layouts import assert_matches, fit
from mlm_jax import load_config
from mlm_jax.config import ConfigError
from mlm_jax.validation import check_degrees

BASE = ["model.dtype=float32", "model.num_layers=8", "train.steps=3", "train.log_every=1", "train.eval_every=0",
        "train.global_batch_size=16", "train.seq_len=32", "log.progress=never", "optim.warmup_steps=0",
        "optim.lr=1e-2", "data.max_bytes=2000000", "checkpoint.resume=none"]


@pytest.fixture(scope="module")
def single_device(tmp_path_factory):
    return fit(BASE, ["parallel.data=1"], 1, tmp_path_factory.mktemp("ref"))


LAYOUTS = {
    "stage2": ["parallel.stage=2", "parallel.data=4"],
    "stage4": ["parallel.stage=4", "parallel.data=2"],
    "stage2-virtual2": ["parallel.stage=2", "parallel.virtual_stages=2", "parallel.data=4"],
    "stage2-virtual2-unrolled": ["parallel.stage=2", "parallel.virtual_stages=2", "parallel.data=4",
                                 "model.scan_layers=false"],
    "stage4-virtual2-m8-remat": ["parallel.stage=4", "parallel.virtual_stages=2", "parallel.data=2",
                                 "train.num_microbatches=8", "model.remat=full"],
    "stage2-tensor2-data2-sp": ["parallel.stage=2", "parallel.tensor=2", "parallel.data=2",
                                "parallel.sequence_parallel=true"],
    "stage2-fsdp2-virtual2-zero1": ["parallel.stage=2", "parallel.fsdp=2", "parallel.data=2",
                                    "parallel.virtual_stages=2", "parallel.shard_optimizer=true"],
}


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pipeline_matches_single_device(layout, schedule, single_device, tmp_path):
    got = fit(BASE, LAYOUTS[layout] + [f"parallel.pipeline_schedule={schedule}"], 8, tmp_path)
    assert_matches(got, single_device)


@pytest.mark.parametrize("overrides, message", [
    (["parallel.stage=4", "parallel.data=2", "model.num_layers=6"], "model.num_layers=6 is not divisible by parallel.stage=4"),
    (["parallel.stage=2", "parallel.virtual_stages=2", "parallel.data=4", "model.num_layers=6"],
     "not divisible by parallel.stage=2 x parallel.virtual_stages=2"),
    (["parallel.stage=4", "parallel.virtual_stages=2", "parallel.data=2", "train.num_microbatches=6",
      "train.global_batch_size=12"], "must be a multiple of parallel.stage=4"),
    (["parallel.stage=4", "parallel.data=2", "train.num_microbatches=2"], "cannot fill parallel.stage=4"),
    (["parallel.stage=2", "parallel.data=4", "train.num_microbatches=3"], "not divisible by train.num_microbatches=3"),
    (["parallel.stage=2", "parallel.data=4", "train.num_microbatches=4", "train.micro_batch_size=2"],
     "!= train.global_batch_size=16"),
    (["parallel.virtual_stages=2"], "needs pipeline stages"),
], ids=["layers-by-stage", "layers-by-chunks", "m-by-stage-interleaved", "m-below-stage", "batch-by-m",
        "micro-and-m-disagree", "virtual-without-stages"])
def test_bad_pipeline_layouts_are_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_degrees(load_config(None, BASE + overrides), 8)
