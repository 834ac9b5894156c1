"""Several processes on one machine, each with fake CPU devices: a multi-host run in miniature.

Two processes log the losses of one, only process 0 writes, a checkpoint of one layout resumes in another, a dead
process stops the others, and bad multi-process flags are one error line.
"""
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import FAST_COMPILE

from mlm_jax import load_config
from mlm_jax.parallel import distributed
from mlm_jax.validation.plan import resolve_degrees

REPO = Path(__file__).resolve().parents[1]
LAUNCH = str(REPO / "scripts" / "launch_local.sh")
# The tiny model in fp32 with a constant learning rate: a run of 5 steps then 3 more, in any layout, is the run of 8.
RUN = ["model.dtype=float32", "optim.schedule=constant", "optim.warmup_steps=0", "optim.lr=1e-2",
       "train.global_batch_size=8", "train.seq_len=32", "train.log_every=1", "train.eval_every=0",
       "data.max_bytes=2000000", "log.progress=never"]
HYBRID = ["parallel.data=1", "parallel.dcn_data=2", "parallel.fsdp=2", "parallel.tensor=2"]  # data across processes


def cpu_env(devices_per_process: int) -> dict:
    return dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices_per_process} {FAST_COMPILE}",
                JAX_PLATFORMS="cpu", PYTHON=sys.executable, PYTHONPATH=str(REPO))


def launch(n: int, args: list[str], cwd: Path, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([LAUNCH, str(n), *args], cwd=cwd, env=cpu_env(8 // n), capture_output=True, text=True,
                          timeout=timeout)


def logged(run_dir: Path, key: str) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if key in r]
    assert len(steps) == len(set(steps)), f"a step logged twice (by two processes?): {steps}"
    return {r["step"]: r[key] for r in records if key in r}


def test_two_processes_log_the_losses_of_one_and_resume_in_another_layout(tmp_path):
    one, evals = tmp_path / "one", ["train.eval_every=5", "train.eval_batches=1"]  # at steps 5 and 8
    ref = launch(1, [*RUN, *evals, "train.steps=8", "parallel.data=2", "parallel.fsdp=2", "parallel.tensor=2",
                     f"train.output_dir={one}"], tmp_path)
    assert ref.returncode == 0, ref.stderr

    first = launch(2, [*RUN, *evals, "train.steps=5", *HYBRID], tmp_path)  # default output dir: runs/tiny-<stamp>
    assert first.returncode == 0, first.stdout + first.stderr
    (run,) = (tmp_path / "runs").iterdir()  # both processes chose process 0's time stamp
    assert "[0] step 5/5" in first.stdout and "[0] mlm_jax: tiny" in first.stdout
    assert not [line for line in first.stdout.splitlines() if line.startswith("[1] ")], first.stdout
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "config.yaml", "metrics.jsonl", "tensorboard"]

    second = launch(2, [*RUN, *evals, "train.steps=8", "parallel.fsdp=8", f"train.output_dir={run}"], tmp_path)
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"[0] resumed from {run}/checkpoints/5" in second.stdout
    for key, steps in (("loss", list(range(1, 9))), ("eval_loss", [5, 8])):
        expected, got = logged(one, key), logged(run, key)
        assert sorted(got) == sorted(expected) == steps
        for step, value in expected.items():
            assert got[step] == pytest.approx(value, rel=1e-5), (key, step)


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_a_dead_process_stops_the_others(tmp_path, how):
    """A killed process closes its connections; a frozen one (a hung or unreachable host) just falls silent."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [*RUN, "train.steps=100000", "parallel.fsdp=8", f"train.output_dir={tmp_path}", "checkpoint.every=0"]
    procs = [subprocess.Popen([sys.executable, "-u", "-m", "mlm_jax.train", "--coordinator", f"127.0.0.1:{port}",
                               "--num-processes", "2", "--process-id", str(i), "--heartbeat-timeout", "5", *args],
                              cwd=REPO, env=cpu_env(4), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    try:
        lines: queue.Queue = queue.Queue()
        reader = threading.Thread(target=lambda: [lines.put(x) for x in procs[0].stdout], daemon=True)
        reader.start()
        seen = []
        while not seen or not seen[-1].startswith("step 2/"):
            seen.append(lines.get(timeout=90))
        procs[1].send_signal(how)
        killed = time.monotonic()
        code = procs[0].wait(timeout=60)
        waited = time.monotonic() - killed
        reader.join(timeout=10)
        output = "".join(seen + list(lines.queue))
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert code != 0 and waited < 60
    # The coordination service misses the heartbeats and ends the process, or (sooner, on CPU) a collective sees
    # the killed peer's connection close and the process leaves with that error.
    died = r"another task died" if how == signal.SIGSTOP else r"another task died|Gloo \w+ failed"
    assert re.search(died, output), output[-2000:]


def test_sigterm_on_one_process_stops_all_on_the_same_logged_step_with_a_checkpoint(tmp_path):
    """Signals are agreed on logged steps only (no host sync on the others): every process stops after the same
    logged step, within one logging interval, and the checkpoint of that step is complete."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [*RUN, "train.steps=100000", "train.log_every=3", "parallel.fsdp=8", f"train.output_dir={tmp_path}",
            "checkpoint.every=0"]
    procs = [subprocess.Popen([sys.executable, "-u", "-m", "mlm_jax.train", "--coordinator", f"127.0.0.1:{port}",
                               "--num-processes", "2", "--process-id", str(i), *args],
                              cwd=REPO, env=cpu_env(4), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    try:
        for line in procs[0].stdout:
            if line.startswith("step 3/"):
                break
        procs[1].send_signal(signal.SIGTERM)
        out0, _ = procs[0].communicate(timeout=120)
        out1, _ = procs[1].communicate(timeout=60)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert procs[0].returncode == 0 and procs[1].returncode == 0, out0 + out1
    saved = re.search(r"received a signal on another process: saved checkpoint at step (\d+)", out0)
    assert saved, out0
    step = int(saved.group(1))
    assert step % 3 == 0 and step >= 3  # a logged step (process 1 may not have reached step 3 at the signal)
    assert (tmp_path / "checkpoints" / str(step)).is_dir()


def test_launcher_prefixes_lines_and_exits_with_the_failing_code(tmp_path):
    result = launch(2, ["parallel.dcn_data=4"], tmp_path, timeout=60)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert sorted(line[:4] for line in errors) == ["[0] ", "[1] "], result.stderr
    assert "parallel.dcn_data=4 multiply to 4, but the devices span 2 process(es)" in errors[0]


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlm_jax.train", *args], cwd=REPO, env=env or dict(os.environ),
                          capture_output=True, text=True, timeout=60)


FLAGS = ["--coordinator", "localhost:1234", "--num-processes", "2", "--process-id", "0"]


@pytest.mark.parametrize("args, expected", [
    pytest.param(["--coordinator", "localhost:1234"], "--num-processes, --process-id missing", id="partial-flags"),
    pytest.param(["--coordinator", "nohost", *FLAGS[2:]], "--coordinator nohost: expected HOST:PORT", id="no-port"),
    pytest.param(["--coordinator", "h:70000", *FLAGS[2:]], "port in 1..65535", id="port-range"),
    pytest.param([*FLAGS[:5], "2"], "--process-id 2 is out of range for --num-processes 2", id="process-id-range"),
    pytest.param([*FLAGS[:3], "0", *FLAGS[4:]], "--num-processes 0: must be at least 1", id="no-processes"),
    pytest.param(["--process-id", "one"], "argument --process-id: invalid int value: 'one'", id="not-an-int"),
    pytest.param(["--local-device-ids", "0,1"], "--local-device-ids needs a multi-process launch", id="ids-alone"),
    pytest.param([*FLAGS, "--local-device-ids", "0,0"], "--local-device-ids 0,0: expected distinct", id="ids"),
    pytest.param([*FLAGS, "--heartbeat-timeout", "0"], "--heartbeat-timeout 0: must be at least 1", id="heartbeat"),
    pytest.param(["parallel.dcn_data=2"], "parallel.dcn_data=2 multiply to 2, but the devices span 1 process(es)",
                 id="dcn-without-processes"),
    pytest.param(["parallel.dcn_fsdp=3"], "parallel.dcn_fsdp=3 multiply to 3, which does not divide the 8 devices",
                 id="dcn-not-dividing"),
])
def test_bad_multi_process_flags_are_one_error_line_and_exit_code_2(args, expected):
    result = run_cli(*args)
    assert "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith("error: ") and result.stderr.strip().count("\n") == 0, result.stderr
    assert expected in result.stderr and result.returncode == 2


def test_dcn_degrees_multiply_the_in_host_degrees():
    cfg = load_config(None, ["parallel.dcn_data=2", "parallel.fsdp=2", "parallel.dcn_fsdp=2", "parallel.tensor=2"])
    degrees = resolve_degrees(cfg, 16)
    assert (degrees["data"], degrees["fsdp"], degrees["tensor"]) == (2, 4, 2)  # data=-1 is 1 device per host


def test_srun_and_mpirun_launches_are_detected(monkeypatch):
    for name in ("SLURM_NTASKS", "SLURM_STEP_NODELIST", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert distributed.cluster_env() is None
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.setenv("SLURM_STEP_NODELIST", "node[001-002]")
    assert distributed.cluster_env() is None  # one task: a single-process run, nothing to join
    monkeypatch.setenv("SLURM_NTASKS", "16")
    assert distributed.cluster_env() == "slurm"
    monkeypatch.delenv("SLURM_NTASKS")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    assert distributed.cluster_env() == "ompi"


SLOW_PROCESS_1 = '''
import sys, time
if sys.argv[sys.argv.index("--process-id") + 1 if "--process-id" in sys.argv else 0] == "1":
    import mlm_jax.train.loop as loop
    step = loop.Trainer._step
    def slow(self, *args):
        time.sleep(0.4)  # a slow host: its data or dispatch
        return step(self, *args)
    loop.Trainer._step = slow
'''


def test_a_slow_process_is_named(tmp_path):
    """Process 1 spends 0.4 s more per step: logged steps name it, its host and its time, flagged over 1.2x the
    median, and the progress line says so."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SLOW_PROCESS_1)
    env = dict(cpu_env(4), PYTHONPATH=f"{tmp_path / 'site'}:{REPO}")
    run = tmp_path / "run"
    proc = subprocess.run([LAUNCH, "2", *RUN, "train.steps=6", "train.log_every=3", "parallel.fsdp=8",
                           "checkpoint.save=false", f"train.output_dir={run}"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if "loss" in r]
    assert [r["step"] for r in logged] == [3, 6]
    for r in logged:
        assert r["slowest_process"] == 1 and r["slowest_host"] == socket.gethostname() and r["straggler"], r
        assert r["slowest_process_s"] >= 0.4 and r["slowest_process_s"] > 1.2 * r["process_median_s"], r
    assert "[0] step 3/6 | loss" in proc.stdout and f"slowest process 1 ({socket.gethostname()})" in proc.stdout
