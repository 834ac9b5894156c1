"""The memory report: per-device bytes of the weights and optimizer state by their shardings, the compiled step's
footprint, and the refusal of a step that needs more than a device has, before that step runs."""
import math

import jax
import pytest

from mlm_jax import Trainer, load_config
from mlm_jax.config import ConfigError
from mlm_jax.train import loop, memory

BASE = ["train.steps=2", "train.log_every=1", "train.eval_every=0", "train.global_batch_size=8",
        "train.seq_len=32", "log.progress=never", "data.max_bytes=2000000", "log.tensorboard=false"]


def trainer(tmp_path, *overrides):
    return Trainer(load_config(None, BASE + [f"train.output_dir={tmp_path}", *overrides]), devices=jax.devices())


def test_the_report_follows_the_shardings_and_the_compiled_step(tmp_path, capsys):
    replicated, sharded = trainer(tmp_path / "dp", "parallel.data=8"), trainer(tmp_path / "fsdp", "parallel.fsdp=8")
    whole = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(replicated.state.params))
    replicated.fit(1)
    sharded.fit(1)
    dp, fsdp = replicated.memory, sharded.memory
    assert dp.params == whole and dp.optimizer >= 2 * whole  # AdamW's two moments per weight
    assert fsdp.params < whole / 4 and fsdp.optimizer < dp.optimizer / 4
    for report in (dp, fsdp):
        assert report.total >= report.params + report.optimizer + report.temporaries > 0
        assert report.capacity is None  # the CPU reports none
    out = capsys.readouterr().out
    assert f"memory per device: parameters {dp.params / 2**30:.2f} GiB, optimizer state " in out


def test_a_step_that_cannot_fit_is_refused_before_it_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(loop, "capacity", lambda devices: 2**20)
    t = trainer(tmp_path, "parallel.data=8", "log.tensorboard=true")
    with pytest.raises(ConfigError, match=r"^the run does not fit: memory per device: parameters .* GiB; the step "
                                          r"[0-9.]+ GiB of 0\.0 GiB: shard the weights .* lower "
                                          r"train\.micro_batch_size$"):
        t.fit()
    assert t._state is None  # refused from the step's shapes, before a new run's weights are made
    assert int(t.state.step) == 0 and not (tmp_path / "metrics.jsonl").exists()
    assert not (tmp_path / "tensorboard").exists()


def test_a_step_whose_compilation_runs_out_of_memory_is_refused_in_one_line(tmp_path):
    t = trainer(tmp_path, "parallel.data=8")
    oom = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Failed to get configs for: 5 out of 120 instructions.\n"
                                     "Out of memory while trying to allocate 15.67GiB with allocator GPU_0_bfc")

    class Step:  # the jitted step, as a compilation that runs out of memory leaves it
        def lower(self, *args):
            return self

        def compile(self):
            raise oom
    t._train_step = Step()
    with pytest.raises(ConfigError, match=r"^the run does not fit: compiling the step ran out of device memory "
                                          r"\(Out of memory while trying to allocate 15\.67GiB with allocator "
                                          r"GPU_0_bfc\); parameters [0-9.]+ GiB and optimizer state [0-9.]+ "
                                          r"GiB per device: shard the weights .* train\.micro_batch_size$"):
        t.fit()
    assert not (tmp_path / "metrics.jsonl").exists()
    assert memory.compile_refusal(jax.errors.JaxRuntimeError("INTERNAL: a crash"), t.state, jax.devices()) is None
