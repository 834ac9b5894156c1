"""Context parallelism computes the same function as one device: both strategies, cp = 2, 4, 8, and composed with
data + tensor + sequence parallelism and with pipeline stages. fp32, 3 steps of AdamW: loss within 1e-5, every
parameter leaf's gradient within 1e-4 relative."""
import pytest

from layouts import assert_matches, fit, reference
from mlm_jax import load_config
from mlm_jax.config import ConfigError
from mlm_jax.validation.plan import check_degrees

BASE = ["model.dtype=float32", "model.num_layers=2", "model.num_kv_heads=2", "train.steps=3", "train.log_every=1",
        "train.eval_every=0", "train.global_batch_size=8", "train.seq_len=64", "log.progress=never", "optim.warmup_steps=0",
        "optim.lr=1e-2", "data.max_bytes=2000000", "checkpoint.resume=none", "checkpoint.save=false"]


@pytest.fixture(scope="module")
def single_device(tmp_path_factory):
    return reference(BASE, ["parallel.data=1"], tmp_path_factory.mktemp("ref"))


@pytest.mark.parametrize("strategy", ["allgather", "ring"])
@pytest.mark.parametrize("cp", [2, 4, 8])
def test_context_parallel_matches_single_device(cp, strategy, single_device, tmp_path):
    layout = [f"parallel.context={cp}", f"parallel.data={8 // cp}", f"parallel.context_strategy={strategy}"]
    assert_matches(fit(BASE, layout, 8, tmp_path), single_device)


@pytest.mark.parametrize("strategy", ["allgather", "ring"])
def test_context2_tensor2_data2_sequence_parallel_matches_single_device(strategy, single_device, tmp_path):
    layout = ["parallel.context=2", "parallel.tensor=2", "parallel.data=2", "parallel.sequence_parallel=true",
              f"parallel.context_strategy={strategy}"]
    assert_matches(fit(BASE, layout, 8, tmp_path), single_device)


@pytest.mark.parametrize("strategy, schedule", [("allgather", "1f1b"), ("ring", "zb1")])  # each strategy, each
# schedule (a schedule's stage program runs the attention kernel the strategy installs, whichever the schedule)
def test_context2_with_pipeline_stages_matches_single_device(strategy, schedule, single_device, tmp_path):
    layout = ["parallel.context=2", "parallel.stage=2", "parallel.data=2", f"parallel.context_strategy={strategy}",
              f"parallel.pipeline_schedule={schedule}"]
    assert_matches(fit(BASE, layout, 8, tmp_path), single_device)


@pytest.mark.parametrize("overrides, message", [
    (["parallel.context=4", "parallel.data=2", "train.seq_len=36"], "not divisible by 2 x parallel.context=4"),
    (["parallel.context=2", "parallel.data=4", "model.attention_impl=te"], "cannot serve parallel.context > 1"),
    (["parallel.context_strategy=zigzag"], "expected one of allgather, ring"),
], ids=["seq-by-2cp", "te-attention", "strategy"])
def test_bad_context_layouts_are_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_degrees(load_config(None, BASE + overrides), 8)
