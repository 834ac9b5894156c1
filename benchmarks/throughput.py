"""Training throughput of mlm_jax on the local accelerators, optionally next to the PyTorch peer.

    python benchmarks/throughput.py --config configs/llama-1b.yaml [--steps 30] [--warmup 5]
        [--peer PATH/TO/torch_gpt.py] [--label TEXT] [--xla-flags "..."] [--results-dir DIR]
        [--sweep train.global_batch_size=8,16 model.remat=none,full] [section.key=value ...]

Each measurement of ours runs in a subprocess of its own (this script with --ours-only --json-out FILE), and the
peer runs after it has exited, so the two never hold accelerator memory at the same time. This parent process
never imports jax. Results: a table on stdout, one line per run appended to <results-dir>/results.jsonl and one
row to <results-dir>/RESULTS.md (results-dir defaults to benchmarks/). See benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import shlex
import subprocess
import sys
import tempfile
import threading

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from mlm_jax import ConfigError, load_config  # noqa: E402  (light: no jax)

RESULTS_MD_HEADER = (
    "# Throughput results\n\n"
    "Appended by `benchmarks/throughput.py` (see `benchmarks/README.md`). One row per run; the full record is in "
    "`results.jsonl`.\n\n"
    "| date | GPU | config | command | tokens/s | TFLOP/s/dev | MFU | peer tok/s | ratio | peak mem | compile |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|\n")
PEER_NORM_EPS = 1e-6
PEER_ROPE_THETA = 10000.0


WINDOW = 10  # steps between the host's syncs while timing: a training run's logging interval, the peer's timed loop


def forced_overrides(output_dir: str, window: int) -> list[str]:
    """Applied after the user's overrides: no eval, a synced record every `window` steps (the steps between are
    dispatched while the previous ones run, as in training), no progress line, temp output."""
    return ["train.eval_every=0", f"train.log_every={window}", "log.progress=never", f"train.output_dir={output_dir}"]


# ---------------------------------------------------------------------------------------------------------------
# Our run (child process): --ours-only --json-out FILE
# ---------------------------------------------------------------------------------------------------------------
def run_ours(args) -> dict:
    import jax  # only the child touches the accelerators

    from mlm_jax.train.loop import Trainer

    with tempfile.TemporaryDirectory(prefix="mlm_jax-bench-") as tmp:
        window = max(1, min(WINDOW, args.steps))
        cfg = load_config(args.config, [*args.overrides, *forced_overrides(os.path.join(tmp, "run"), window)])
        trainer = Trainer(cfg)
        if args.warmup:
            trainer.fit(args.warmup)  # compiles on the first call
        first = int(trainer.state.step)
        records = [r for r in trainer.fit(args.steps) if "step_time_s" in r]
        if not hasattr(trainer, "compile_time_s"):  # --warmup 0 and --steps 0 never compile
            raise SystemExit("error: no step was run")

    t, n_dev = cfg.train, len(trainer.mesh.devices.flat)
    times = [r["step_time_s"] for r in records]  # each window's time per step
    lengths = [r["step"] - before for r, before in zip(records, [first] + [r["step"] for r in records])]
    mean = sum(s * n for s, n in zip(times, lengths)) / sum(lengths)  # the timed steps' wall time over their count
    tokens_per_s = t.global_batch_size * t.seq_len / mean
    tflops = tokens_per_s * trainer.flops_per_token / n_dev / 1e12
    device = jax.devices()[0]
    peaks = []
    for d in jax.local_devices():
        try:
            stats = d.memory_stats()
        except Exception:  # noqa: BLE001  (unsupported on some backends)
            stats = None
        if stats and stats.get("peak_bytes_in_use") is not None:
            peaks.append(stats["peak_bytes_in_use"])
    last = records[-1]
    loss = last.get("loss")
    return {
        "platform": device.platform,
        "gpu": device.device_kind,
        "n_devices": n_dev,
        "jax_version": jax.__version__,
        "num_params": int(trainer.num_params),
        "flops_per_token": float(trainer.flops_per_token),
        "peak_flops": trainer.peak,
        "global_batch_size": t.global_batch_size,
        "seq_len": t.seq_len,
        "accum_steps": int(trainer.accum_steps),
        "step_time_s": mean,
        "step_time_min_s": min(times),
        "step_time_max_s": max(times),
        "step_time_mean_s": mean,
        "timed_steps": args.steps,
        "timing_window": window,
        "tokens_per_s": tokens_per_s,
        "tflops_per_device": tflops,
        "mfu": tflops * 1e12 / trainer.peak if trainer.peak else None,
        "compile_time_s": float(trainer.compile_time_s),
        "peak_memory_gib": max(peaks) / 2**30 if peaks else None,
        "memory_report_gib": trainer.memory.total / 2**30,  # the start-up report's estimate of the step
        "final_loss": float(loss) if loss is not None else None,
        "skipped_steps": int(last.get("skipped_steps", 0) or 0),
    }


# ---------------------------------------------------------------------------------------------------------------
# Parent: subprocesses, peer, output
# ---------------------------------------------------------------------------------------------------------------
def _stream(cmd: list[str], env: dict, timeout: float | None, keep=lambda line: True) -> tuple[int | None, list[str]]:
    """Run `cmd`, echo the lines `keep` accepts, return (exit code, or None when it timed out; all output lines)."""
    lines: list[str] = []
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            cwd=ROOT)
    timed_out = threading.Event()

    def kill():
        timed_out.set()
        proc.kill()

    timer = threading.Timer(timeout, kill) if timeout else None
    if timer:
        timer.start()
    try:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if keep(line):
                sys.stdout.write("    " + line)
                sys.stdout.flush()
        rc = proc.wait()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    finally:
        if timer:
            timer.cancel()
    return (None if timed_out.is_set() else rc), lines


def ours_in_subprocess(args, overrides: list[str], json_out: str) -> tuple[dict | None, str | None]:
    cmd = [sys.executable, os.path.abspath(__file__), "--ours-only", "--json-out", json_out,
           "--steps", str(args.steps), "--warmup", str(args.warmup)]
    if args.config:
        cmd += ["--config", args.config]
    cmd += overrides
    env = dict(os.environ)
    if args.xla_flags:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {args.xla_flags}".strip()
    rc, lines = _stream(cmd, env, args.timeout, keep=lambda line: not line.startswith("step "))
    if rc == 0 and os.path.exists(json_out):
        with open(json_out) as f:
            return json.load(f), None
    tail = "\n".join(lines[-15:])
    why = "timed out" if rc is None else f"exit code {rc}"
    return None, f"our run failed ({why}):\n{tail}"


def peer_env(cfg, accum_steps: int) -> dict[str, str]:
    """The peer's shape, and its batch split into as many microbatches as our step accumulated (`ACC`): a ratio at
    4 microbatches compares two accumulating steps, not ours against the peer's one batch."""
    m, t = cfg.model, cfg.train
    return {"L": str(m.num_layers), "D": str(m.hidden_size), "H": str(m.num_heads), "F": str(m.ffn_size),
            "V": str(m.vocab_size), "S": str(t.seq_len), "B": str(t.global_batch_size), "ACC": str(accum_steps)}


def peer_mismatches(cfg) -> list[str]:
    """What the peer (MHA, untied head, RMSNorm eps 1e-6, SwiGLU, bf16 autocast, no remat) differs in."""
    m = cfg.model
    out = []
    if m.kv_heads != m.num_heads:
        out.append(f"model.num_kv_heads={m.kv_heads} != num_heads={m.num_heads} (peer is MHA)")
    if m.tie_embeddings:
        out.append("model.tie_embeddings=true (peer has an untied output head)")
    if m.norm != "rmsnorm":
        out.append(f"model.norm={m.norm} (peer uses RMSNorm)")
    elif m.norm_eps != PEER_NORM_EPS:
        out.append(f"model.norm_eps={m.norm_eps} (peer uses {PEER_NORM_EPS})")
    if m.activation != "swiglu":
        out.append(f"model.activation={m.activation} (peer uses SwiGLU)")
    if m.dim_per_head * m.num_heads != m.hidden_size:
        out.append(f"model.head_dim={m.dim_per_head} != hidden_size/num_heads (peer derives it)")
    if m.qk_norm:
        out.append("model.qk_norm=true (peer has none)")
    if m.rope_theta != PEER_ROPE_THETA:
        out.append(f"model.rope_theta={m.rope_theta} (peer uses {PEER_ROPE_THETA:g})")
    if m.dtype != "bfloat16":
        out.append(f"model.dtype={m.dtype} (peer computes in bf16 autocast)")
    if m.remat != "none":
        out.append(f"model.remat={m.remat} (peer recomputes nothing)")
    return out


def run_peer(args, env_shape: dict[str, str]) -> dict:
    """The peer's JSON record, or {"error": ...}; never raises for a failing peer."""
    env = {**os.environ, **env_shape}
    cmd = [args.peer_python, args.peer]
    print(f"  peer: {' '.join(f'{k}={v}' for k, v in env_shape.items())} {shlex.join(cmd)}", flush=True)
    try:
        rc, lines = _stream(cmd, env, args.timeout, keep=lambda line: False)
    except OSError as e:
        return {"error": f"cannot start peer: {e}"}
    for line in reversed(lines):
        line = line.strip()
        if line.startswith("{"):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("tok_s"), (int, float)) and rc == 0:
                return rec
    why = "timed out" if rc is None else f"exit code {rc}"
    tail = [ln for ln in lines if ln.strip()][-3:]
    return {"error": f"peer failed ({why}): " + " / ".join(tail)[-500:]}


def _fmt(v, spec: str, none: str = "-") -> str:
    return none if v is None else format(v, spec)


def command_for(args, overrides: list[str]) -> str:
    cmd = ["python", "benchmarks/throughput.py"]
    if args.config:
        cmd += ["--config", args.config]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    if args.xla_flags:
        cmd += [f"--xla-flags={args.xla_flags}"]
    if args.peer:
        cmd += ["--peer", args.peer]
    return shlex.join(cmd + overrides)


def build_record(args, cfg, overrides, ours, peer, warnings) -> dict:
    peer_tok = peer.get("tok_s") if peer and "error" not in peer else None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": ours["gpu"],
        "n_gpus": ours["n_devices"] if ours["platform"] == "gpu" else 0,
        "config": cfg.name,
        "tokens_per_s": ours["tokens_per_s"],
        "tflops_per_device": ours["tflops_per_device"],
        "mfu": ours["mfu"],
        "peer_tokens_per_s": peer_tok,
        "ratio_to_peer": ours["tokens_per_s"] / peer_tok if peer_tok else None,
        "command": command_for(args, overrides),
        "label": args.label,
        "config_path": args.config,
        "overrides": overrides,
        "xla_flags": args.xla_flags,
        "steps": args.steps,
        "warmup": args.warmup,
        **{k: ours[k] for k in ("platform", "n_devices", "jax_version", "global_batch_size", "seq_len",
                                "accum_steps", "num_params", "flops_per_token", "step_time_s", "step_time_min_s",
                                "step_time_max_s", "step_time_mean_s", "timed_steps", "timing_window", "compile_time_s",
                                "peak_memory_gib", "memory_report_gib", "final_loss", "skipped_steps")},
        "peer": peer,
        "peer_warnings": warnings,
    }


def write_results(results_dir: str, rec: dict) -> None:
    os.makedirs(results_dir, exist_ok=True)
    with open(os.path.join(results_dir, "results.jsonl"), "a") as f:
        f.write(json.dumps(rec) + "\n")
    md = os.path.join(results_dir, "RESULTS.md")
    if not os.path.exists(md):
        with open(md, "w") as f:
            f.write(RESULTS_MD_HEADER)
    gpu = f"{rec['gpu']} x{rec['n_devices']}"
    config = rec["config"] + (f" ({rec['label']})" if rec["label"] else "")
    cells = [rec["date"][:10], gpu, config, f"`{rec['command']}`", _fmt(rec["tokens_per_s"], ",.0f"),
             _fmt(rec["tflops_per_device"], ".1f"), _fmt(rec["mfu"] and 100 * rec["mfu"], ".1f") +
             ("%" if rec["mfu"] is not None else ""), _fmt(rec["peer_tokens_per_s"], ",.0f"),
             _fmt(rec["ratio_to_peer"], ".2f"), _fmt(rec["peak_memory_gib"], ".1f") +
             (" GiB" if rec["peak_memory_gib"] is not None else ""), f"{rec['compile_time_s']:.1f} s"]
    with open(md, "a") as f:
        f.write("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |\n")


TABLE_COLS = [("point", 44), ("tokens/s", 12), ("TFLOP/s/dev", 11), ("MFU", 7), ("step ms", 9), ("peer tok/s", 11),
              ("ratio", 6), ("peak GiB", 8), ("compile s", 9), ("loss", 7)]


def table_row(point: str, rec: dict | None, error: str | None = None) -> str:
    if rec is None:
        cells = [point, f"FAILED: {error}"]
        return "  ".join(cells)
    cells = [point, _fmt(rec["tokens_per_s"], ",.0f"), _fmt(rec["tflops_per_device"], ".2f"),
             _fmt(rec["mfu"] and 100 * rec["mfu"], ".1f"), _fmt(1e3 * rec["step_time_s"], ".1f"),
             _fmt(rec["peer_tokens_per_s"], ",.0f"), _fmt(rec["ratio_to_peer"], ".2f"),
             _fmt(rec["peak_memory_gib"], ".2f"), _fmt(rec["compile_time_s"], ".1f"), _fmt(rec["final_loss"], ".3f")]
    return "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, (_, w)) in enumerate(zip(cells, TABLE_COLS)))


def sweep_points(sweep: list[str]) -> list[list[str]]:
    axes = []
    for item in sweep:
        key, eq, values = item.partition("=")
        if not eq or not key or not values:
            raise ConfigError(f"--sweep {item!r}: expected section.key=v1,v2,...")
        axes.append([f"{key}={v}" for v in values.split(",")])
    return [list(p) for p in itertools.product(*axes)] if axes else [[]]


def main_parent(args) -> int:
    try:  # validate every point up front (no devices needed)
        points = sweep_points(args.sweep or [])
        cfgs = [load_config(args.config, [*args.overrides, *p]) for p in points]
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.peer and not os.path.exists(args.peer):
        print(f"warning: --peer {args.peer}: no such file; the peer will be reported as failed", file=sys.stderr)
    results_dir = args.results_dir or HERE
    peers: dict[tuple, dict] = {}
    rows: list[str] = []
    failures = 0
    with tempfile.TemporaryDirectory(prefix="mlm_jax-bench-") as tmp:
        for i, (point, cfg) in enumerate(zip(points, cfgs)):
            overrides = [*args.overrides, *point]
            name = " ".join(point) or cfg.name
            print(f"[{i + 1}/{len(points)}] {cfg.name} {' '.join(overrides)}".rstrip(), flush=True)
            ours, err = ours_in_subprocess(args, overrides, os.path.join(tmp, f"ours-{i}.json"))
            if ours is None:
                print(err, file=sys.stderr)
                rows.append(table_row(name, None, err.splitlines()[0]))
                failures += 1
                continue
            peer, warnings = None, []
            if args.peer:
                warnings = peer_mismatches(cfg)
                if ours["n_devices"] > 1:
                    warnings.append(f"ours ran on {ours['n_devices']} devices, the peer on one GPU with the whole "
                                    f"global batch: the ratio compares totals, not per-device throughput")
                for w in warnings:
                    print(f"  warning: peer cannot match: {w}", file=sys.stderr)
                shape = tuple(sorted(peer_env(cfg, ours["accum_steps"]).items()))
                if shape not in peers:  # after our subprocess has exited and released the device
                    peers[shape] = run_peer(args, dict(shape))
                    if "error" in peers[shape]:
                        print(f"  warning: {peers[shape]['error']}", file=sys.stderr)
                peer = peers[shape]
            rec = build_record(args, cfg, overrides, ours, peer, warnings)
            write_results(results_dir, rec)
            rows.append(table_row(name, rec))
    print()
    print("  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(TABLE_COLS)))
    for r in rows:
        print(r)
    if len(rows) > failures:
        print(f"\nappended {len(rows) - failures} line(s) to {os.path.join(results_dir, 'results.jsonl')} and "
              f"{os.path.join(results_dir, 'RESULTS.md')}")
    return 1 if failures else 0


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python benchmarks/throughput.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="YAML file (configs/*.yaml); defaults to the tiny CPU model")
    p.add_argument("--steps", type=int, default=30, help="timed steps (median step time is reported)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (the first one compiles)")
    p.add_argument("--peer", help="path to the PyTorch peer script (torch_gpt.py: SDPA flash attention + torch.compile)")
    p.add_argument("--peer-python", default=sys.executable, help="interpreter for the peer (default: this one)")
    p.add_argument("--label", help="free text stored with the result")
    p.add_argument("--xla-flags", default="", help="appended to XLA_FLAGS of our subprocess")
    p.add_argument("--results-dir", help="where results.jsonl and RESULTS.md are appended (default: benchmarks/)")
    p.add_argument("--sweep", nargs="+", metavar="KEY=V1,V2",
                   help="cartesian grid of overrides, one subprocess per point")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per subprocess (ours or the peer)")
    p.add_argument("--ours-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json-out", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", metavar="section.key=value")
    argv = list(sys.argv[1:] if argv is None else argv)
    for i in range(len(argv) - 1):  # `--xla-flags "--xla_foo=1"`: argparse would read the value as an option
        if argv[i] == "--xla-flags":
            argv[i:i + 2] = [f"--xla-flags={argv[i + 1]}"]
            break
    args = p.parse_intermixed_args(argv)  # overrides may come before and after options
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.ours_only:
        try:
            result = run_ours(args)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(result, f)
        else:
            print(json.dumps(result))
        return 0
    return main_parent(args)


if __name__ == "__main__":
    sys.exit(main())
