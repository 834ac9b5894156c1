"""`python -m mlm_jax.plan`: the ranked layouts of a config on N GPUs, and `calibrate`, which measures on this GPU the
pieces those layouts run (`timing`)."""
from __future__ import annotations

import argparse
import json
import os
import sys

import jax

from mlm_jax.config import ConfigError, to_yaml
from mlm_jax.plan import space
from mlm_jax.plan.calibrate import calibrate, layouts_from, pieces
from mlm_jax.plan.collectives import Links
from mlm_jax.plan.hardware import GIB, GPUS, gpu
from mlm_jax.plan.search import Cache, Candidate, search
from mlm_jax.plan.target import Target
from mlm_jax.plan.timing import TABLES, Table
from mlm_jax.validation.config import load_config

CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "mlm_jax", "plan")


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ConfigError(message)


def parser(calibrating: bool) -> argparse.ArgumentParser:
    if calibrating:
        p = _Parser(prog="python -m mlm_jax.plan calibrate",
                    description="On this GPU, measure the pieces that a plan's layouts run; stores them in the GPU's "
                                "table (mlm_jax/plan/tables/<gpu>.json).")
    else:
        p = _Parser(prog="python -m mlm_jax.plan", description="Rank the layouts of a config on N GPUs.")
    p.add_argument("--config", help="YAML file (configs/*.yaml); defaults to the tiny CPU model")
    p.add_argument("--gpus", type=int, required=True, help="how many GPUs the run has")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu", choices=sorted(GPUS), default="h200")
    p.add_argument("overrides", nargs="*", metavar="section.key=value")
    if calibrating:
        p.add_argument("--plan", metavar="FILE", help="a plan's --json file: its fitting layouts' pieces (default: "
                                                      "the config's own layout)")
        p.add_argument("--top", type=int, default=5, help="fitting layouts of --plan to calibrate")
        p.add_argument("--layers", type=int, nargs=2, default=[2, 4], metavar=("L1", "L2"),
                       help="the two depths each piece is measured at (deeper where shallow models run a layer "
                            "differently: moe-1b's layer cost 11%% more at 2 and 4 layers than in its 16)")
        p.add_argument("--steps", type=int, default=10)
        p.add_argument("--warmup", type=int, default=2)
        p.add_argument("--tables", default=TABLES, help="where the GPU's table is read and written")
        return p
    p.add_argument("--top", type=int, default=10, help="layouts to print (the rejected ones follow)")
    p.add_argument("--json", metavar="FILE", help="one object per candidate")
    p.add_argument("--write", metavar="FILE.yaml", help="the best layout's whole config")
    p.add_argument("--remat", nargs="+", choices=space.REMATS, default=list(space.REMATS),
                   help="recompute settings to try, fastest first")
    p.add_argument("--capacity-gib", type=float, help="memory a run may use per GPU (default: the GPU's, as a run "
                                                      "sees it)")
    p.add_argument("--nvlink-gbps", type=float, help="GB/s per GPU in one direction inside a node")
    p.add_argument("--network-gbps", type=float, help="GB/s per GPU in one direction across nodes")
    p.add_argument("--cpu", action="store_true", help="compile for CPU devices even where the CUDA plugin is installed")
    p.add_argument("--probe", action="store_true", help="compile deep models at two shallower depths and "
                                                         "extrapolate (several times faster, less exact)")
    p.add_argument("--jobs", type=int, default=1, help="processes compiling candidates at once (each takes a core or "
                                                        "more and the memory of its compilations)")
    p.add_argument("--no-cache", action="store_true")
    p.add_argument("--tables", default=TABLES, help="where the GPUs' calibration tables are read")
    return p


def _progress(i: int, n: int, what: str) -> None:
    if sys.stderr.isatty() or os.environ.get("MLM_JAX_PLAN_PROGRESS"):
        bar = "#" * (20 * i // max(n, 1))
        print(f"\r[{bar:<20}] {i}/{n} {what:<40}", end="" if i < n else "\n", file=sys.stderr, flush=True)


def table_text(ranked: list[Candidate], top: int, cfg, g, gpus: int, on_gpu: bool) -> str:
    rows = [(f"{'#':>3}  {'layout':<34} {'setting':<26} {'tok/s/GPU':>10} {'MFU':>6} {'step s':>8} {'GiB/GPU':>8} "
             f"{'bubble':>7}  exposed communication")]
    fits = [c for c in ranked if c.fits]
    for i, c in enumerate(fits[:top], 1):
        r = c.record(cfg, g, gpus)
        exposed = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in r["exposed_s"].items() if v >= 5e-5) or "-"
        mark = "" if r["calibrated"] else " *"
        rows.append(f"{i:>3}  {r['layout']:<34} {r['setting']:<26} {r['tokens_per_s_per_gpu']:>10,.0f} "
                    f"{r['mfu']:>6.1%} {r['step_time_s']:>8.3f} {r['memory_gib']:>8.1f} {r['bubble']:>7.1%}  "
                    f"{exposed}{mark}")
    rejected = [c for c in ranked if not c.fits]
    if rejected:
        rows.append(f"not taken ({len(rejected)}):")
        rows += [f"     {c.split.describe():<34} {c.reason}" for c in rejected]
    if any(not c.estimate.calibrated for c in fits[:top]):
        rows.append(f"* uncalibrated: FLOPs at 50% of the peak; `python -m mlm_jax.plan calibrate` on one {g.name} "
                    f"measures its pieces")
    if not on_gpu:
        rows.append("compiled for CPU devices (no CUDA plugin: pip install -e '.[gpu]'): XLA's attention and fusions "
                    "stand in for the GPU's, so memory and collectives are the CPU program's")
    return "\n".join(rows)


def plan(argv) -> int:
    args = parser(False).parse_intermixed_args(argv)
    cfg = load_config(args.config, args.overrides)
    g = gpu(args.gpu, nvlink_bandwidth=args.nvlink_gbps and args.nvlink_gbps * 1e9,
            network_bandwidth=args.network_gbps and args.network_gbps * 1e9)
    capacity = int(args.capacity_gib * GIB) if args.capacity_gib else g.capacity
    if args.jobs < 1:
        raise ConfigError(f"--jobs {args.jobs}: at least 1")
    target = Target(g, args.gpus, args.gpus_per_node, args.cpu)
    devices = target.devices()
    links = Links(args.gpus_per_node, g.nvlink_bandwidth, g.network_bandwidth, g.nvlink_latency, g.network_latency)
    ranked = search(args.config, args.overrides, target, links, Table.load(args.gpu, args.tables),
                    Cache(None if args.no_cache else CACHE), capacity, tuple(args.remat), args.probe, args.jobs,
                    _progress)
    print(f"{cfg.name} on {args.gpus} x {g.name} ({args.gpus_per_node} a node), {capacity / GIB:.1f} GiB a GPU, "
          f"global batch {cfg.train.global_batch_size} x {cfg.train.seq_len}")
    print(table_text(ranked, args.top, cfg, g, args.gpus, devices[0].platform == "gpu"))
    if args.json:
        with open(args.json, "w") as f:
            f.writelines(json.dumps(c.record(cfg, g, args.gpus)) + "\n" for c in ranked)
    best = next((c for c in ranked if c.fits), None)
    if args.write and best is not None:
        with open(args.write, "w") as f:
            f.write(to_yaml(load_config(args.config, [*args.overrides, *best.overrides])))
        print(f"best layout written to {args.write}")
    return 0 if best is not None else 1


def calibrate_main(argv) -> int:
    args = parser(True).parse_intermixed_args(argv)
    if not 1 <= args.layers[0] < args.layers[1]:
        raise ConfigError(f"--layers {args.layers[0]} {args.layers[1]}: two depths, the first at least 1 and less "
                          f"than the second")
    layouts = layouts_from(args.plan, args.top) if args.plan else [[]]
    todo = pieces(args.config, args.overrides, layouts, args.gpus)
    table = Table.load(args.gpu, args.tables)
    if GPUS[args.gpu].name.lower() not in jax.devices()[0].device_kind.lower():
        raise ConfigError(f"--gpu {args.gpu}: this process's device is {jax.devices()[0].device_kind}")
    print(f"{len(todo)} piece(s) to measure on {jax.devices()[0].device_kind}, "
          f"{sum(k not in table.fits for k in todo)} not in the {args.gpu} table yet")
    table = calibrate(args.config, args.overrides, todo, table, tuple(args.layers), steps=args.steps,
                      warmup=args.warmup)
    print(f"written to {table.save(args.tables)}")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["calibrate"]:
            return calibrate_main(argv[1:])
        return plan(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
