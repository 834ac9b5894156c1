"""The layout planner on 8 fake CPU devices: the layouts it ranks train, its memory figure is the one a run reports,
a layout it says does not fit is refused at a run's start, what validation refuses comes back with the reason, and a
second plan reads its compilations from the cache."""
import json
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor

import jax
import pytest

from mlm_jax import Trainer, load_config
from mlm_jax.config import ConfigError
from mlm_jax.plan import search as search_module
from mlm_jax.plan import space
from mlm_jax.plan.calibrate import calibrate, pieces
from mlm_jax.plan.cli import main
from mlm_jax.plan.collectives import Collective, Links, seconds
from mlm_jax.plan.compiled import QUIET, Compiled, compile_layout, probe_depths
from mlm_jax.plan.hardware import GIB, gpu
from mlm_jax.plan.search import Cache, search
from mlm_jax.plan.target import Target
from mlm_jax.plan.timing import Fit, Table, estimate
from mlm_jax.train import loop
from mlm_jax.train.memory import MemoryReport

# four splits (data x fsdp over 8 devices), one setting each unless it does not fit
FIXED = ["parallel.stage=1", "parallel.context=1", "parallel.tensor=1", "train.global_batch_size=8",
         "train.seq_len=64", "data.max_bytes=2000000"]
H200 = gpu("h200")
LINKS = Links(8, H200.nvlink_bandwidth, H200.network_bandwidth, H200.nvlink_latency, H200.network_latency)


def plan(tmp_path, capacity: int, jobs: int = 1, cache: str = "cache"):
    return search(None, FIXED, Target(H200, 8, cpu=True), LINKS, Table("h200"), Cache(str(tmp_path / cache)),
                  capacity, ("none",), jobs=jobs)


def run(tmp_path, overrides, name):
    return Trainer(load_config(None, [*FIXED, *overrides, "train.steps=2", "train.log_every=1",
                                      "train.eval_every=0", "log.progress=never", "log.tensorboard=false",
                                      f"train.output_dir={tmp_path / name}"]), devices=jax.devices())


def test_the_plan_ranks_layouts_that_train_and_refuses_what_does_not_fit(tmp_path, monkeypatch):
    roomy = plan(tmp_path, 100 * GIB)
    assert [c.split.describe() for c in roomy] and all(c.fits for c in roomy)
    assert {c.split.describe() for c in roomy} == {"data8", "data4 fsdp2", "data2 fsdp4", "fsdp8"}
    times = [c.estimate.step_time_s for c in roomy]
    assert times == sorted(times) and all(t > 0 for t in times)
    for i, c in enumerate(roomy):  # every ranked layout trains, and reports the planner's memory figure
        trainer = run(tmp_path, c.overrides, f"ranked{i}")
        records = trainer.fit()
        assert len(records) == 2 and all(r["loss"] == r["loss"] for r in records)
        assert trainer.memory.total == c.compiled.memory.total

    # two processes compiling the splits at once (a cache of their own) rank the same layouts with the same figures
    parallel = plan(tmp_path, 100 * GIB, jobs=2, cache="cache2")
    assert [(c.overrides, c.compiled, c.estimate) for c in parallel] == [(c.overrides, c.compiled, c.estimate)
                                                                         for c in roomy]

    # under a cap between the replicated layout and the sharded one, what fits is within it; under a cap below
    # every layout, each is refused with what it would need, and a run of one of them is refused at its start
    totals = {c.split.describe(): c.compiled.memory.total for c in roomy}
    assert totals["fsdp8"] < totals["data8"]
    between = plan(tmp_path, (totals["fsdp8"] + totals["data8"]) // 2)
    assert all(c.compiled.memory.total <= (totals["fsdp8"] + totals["data8"]) // 2 for c in between if c.fits)
    assert any(c.fits for c in between)
    cap = min(totals.values()) // 4
    capped = plan(tmp_path, cap)
    assert not any(c.fits for c in capped)
    refused = next(c for c in capped if c.split.describe() == "data8")
    assert refused.reason.startswith("does not fit by ") and refused.compiled.memory.total > cap
    monkeypatch.setattr(loop, "capacity", lambda devices: cap)  # a device of that size
    with pytest.raises(ConfigError, match="^the run does not fit: "):
        run(tmp_path, refused.overrides, "refused").fit()


def test_the_search_takes_the_first_setting_that_fits_without_compiling_them_all(monkeypatch):
    given = [*FIXED, "parallel.fsdp=8", "parallel.data=1", "train.global_batch_size=64"]
    base = load_config(None, given)
    (split,) = space.splits(base, 8, 8, space.fixed(given))
    order = space.settings(base, split, ("none",))
    assert [s.micro_batch for s in order] == [8, 8, 4, 4, 2, 2, 1, 1]  # each in one piece, then 4 loss chunks
    total = {s: compile_layout(load_config(None, [*given, *split.overrides, *s.overrides, *QUIET]), jax.devices(),
                               None).memory.total for s in order}
    cap = total[order[4]]  # micro batch 2 in one piece fits, 4 does not
    assert all(total[s] > cap for s in order[:4])
    calls = []
    monkeypatch.setattr(search_module, "compile_layout", lambda *a, **k: calls.append(a) or compile_layout(*a, **k))
    (found,) = search(None, given, Target(H200, 8, cpu=True), LINKS, Table("h200"), Cache(None), cap, ("none",))
    assert found.setting == order[4] and found.compiled.memory.total == cap
    assert len(calls) < len(order)


def test_refusals_come_back_with_their_reason_and_bad_input_exits_2(tmp_path, capsys):
    out = tmp_path / "plan.jsonl"
    # K/V heads 3 on 2 tensor ranks: validation refuses every split, the JSON says why, and nothing is ranked
    args = ["--gpus", "8", "--cpu", "--remat", "none", "--json", str(out), "--no-cache", "parallel.stage=1",
            "parallel.context=1", "parallel.tensor=2", "parallel.fsdp=1", "model.num_heads=6", "model.num_kv_heads=3",
            "model.hidden_size=96", "train.global_batch_size=8", "train.seq_len=64"]
    assert main(args) == 1
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert records and not any(r["fits"] for r in records)
    assert all("model.num_kv_heads=3 and parallel.tensor=2" in r["reason"] for r in records)
    assert "not taken (1):" in capsys.readouterr().out
    assert main(["--gpus", "8", "--cpu", "--gpu", "h300"]) == 2
    assert "invalid choice: 'h300'" in capsys.readouterr().err
    assert main(["--gpus", "8", "--cpu", "model.remat=sometimes"]) == 2
    assert "model.remat" in capsys.readouterr().err
    assert main(["--gpus", "8", "--cpu", "--jobs", "0"]) == 2
    assert "--jobs 0: at least 1" in capsys.readouterr().err
    assert main(["calibrate", "--gpus", "1", "--layers", "4", "2"]) == 2
    assert "--layers 4 2: two depths" in capsys.readouterr().err


def test_a_calibrated_piece_prices_the_steps_it_was_measured_at(tmp_path):
    steps = {(2, 1): 0.010, (2, 2): 0.018, (4, 1): 0.016, (4, 2): 0.029}
    fit = Fit.from_steps((2, 4), steps, (1000, 1600))
    for (n, M), t in steps.items():  # the four measurements, back from the fit
        assert fit.a + fit.b * n + (M - 1) * (fit.c + fit.d * n) == pytest.approx(t, rel=1e-12)
    assert (fit.weights0, fit.weights_per_layer) == (400, 300)

    # a real calibration on one CPU device, then the one-device layout at a measured depth priced from it
    overrides = ["model.num_layers=2", "train.global_batch_size=4", "train.seq_len=32", "data.max_bytes=2000000"]
    todo = pieces(None, overrides, [["train.num_microbatches=1"]], 1)
    table = calibrate(None, overrides, todo, Table("h200"), steps=2, warmup=1, log=lambda *_: None)
    (key, got), = table.fits.items()
    assert key == next(iter(todo)) and table.meta["device"] == jax.devices()[0].device_kind
    assert got.weights_per_layer > 0  # (its times are whatever this CPU measured: no sign asserted)
    devices = jax.devices()[:1]
    cfg = load_config(None, [*overrides, *QUIET, "train.num_microbatches=1", "train.output_dir=" + str(tmp_path)])
    compiled = compile_layout(cfg, devices, None)
    e = estimate(cfg, compiled, table, H200, LINKS)
    assert e.calibrated and e.exposed_s == {}
    # one device holds the weights the calibration measured at this depth: the optimizer's part cancels
    assert e.step_time_s == pytest.approx(got.a + 2 * got.b, rel=1e-9)


def test_a_deep_model_probed_at_two_shallower_depths_matches_its_whole_compilation():
    overrides = [*FIXED, "parallel.data=2", "parallel.fsdp=4", "model.num_layers=24", *QUIET]
    cfg = load_config(None, overrides)
    assert probe_depths(cfg, 1) == (4, 8)
    deep = load_config(None, [*FIXED, "model.num_layers=80"])
    assert probe_depths(deep, 1) == (12, 24) and probe_depths(deep, 8) == (16, 32)  # an eighth of the model, or more
    probed, whole = (compile_layout(cfg, jax.devices(), None, probe=p) for p in (True, False))
    assert probed.memory.params == whole.memory.params and probed.memory.optimizer == whole.memory.optimizer
    assert probed.memory.total == pytest.approx(whole.memory.total, rel=0.05)
    sent = [sum(c.bytes * c.count for c in x.collectives) for x in (probed, whole)]
    assert sent[0] == pytest.approx(sent[1], rel=0.05)
    # a probe already over the capacity is not extrapolated: that depth's own figures, and the depth
    capacity = whole.memory.params + whole.memory.optimizer + 1  # the weights fit, a probe's step does not
    over = compile_layout(cfg, jax.devices(), capacity, probe=True)
    assert over.over_at in (4, 8)
    at = compile_layout(load_config(None, [*overrides, f"model.num_layers={over.over_at}"]), jax.devices(), None)
    assert capacity < over.memory.total == at.memory.total < whole.memory.total


def test_every_collective_adds_its_time_those_beside_compute_shown_apart():
    cfg = load_config(None, [*FIXED, "parallel.data=2", "parallel.fsdp=4", *QUIET])
    degrees = {"stage": 1, "data": 2, "fsdp": 4, "context": 1, "expert": 1, "tensor": 1}
    beside = Collective("all-gather", 2**24, 4, ((0, 1, 2, 3), (4, 5, 6, 7)), 3, "body", overlapped=True)
    waits = Collective("all-reduce", 2**20, 8, (tuple(range(8)),), 1, "main")
    compiled = Compiled(degrees, 1, MemoryReport(2**20, 2**21, 2**22, 2**23, None),
                        (beside, waits), 1e9, 10**6, None)
    e = estimate(cfg, compiled, Table("h200"), H200, LINKS)
    assert e.exposed_s == {"intra-node beside compute": seconds(beside, LINKS), "intra-node": seconds(waits, LINKS)}
    assert e.step_time_s == pytest.approx(e.compute_s + seconds(beside, LINKS) + seconds(waits, LINKS), rel=1e-12)


def test_search_processes_end_with_a_planner_killed_by_a_signal():
    """A planner ended by SIGKILL or SIGTERM runs no clean-up; its search processes must not compile on for nobody."""
    context = multiprocessing.get_context("spawn")
    pids = context.Queue()
    planner = context.Process(target=_planner, args=(pids,))
    planner.start()
    worker = pids.get(timeout=120)
    planner.kill()
    planner.join()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and _running(worker):
        time.sleep(0.2)
    assert not _running(worker)


def _planner(pids) -> None:
    """A planner's pool as `search` makes it, busy with a long task."""
    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                               initializer=search_module._exit_with, initargs=(os.getpid(),))
    pids.put(pool.submit(os.getpid).result())
    pool.submit(time.sleep, 120)
    time.sleep(120)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False
