"""What the pipeline executor costs on one GPU: 1F1B (or zb1) with a stage axis of size 1 against plain gradient
accumulation of the same microbatches.

    python benchmarks/pipeline_overhead.py --config configs/llama-1b.yaml [--microbatches 8] [--virtual 2 4]
        [--schedules 1f1b] [--layers 9,7] [--steps 10] [--warmup 2] [--results-dir DIR] [section.key=value ...]

With V >= 2 virtual chunks on the one stage the forward slot is live (with V = 1, XLA deletes it and the
executor is plain accumulation), so the ratio is what the schedule's own bookkeeping costs: stashing, the
per-tick branches, the gradient accumulation. `--layers` gives the V chunks unequal sizes (each chunk then has
room for the longest and skips its empty slots), which measures what an unequal split costs beyond its layers.
Each variant runs in a subprocess of its own, so peak memory (`peak_bytes_in_use`) is that variant's. Appends one record per pipelined variant with
`"bench": "pipeline_overhead"`, `ratio_to_plain`, V, M, the schedule and both peak memories to
`<results-dir>/results.jsonl` and a row to `<results-dir>/RESULTS.md` (default: benchmarks/).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from mlm_jax import ConfigError, load_config  # noqa: E402  (light: no jax)
from mlm_jax.parallel.schedule import SCHEDULES  # noqa: E402  (tables only)


def run_variant(args) -> dict:
    """Child: train `--steps` timed steps of one variant ("plain", or "<schedule>:<V>")."""
    import jax

    from mlm_jax.model.transformer import layer_kinds
    from mlm_jax.parallel.stages import ChunkLayout
    from mlm_jax.train.loop import Trainer

    with tempfile.TemporaryDirectory(prefix="mlm_jax-bench-") as tmp:
        cfg = load_config(args.config, [*args.overrides, f"train.num_microbatches={args.microbatches}",
                                        "train.eval_every=0", "train.log_every=1", "log.progress=never",
                                        f"train.output_dir={tmp}"])
        trainer = Trainer(cfg)
        if trainer.degrees["stage"] != 1:
            raise ConfigError("pipeline_overhead measures the executor on a stage axis of size 1: leave "
                              "parallel.stage at 1")
        if args.variant != "plain":
            kind, virtual = args.variant.split(":")
            schedule = SCHEDULES[kind](1, int(virtual), trainer.accum_steps)
            sizes = _sizes(args.layers, int(virtual), cfg.model.num_layers)
            trainer.build_steps(schedule, ChunkLayout(sizes, 1, int(virtual), layer_kinds(cfg.model)))
        trainer.fit(args.warmup)
        stash = trainer.stash and trainer.stash.total_bytes  # the executor's, from its trace
        times = [r["step_time_s"] for r in trainer.fit(args.steps) if "step_time_s" in r]
    stats = jax.devices()[0].memory_stats() or {}
    t = cfg.train
    median = statistics.median(times)
    return {"gpu": jax.devices()[0].device_kind, "jax_version": jax.__version__, "step_time_s": median,
            "tokens_per_s": t.global_batch_size * t.seq_len / median, "compile_time_s": trainer.compile_time_s,
            "peak_memory_gib": stats["peak_bytes_in_use"] / 2**30 if "peak_bytes_in_use" in stats else None,
            "micro_batch_rows": t.global_batch_size // trainer.accum_steps, "config": cfg.name,
            "stash_gib": stash and stash / 2**30, "chunk_layers": trainer.chunks and list(trainer.chunks.sizes)}


def _sizes(layers: str | None, virtual: int, num_layers: int) -> tuple[int, ...]:
    if layers is None:
        return (num_layers // virtual,) * virtual
    sizes = tuple(int(n) for n in layers.split(","))
    if len(sizes) != virtual or sum(sizes) != num_layers or min(sizes) < 0:
        raise ConfigError(f"--layers {layers}: expected {virtual} sizes (one per virtual chunk) summing to "
                          f"model.num_layers={num_layers}")
    return sizes


def child(args, variant: str, out: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--variant", variant, "--json-out", out,
           "--microbatches", str(args.microbatches), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    cmd += ["--layers", args.layers] if args.layers else []
    cmd += (["--config", args.config] if args.config else []) + args.overrides
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{variant} failed (exit code {proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    with open(out) as f:
        return json.load(f)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/pipeline_overhead.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="YAML file (configs/*.yaml); defaults to the tiny CPU model")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--virtual", type=int, nargs="+", default=[2, 4])
    p.add_argument("--schedules", nargs="+", default=["1f1b"], choices=sorted(SCHEDULES),
                   help="give section.key=value overrides before this option")
    p.add_argument("--layers", help="layers per virtual chunk, comma-separated (default: an even split)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--label", help="free text stored with the result")
    p.add_argument("--results-dir", default=HERE)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--json-out", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = p.parse_intermixed_args(argv)
    if args.variant:
        try:
            result = run_variant(args)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        with open(args.json_out, "w") as f:
            json.dump(result, f)
        return 0
    try:
        cfg = load_config(args.config, [*args.overrides, f"train.num_microbatches={args.microbatches}"])
        for V in args.virtual:
            _sizes(args.layers, V, cfg.model.num_layers)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        plain = child(args, "plain", os.path.join(tmp, "plain.json"))
        print(f"plain accumulation x{args.microbatches}: {plain['tokens_per_s']:,.0f} tokens/s, peak "
              f"{plain['peak_memory_gib']} GiB", flush=True)
        for kind in args.schedules:
            for V in args.virtual:
                got = child(args, f"{kind}:{V}", os.path.join(tmp, f"{kind}-{V}.json"))
                ratio = got["tokens_per_s"] / plain["tokens_per_s"]
                command = shlex.join(["python", "benchmarks/pipeline_overhead.py"] +
                                     (["--config", args.config] if args.config else []) +
                                     ["--microbatches", str(args.microbatches), "--virtual", str(V), "--schedules",
                                      kind, "--steps", str(args.steps), "--warmup", str(args.warmup)]
                                     + (["--layers", args.layers] if args.layers else []) + args.overrides)
                rec = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "bench": "pipeline_overhead", "gpu": got["gpu"], "n_gpus": 1, "config": got["config"],
                       "schedule": kind, "virtual": V, "microbatches": args.microbatches,
                       "chunk_layers": got["chunk_layers"],
                       "micro_batch_rows": got["micro_batch_rows"], "tokens_per_s": got["tokens_per_s"],
                       "plain_tokens_per_s": plain["tokens_per_s"], "ratio_to_plain": ratio,
                       "peak_memory_gib": got["peak_memory_gib"], "plain_peak_memory_gib": plain["peak_memory_gib"],
                       "stash_gib": got["stash_gib"],
                       "compile_time_s": got["compile_time_s"], "plain_compile_time_s": plain["compile_time_s"],
                       "jax_version": got["jax_version"], "command": command, "label": args.label,
                       "overrides": args.overrides}
                print(f"{kind} V={V} M={args.microbatches} layers {got['chunk_layers']}: "
                      f"{got['tokens_per_s']:,.0f} tokens/s = {ratio:.3f}x plain, peak {got['peak_memory_gib']} GiB (plain {plain['peak_memory_gib']}, stash "
                      f"{got['stash_gib']:.2f} GiB)", flush=True)
                write(args.results_dir, rec)
    return 0


def write(results_dir: str, rec: dict) -> None:
    os.makedirs(results_dir, exist_ok=True)
    with open(os.path.join(results_dir, "results.jsonl"), "a") as f:
        f.write(json.dumps(rec) + "\n")
    mem = rec["peak_memory_gib"], rec["plain_peak_memory_gib"]
    label = f"{rec['label']}, " if rec.get("label") else ""
    cells = [rec["date"][:10], f"{rec['gpu']} x1", f"{rec['config']} ({label}pipeline overhead, {rec['schedule']} V="
             f"{rec['virtual']} M={rec['microbatches']}, layers {rec['chunk_layers']})", f"`{rec['command']}`",
             f"{rec['tokens_per_s']:,.0f}", "-",
             "-", f"plain {rec['plain_tokens_per_s']:,.0f}", f"{rec['ratio_to_plain']:.3f} of plain",
             "-" if mem[0] is None else f"{mem[0]:.1f} GiB (plain {mem[1]:.1f}, stash {rec['stash_gib']:.1f})",
             f"{rec['compile_time_s']:.1f} s"]
    with open(os.path.join(results_dir, "RESULTS.md"), "a") as f:
        f.write("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |\n")


if __name__ == "__main__":
    sys.exit(main())
