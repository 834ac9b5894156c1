"""The training loop's side jobs as hooks (after Levanter's trainer hooks): each says how often it runs and what it
does, so that `Trainer.fit` is only the step and the hooks that are due after it."""
from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from mlm_jax.parallel import distributed
from mlm_jax.train import metrics as mt


@dataclasses.dataclass
class StepInfo:
    """What the hooks see after a step. `metrics` are on the device until `LogMetrics` fetches them; a hook sets
    `stop` to end the fit after this step's hooks."""
    done: int  # steps finished, the one just run included (its 1-based number)
    end: int  # the fit's last step
    state: Any
    metrics: dict
    waited: float = 0.0  # seconds in the call that ran the step (its dispatch, or all of it where it runs in place)
    stop: str | None = None


class Hook:
    """Runs after every step that `due` picks: by default every `every` steps (0: never) and the fit's last."""
    every = 0

    def due(self, info: StepInfo) -> bool:
        return bool(self.every) and (info.done % self.every == 0 or info.done == info.end)

    def run(self, info: StepInfo) -> None:
        raise NotImplementedError

    def before(self, step: int) -> None:
        """Before step `step` (1-based) runs: where a profile starts, so that it holds that step whole."""

    def close(self) -> None:
        """When the fit ends, however it ends."""


class Hooks:
    """The hooks in the order they run: a later one sees what an earlier one did to the `StepInfo`."""

    def __init__(self, hooks: list[Hook]):
        self.hooks = hooks

    def before(self, step: int) -> None:
        for hook in self.hooks:
            hook.before(step)

    def after(self, info: StepInfo) -> None:
        for hook in self.hooks:
            if hook.due(info):
                hook.run(info)

    def close(self) -> None:
        for hook in self.hooks:
            hook.close()


class Records:
    """The records a fit returns, each written to metrics.jsonl (and printed) as it comes, and to the dashboards
    that `open_dashboards()` makes (`train.dashboards`; process 0's, the others none) with the first record, so that
    a fit refused before its first step writes none."""

    def __init__(self, log: mt.MetricsLog, open_dashboards: Callable[[], list]):
        self.items: list[dict] = []
        self.log, self.open_dashboards, self.dashboards = log, open_dashboards, None

    def add(self, rec: dict) -> None:
        if self.dashboards is None:
            self.dashboards = self.open_dashboards()
        self.items.append(rec)
        self.log.write(rec)
        for board in self.dashboards:
            board.write(rec)

    def close(self) -> None:
        for board in self.dashboards or []:
            board.close()


class Throughput:
    """Rates of the steps since the last logged one, timed from it or from the evaluation since: an evaluation's
    time is not training time."""

    def __init__(self, step: int, tokens_per_step: int, flops_per_token: float, num_devices: int,
                 peak: float | None):
        self.first, self.start, self.waited = step, time.perf_counter(), 0.0
        self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
        self.num_devices, self.peak = num_devices, peak

    def restart(self, after: int | None = None) -> None:
        """Times from now; `after` (a logged step) also starts a new window of steps."""
        self.start, self.waited = time.perf_counter(), 0.0
        if after is not None:
            self.first = after

    def measure(self, done: int) -> dict:
        """The window's rates; `host_time_s` is a step's time less what this process `waited` in the calls that
        run the steps or fetch their metrics (for the devices, and for the other processes through them)."""
        elapsed, steps = time.perf_counter() - self.start, done - self.first
        rates = mt.throughput(self.tokens_per_step * steps, elapsed, self.flops_per_token, self.num_devices,
                              self.peak)
        return {**rates, "step_time_s": elapsed / steps, "host_time_s": (elapsed - self.waited) / steps}


class Stragglers:
    """Names the process the others wait for in a multi-process run: each logged step, every process's host time
    per step (its time less its wait for the devices: data, Python, the hooks) is gathered, and the slowest
    process, its time and host are recorded, `straggler` when it is over `SLOW` x the median. A process whose
    host is slow waits least; a slow GPU holds all processes alike and shows in a profile instead."""

    SLOW = 1.2

    def __init__(self):
        self.hosts = distributed.host_names()

    def measure(self, host_time_s: float) -> dict:
        times = distributed.each_process(host_time_s)
        slow, median = int(np.argmax(times)), float(np.median(times))
        return {"slowest_process": slow, "slowest_process_s": float(times[slow]), "process_median_s": median,
                "slowest_host": self.hosts[slow], "straggler": bool(times[slow] > self.SLOW * median)}


class LogMetrics(Hook):
    """Fetches the step's metrics every `train.log_every` steps, the only ones that wait for the device, and records
    them with the throughput since the last fetch and the memory of this process's `devices`."""

    def __init__(self, every: int, throughput: Throughput, records: Records, devices: list):
        self.every, self.throughput, self.records, self.devices = every, throughput, records, devices
        self.stragglers = Stragglers() if jax.process_count() > 1 else None

    def run(self, info: StepInfo) -> None:
        t0 = time.perf_counter()
        info.metrics = jax.device_get(info.metrics)
        self.throughput.waited += time.perf_counter() - t0
        rates = self.throughput.measure(info.done)
        processes = self.stragglers.measure(rates["host_time_s"]) if self.stragglers else {}
        self.records.add({"step": info.done, **{k: mt.plain(v) for k, v in info.metrics.items()}, **rates,
                          **mt.device_memory(self.devices), **processes})
        self.throughput.restart(after=info.done)


class StopOnNonFinite(Hook):
    """`train.nan_policy=stop`: after `LogMetrics` (on the host metrics), calls `stop(first, last, dropped)` once
    a step since the last check dropped a non-finite update."""

    def __init__(self, every: int, start: int, skipped: int, stop: Callable[[int, int, int], None]):
        self.every, self.checked, self.skipped, self.stop = every, start, skipped, stop

    def run(self, info: StepInfo) -> None:
        first, self.checked = self.checked + 1, info.done
        if info.metrics["skipped_steps"] > self.skipped:
            self.stop(first, info.done, int(info.metrics["skipped_steps"]) - self.skipped)


class Evaluate(Hook):
    """Records `evaluate()` (a dict of metrics) every `every` steps, its time left out of the throughput."""

    def __init__(self, every: int, evaluate: Callable[[], dict], throughput: Throughput, records: Records):
        self.every, self.evaluate, self.throughput, self.records = every, evaluate, throughput, records

    def run(self, info: StepInfo) -> None:
        self.records.add({"step": info.done, **self.evaluate()})
        self.throughput.restart()


class StopOnSignal(Hook):
    """SIGTERM/SIGINT set a flag (main thread only); all processes stop after the same step, the first after it
    that checks. Several processes agree only on logged steps, which wait for the device anyway, so a signal is
    acted on within one logging interval."""

    def __init__(self, log_every: int):
        self.every = log_every if jax.process_count() > 1 else 1
        self.received: str | None = None
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received = signal.Signals(signum).name

    def run(self, info: StepInfo) -> None:
        if distributed.any_process(self.received is not None):  # a signal during the agreement waits for the next, everywhere
            self.received = info.stop = self.received or "a signal on another process"

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class SaveCheckpoint(Hook):
    """Saves when `checkpoint_due(step)`, after step `last` (`train.steps`) and before a stop (after `StopOnSignal`)."""

    def __init__(self, checkpoint_due: Callable[[int], bool], last: int, save: Callable[[], None]):
        self.checkpoint_due, self.last, self.save = checkpoint_due, last, save

    def due(self, info: StepInfo) -> bool:
        return self.checkpoint_due(info.done) or info.done == self.last or info.stop is not None

    def run(self, info: StepInfo) -> None:
        self.save()


class Profile(Hook):
    """A jax.profiler trace of steps `log.profile_steps = [a, b]` (1-based, inclusive), Perfetto JSON included."""

    def __init__(self, log_cfg, output_dir: str, is_main: bool):
        self.steps = log_cfg.profile_steps
        self.directory = log_cfg.profile_dir or os.path.join(output_dir, "profile")
        if jax.process_count() > 1:  # processes sharing a host would overwrite each other's files
            self.directory = os.path.join(self.directory, f"process_{jax.process_index()}")
        self.is_main = is_main
        self.active = False

    def before(self, step: int) -> None:
        if self.steps and step == self.steps[0]:
            jax.profiler.start_trace(self.directory, create_perfetto_trace=True)
            self.active = True

    def due(self, info: StepInfo) -> bool:
        return self.active and info.done >= self.steps[1]

    def run(self, info: StepInfo) -> None:
        jax.block_until_ready(info.state)
        self.close()
        if self.is_main:
            print(f"profile of steps {self.steps[0]}..{info.done} written to {self.directory}")

    def close(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
