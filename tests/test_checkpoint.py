"""Checkpoints: exact resume, resume on other layouts and device counts, signals, crashes, corruption, data-order
changes, NaN policy."""
import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mlm_jax import Trainer, load_config
from mlm_jax.checkpoint.state import CheckpointError, checkpoint_steps
from mlm_jax.checkpoint.weights import save_weights
from mlm_jax.config import ConfigError
from mlm_jax.train.loop import TrainingStopped

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = ["train.log_every=1", "train.eval_every=0", "train.global_batch_size=8", "train.seq_len=32",
        "log.progress=never", "data.max_bytes=2000000"]
FP32 = ["model.dtype=float32", "optim.warmup_steps=0", "optim.lr=1e-2"]


def trainer(tmp, *overrides, devices=8):
    cfg = load_config(None, BASE + [f"train.output_dir={tmp}", *overrides])
    return Trainer(cfg, devices=jax.devices()[:devices])


def losses(records):
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def test_resume_is_bit_exact(tmp_path):
    run = ["train.steps=6", "checkpoint.every=3", "parallel.data=2"]
    full = losses(trainer(tmp_path / "full", *run, devices=2).fit())
    first = trainer(tmp_path / "split", *run, devices=2).fit(steps=3)
    assert checkpoint_steps(str(tmp_path / "split" / "checkpoints")) == [3]
    resumed = trainer(tmp_path / "split", *run, devices=2)
    assert int(resumed.state.step) == 3
    second = losses(resumed.fit())
    assert losses(first) == {k: full[k] for k in (1, 2, 3)}
    assert second == {k: full[k] for k in (4, 5, 6)}  # identical floats, not approximately equal


def _chain(tmp_path, layouts, devices):
    """Two steps under each layout in turn, resuming from the previous layout's checkpoint."""
    run = tmp_path / "chain"
    got = {}
    for i, (layout, n) in enumerate(zip(layouts, devices)):
        t = trainer(run, "train.steps=6", "checkpoint.every=2", *FP32, *layout, devices=n)
        assert int(t.state.step) == 2 * i
        got.update(losses(t.fit(steps=2)))
    return got


def _assert_close(got, ref):
    steps = sorted(ref)
    np.testing.assert_allclose([got[s] for s in steps], [ref[s] for s in steps], rtol=1e-5)


def test_resume_across_layouts_matches_uninterrupted_run(tmp_path):
    ref = losses(trainer(tmp_path / "ref", "train.steps=6", *FP32, "parallel.data=8").fit())
    layouts = [["parallel.data=8"], ["parallel.data=2", "parallel.fsdp=2", "parallel.tensor=2"],
               ["parallel.data=2", "parallel.tensor=4", "parallel.sequence_parallel=true",
                "parallel.shard_optimizer=true"]]
    _assert_close(_chain(tmp_path, layouts, [8, 8, 8]), ref)


def test_resume_between_pipelined_and_plain_layouts_matches_uninterrupted_run(tmp_path):
    ref = losses(trainer(tmp_path / "ref", "train.steps=6", *FP32, "parallel.data=8").fit())
    layouts = [["parallel.data=8"], ["parallel.stage=2", "parallel.data=4"],
               ["parallel.stage=2", "parallel.virtual_stages=2", "parallel.fsdp=2", "parallel.data=2",
                "parallel.pipeline_schedule=gpipe"]]
    _assert_close(_chain(tmp_path, layouts, [8, 8, 8]), ref)


def test_resume_on_fewer_devices_matches_uninterrupted_run(tmp_path):
    ref = losses(trainer(tmp_path / "ref", "train.steps=6", *FP32, "parallel.data=8").fit())
    layouts = [["parallel.stage=2", "parallel.data=4"], ["parallel.data=2", "parallel.fsdp=2"], ["parallel.data=1"]]
    _assert_close(_chain(tmp_path, layouts, [8, 4, 1]), ref)


def _garble(step_dir):
    for root, _, files in os.walk(step_dir / "params"):
        for f in files:
            with open(os.path.join(root, f), "wb") as fh:
                fh.write(b"garbage")


def _params(t):
    return jax.tree.leaves(jax.device_get(t.state.params))


def test_unreadable_latest_checkpoint_is_moved_aside_and_written_again(tmp_path, capsys):
    run = ["train.steps=4", "checkpoint.every=2", "parallel.data=2"]
    full = trainer(tmp_path / "full", *run, devices=2)
    full.fit()
    trainer(tmp_path / "run", *run, devices=2).fit()
    ckdir = tmp_path / "run" / "checkpoints"
    assert checkpoint_steps(str(ckdir)) == [2, 4]
    _garble(ckdir / "4")
    capsys.readouterr()

    resumed = trainer(tmp_path / "run", *run, devices=2)
    assert int(resumed.state.step) == 2
    out = capsys.readouterr().out
    (aside,) = ckdir.glob("4.unreadable-*")
    assert checkpoint_steps(str(ckdir)) == [2]  # the moved one is not a step
    assert (f"warning: checkpoint {ckdir}/4 is unreadable (" in out
            and f"); moved aside to {aside}; resuming from {ckdir}/2\n" in out), out
    assert {(aside / "params" / f).read_bytes() for f in os.listdir(aside / "params")
            if (aside / "params" / f).is_file()} == {b"garbage"}  # kept as it was
    resumed.fit()
    assert checkpoint_steps(str(ckdir)) == [2, 4]
    for got, want in zip(_params(resumed), _params(full), strict=True):
        np.testing.assert_array_equal(got, want)

    capsys.readouterr()
    again = trainer(tmp_path / "run", *run, devices=2)  # the new step 4 is complete and readable
    assert int(again.state.step) == 4 and "warning" not in capsys.readouterr().out
    for got, want in zip(_params(again), _params(full), strict=True):
        np.testing.assert_array_equal(got, want)


def test_unreadable_checkpoint_of_init_from_is_skipped_and_left_in_place(tmp_path, capsys):
    trainer(tmp_path / "a", "train.steps=4", "checkpoint.every=2", "parallel.data=2", devices=2).fit()
    source = tmp_path / "a" / "checkpoints"
    _garble(source / "4")
    fresh = trainer(tmp_path / "b", "train.steps=2", "parallel.data=2", f"checkpoint.init_from={source}", devices=2)
    assert int(fresh.state.step) == 0
    assert f"warning: checkpoint {source}/4 is unreadable (" in capsys.readouterr().out
    assert sorted(p.name for p in source.iterdir() if "unreadable" in p.name) == []
    assert checkpoint_steps(str(source)) == [2, 4]


def _file_hashes(root):
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


def test_resuming_with_another_seed_is_refused_and_writes_nothing(tmp_path):
    first = _cli(tmp_path, "train.steps=2")
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    before = _file_hashes(tmp_path)
    refused = _cli(tmp_path, "train.steps=4", "train.seed=1")
    out, err = refused.communicate(timeout=300)
    ck = tmp_path / "checkpoints" / "2"
    assert refused.returncode == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: checkpoint.resume: {ck} was written with train.seed=0; this run has train.seed=1: "
                          f"resuming would change the data order (set checkpoint.allow_data_change=true"), err
    assert _file_hashes(tmp_path) == before


def test_data_change_is_refused_unless_allowed_and_a_new_batch_size_is_reported(tmp_path, capsys):
    trainer(tmp_path, "train.steps=2", "parallel.data=2", devices=2).fit()
    ck = tmp_path / "checkpoints"
    with pytest.raises(ConfigError, match=r"was written with data.max_bytes=2000000; this run has "
                                          r"data.max_bytes=1000000: resuming would change the data order"):
        trainer(tmp_path, "train.steps=4", "data.max_bytes=1000000", devices=2)
    allowed = trainer(tmp_path, "train.steps=4", "train.seed=1", "checkpoint.allow_data_change=true", devices=2)
    assert int(allowed.state.step) == 2 and allowed.resumed_from == f"{ck}/2 (train.seed 0 -> 1)"
    new_run = trainer(tmp_path / "new", "train.seed=1", f"checkpoint.init_from={ck}", devices=2)  # weights only
    assert int(new_run.state.step) == 0 and new_run.resumed_from is None
    bigger = trainer(tmp_path, "train.steps=3", "train.global_batch_size=16", "parallel.data=2", devices=2)
    assert int(bigger.state.step) == 2
    capsys.readouterr()
    bigger.fit()
    assert f"resumed from {ck}/2 (train.global_batch_size 8 -> 16)\n" in capsys.readouterr().out
    assert checkpoint_steps(str(ck)) == [2, 3]


def test_init_from_takes_weights_only(tmp_path):
    source = trainer(tmp_path / "a", "train.steps=2")
    source.fit()
    fresh = trainer(tmp_path / "b", "train.steps=2", f"checkpoint.init_from={tmp_path / 'a' / 'checkpoints'}")
    assert int(fresh.state.step) == 0
    np.testing.assert_array_equal(jax.device_get(fresh.state.params["head"]["kernel"]),
                                  jax.device_get(source.state.params["head"]["kernel"]))
    assert all(float(jnp.abs(m).max()) == 0 for m in jax.tree.leaves(fresh.state.opt_state[1][0].mu))


def test_nan_policy_stop_saves_and_raises(tmp_path):
    t = trainer(tmp_path, "train.steps=4", "train.nan_policy=stop")
    params = t.state.params
    good = jax.device_get(params["head"]["kernel"])
    t.state = t.state._replace(params=dict(params, final_norm={"scale": params["final_norm"]["scale"] * jnp.nan}))
    with pytest.raises(TrainingStopped, match="non-finite loss or gradient in step 1"):
        t.fit()
    assert checkpoint_steps(str(tmp_path / "checkpoints")) == [1]
    np.testing.assert_array_equal(jax.device_get(t.state.params["head"]["kernel"]), good)


def test_save_false_writes_no_checkpoint_unless_asked(tmp_path):
    t = trainer(tmp_path / "a", "train.steps=2", "checkpoint.save=false", devices=1)
    t.fit()
    assert not (tmp_path / "a" / "checkpoints").exists()
    t.save()
    t.checkpointer.wait()
    assert checkpoint_steps(str(tmp_path / "a" / "checkpoints")) == [2]
    t = trainer(tmp_path / "b", "train.steps=2", "checkpoint.save=false", "train.nan_policy=stop", devices=1)
    t.state = t.state._replace(params=dict(t.state.params, final_norm={"scale": t.state.params["final_norm"]["scale"]
                                                                       * jnp.nan}))
    with pytest.raises(TrainingStopped, match=r"in step 1 .*, no checkpoint written \(checkpoint.save=false\)"):
        t.fit()
    assert not (tmp_path / "b" / "checkpoints").exists()


def _cli(tmp_path, *args):
    return subprocess.Popen([sys.executable, "-m", "mlm_jax.train", *BASE, f"train.output_dir={tmp_path}", *args],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_step(proc, step):
    for line in proc.stdout:
        if line.startswith(f"step {step}/"):
            return
    raise AssertionError(f"no step {step}: {proc.stderr.read()}")


def _logged_losses(run_dir):
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in lines if "loss" in r]


@pytest.fixture(scope="module")
def uninterrupted_cli_run(tmp_path_factory):
    """The losses of 12 steps through the CLI, uninterrupted."""
    run_dir = tmp_path_factory.mktemp("full")
    full = _cli(run_dir, "train.steps=12")
    assert full.wait(timeout=300) == 0, full.stderr.read()
    return _logged_losses(run_dir)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_saves_and_exits_0_then_the_cli_resumes_bit_exactly(tmp_path, sig, uninterrupted_cli_run):
    steps = "train.steps=12"
    proc = _cli(tmp_path / "split", steps)
    _wait_for_step(proc, 2)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert f"received {sig.name}: saved checkpoint at step" in out
    saved = checkpoint_steps(str(tmp_path / "split" / "checkpoints"))
    assert len(saved) == 1 and f"step {saved[0]} to " in out and saved[0] < 12
    again = _cli(tmp_path / "split", steps)
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0 and f"resumed from {tmp_path / 'split' / 'checkpoints'}/{saved[0]}" in out, err
    assert _logged_losses(tmp_path / "split") == uninterrupted_cli_run


def test_cli_resumes_a_run_under_other_layouts_with_the_same_losses(tmp_path):
    """Through the CLI: 2 steps under data=8, then 2 under data=2,fsdp=2,tensor=2, then 2 under tensor=4 with
    sequence parallelism and ZeRO-1 (a constant learning rate, so stopping early does not change the schedule)."""
    run = [*FP32, "optim.schedule=constant"]
    full = _cli(tmp_path / "full", *run, "train.steps=6", "parallel.data=8")
    assert full.wait(timeout=300) == 0, full.stderr.read()
    for steps, layout in [(2, ["parallel.data=8"]),
                          (4, ["parallel.data=2", "parallel.fsdp=2", "parallel.tensor=2"]),
                          (6, ["parallel.data=2", "parallel.tensor=4", "parallel.sequence_parallel=true",
                               "parallel.shard_optimizer=true"])]:
        proc = _cli(tmp_path / "split", *run, f"train.steps={steps}", *layout)
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
    got, ref = dict(_logged_losses(tmp_path / "split")), dict(_logged_losses(tmp_path / "full"))
    assert sorted(got) == sorted(ref) == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose([got[s] for s in range(1, 7)], [ref[s] for s in range(1, 7)], rtol=1e-5)


def test_a_failing_save_is_a_clear_error_and_keeps_earlier_checkpoints(tmp_path, monkeypatch):
    t = trainer(tmp_path, "train.steps=4", "checkpoint.every=2")
    t.fit(steps=2)
    assert checkpoint_steps(str(tmp_path / "checkpoints")) == [2]

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(t.checkpointer.manager, "save", disk_full)
    with pytest.raises(CheckpointError, match="saving step 4 to .* failed: No space left on device; earlier"):
        t.fit()
    assert checkpoint_steps(str(tmp_path / "checkpoints")) == [2]


def test_sigkill_during_async_saves_never_leaves_a_checkpoint_resume_would_pick(tmp_path):
    proc = _cli(tmp_path, "train.steps=10000", "checkpoint.every=1", "checkpoint.keep=2")
    _wait_for_step(proc, 3)
    time.sleep(0.3)
    proc.kill()
    proc.communicate()
    ckdir = tmp_path / "checkpoints"
    # a save cut short stays a temporary directory, never listed as a step
    (ckdir / "999.orbax-checkpoint-tmp-1").mkdir()
    steps = checkpoint_steps(str(ckdir))
    assert steps and 999 not in steps
    resumed = trainer(tmp_path, "train.steps=10000", "checkpoint.every=1")
    assert int(resumed.state.step) == steps[-1]


def test_uncreatable_checkpoint_dir_is_a_one_line_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    proc = _cli(tmp_path, "train.steps=2", f"checkpoint.dir={blocker}/ck")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and err.startswith("error: checkpoint.dir=") and err.count("\n") == 1, err


def test_resuming_a_weights_only_checkpoint_is_refused_and_moves_nothing(tmp_path):
    """A converted model (params and meta only) in the run's own checkpoint directory is not a damaged checkpoint."""
    t = trainer(tmp_path, "train.steps=2")
    save_weights(str(tmp_path / "checkpoints"), jax.tree.map(jnp.asarray, jax.device_get(t.state.params)),
                 {"step": 0, "config": t.cfg.to_dict()})
    with pytest.raises(ConfigError, match=r"checkpoints/0 holds weights only .* checkpoint\.init_from="):
        trainer(tmp_path, "train.steps=2")
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["0"]


def test_resume_none_over_existing_checkpoints_is_refused(tmp_path):
    """Their steps would not be saved again (a save at an existing step is skipped): the new run's end would be lost."""
    trainer(tmp_path, "train.steps=2").fit()
    with pytest.raises(ConfigError, match=r"checkpoint\.resume=none, but checkpoint\.dir=.* already holds steps \[2\]"):
        trainer(tmp_path, "train.steps=2", "checkpoint.resume=none")


def test_another_model_shape_is_refused_in_one_line_naming_the_keys_and_writes_nothing(tmp_path):
    """Resuming or starting from weights of other shapes is one line naming the model keys that differ, exit 2,
    before any array is read; a missing `init_from` too."""
    run = tmp_path / "run"
    trainer(run, "train.steps=2", devices=1).fit()
    before = _file_hashes(run)
    refused = _cli(run, "train.steps=4", "model.hidden_size=96")
    out, err = refused.communicate(timeout=300)
    assert refused.returncode == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: checkpoint.resume: {run / 'checkpoints'}/2 holds weights of another model "
                          f"(model.hidden_size=128 there, 96 here; blocks.attn.k.kernel is (4, 128, 4, 32) there and "
                          f"(4, 96, 4, 24) here"), err
    assert "another train.output_dir" in err and "Traceback" not in err
    assert _file_hashes(run) == before
    with pytest.raises(ConfigError, match=r"checkpoint\.init_from: .* holds weights of another model "
                                          r"\(model\.hidden_size=128 there, 96 here; "):
        trainer(tmp_path / "new", "model.hidden_size=96", f"checkpoint.init_from={run}", devices=1)  # a run dir
    assert not (tmp_path / "new").exists()
    missing = _cli(tmp_path / "other", "checkpoint.init_from=/nonexistent/run")
    out, err = missing.communicate(timeout=300)
    assert missing.returncode == 2 and err == "error: checkpoint.init_from=/nonexistent/run: no checkpoint found there\n"
    assert not (tmp_path / "other").exists()
