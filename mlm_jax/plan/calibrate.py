"""`python -m mlm_jax.plan calibrate`: on one GPU, the step times of the pieces that a plan's layouts run (`timing`),
each the trainer's own step on the model one device of the layout computes, at two layer counts with one and two
microbatches, fitted and stored in the GPU's table (`mlm_jax/plan/tables/<gpu>.json`)."""
from __future__ import annotations

import dataclasses
import datetime
import gc
import json
import math
import subprocess
import tempfile

import jax

from mlm_jax.config import Config
from mlm_jax.plan.compiled import QUIET
from mlm_jax.plan.timing import Fit, Piece, Table, piece
from mlm_jax.train.loop import Trainer
from mlm_jax.validation.config import load_config
from mlm_jax.validation.plan import check_degrees

WINDOW = 10  # steps between syncs while timing, as `benchmarks/throughput.py` times


def pieces(path: str | None, overrides: list[str], layouts: list[list[str]], gpus: int) -> dict[str, tuple]:
    """{piece key: (the piece, a config of the layout)} of each layout (its overrides) on `gpus` devices."""
    out = {}
    for layout in layouts:
        cfg = load_config(path, [*overrides, *layout])
        degrees, M = check_degrees(cfg, gpus)
        p = piece(cfg, degrees, M)
        out.setdefault(p.key, (p, cfg))
    return out


def local_overrides(p: Piece, layers: int, microbatches: int) -> list[str]:
    """One GPU's config of piece `p` with `layers` layers and `microbatches` microbatches of its rows."""
    model = [f"model.{k}={v}" for k, v in p.model]
    return [*model, f"model.num_layers={layers}", f"model.remat={p.remat}", f"model.dtype={p.dtype}",
            f"model.precision={p.precision}", f"train.seq_len={p.seq}", f"train.global_batch_size={p.rows * microbatches}",
            f"train.num_microbatches={microbatches}", "train.micro_batch_size=null", f"train.loss_chunks={p.loss_chunks}",
            "parallel.data=1", "parallel.fsdp=1", "parallel.stage=1", "parallel.context=1", "parallel.expert=1",
            "parallel.tensor=1", "parallel.sequence_parallel=false", "parallel.shard_optimizer=false",
            "parallel.virtual_stages=1", "parallel.pipeline_layers=even"]


def step_seconds(cfg: Config, steps: int, warmup: int) -> tuple[float, int]:
    """(mean step time over `steps` steps after `warmup`, the weights the device holds)."""
    with tempfile.TemporaryDirectory(prefix="mlm_jax-calibrate-") as tmp:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, output_dir=tmp,
                                                                 log_every=min(WINDOW, steps)))
        trainer = Trainer(cfg, devices=jax.devices()[:1])
        trainer.fit(warmup)
        first = int(trainer.state.step)
        records = [r for r in trainer.fit(steps) if "step_time_s" in r]
        lengths = [r["step"] - before for r, before in zip(records, [first] + [r["step"] for r in records])]
        seconds = sum(r["step_time_s"] * n for r, n in zip(records, lengths)) / sum(lengths)
        weights = sum(math.prod(x.shape) for x in jax.tree.leaves(trainer.spec.shapes))
    del trainer
    gc.collect()
    return seconds, weights


def calibrate(path: str | None, overrides: list[str], todo: dict[str, tuple], table: Table,
              layers: tuple[int, int] = (2, 4), steps: int = 10, warmup: int = 2, log=print) -> Table:
    """Measures each piece of `todo` not yet in `table` and adds its fit."""
    for key, (p, cfg) in todo.items():
        if key in table.fits:
            continue
        times, weights = {}, {}
        for n in layers:
            for M in (1, 2):
                local = load_config(path, [*overrides, *QUIET, *local_overrides(p, n, M)])
                times[n, M], weights[n] = step_seconds(local, steps, warmup)
                log(f"  {n} layers, {M} microbatch(es) of {p.rows} x {p.seq}: {times[n, M] * 1e3:.1f} ms")
        table.fits[key] = Fit.from_steps(layers, times, (weights[layers[0]], weights[layers[1]]))
    return _stamped(table)


def _stamped(table: Table) -> Table:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    table.meta = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "commit": commit,
                  "date": datetime.date.today().isoformat()}
    return table


def layouts_from(json_path: str, top: int) -> list[list[str]]:
    """The overrides of the first `top` fitting candidates of a plan's `--json` file."""
    with open(json_path) as f:
        rows = [json.loads(line) for line in f]
    return [r["overrides"] for r in rows if r["fits"]][:top]
