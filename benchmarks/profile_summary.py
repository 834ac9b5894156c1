"""Where the GPU time of a profiled run goes: kernels grouped by kind, from a `log.profile_steps` trace.

    python benchmarks/profile_summary.py RUN_DIR/profile [--top 25] [--steps N] [--hlo AFTER_OPTIMIZATIONS.txt]

Reads the Perfetto JSON (`*.trace.json.gz`) that `jax.profiler` writes next to the TensorBoard trace, sums the
device-side events of GPU 0 by kernel name and by kind (matmul, attention, communication, fused elementwise or
reduction, copies), and prints milliseconds per step when `--steps` (the profiled step count) is given. With
`--hlo` (the `*after_optimizations.txt` that `XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_as_text` writes), each
fused kernel is followed by the JAX operation and source line it came from.
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys

KINDS = [  # first match wins
    ("attention", re.compile(r"fmha|flash|cudnn|attn|sdpa", re.I)),
    ("communication", re.compile(r"nccl|all[-_]?reduce|all[-_]?gather|reduce[-_]?scatter|collective|permute", re.I)),
    ("matmul", re.compile(r"gemm|matmul|cutlass|xmma|cublas|sm\d+_.*(?:tn|nt|nn)|triton_gemm|dot", re.I)),
    ("copy/transpose", re.compile(r"copy|transpose|memcpy|memset|dynamic[-_]update[-_]slice", re.I)),
    ("reduction", re.compile(r"reduce|input_reduce", re.I)),
    ("elementwise/fusion", re.compile(r"fusion|loop_|elementwise|convert|broadcast|concatenate|slice|select", re.I)),
]


def find_trace(path: str) -> str:
    if os.path.isfile(path):
        return path
    found = sorted(glob.glob(os.path.join(path, "**", "*.trace.json.gz"), recursive=True), key=os.path.getmtime)
    if not found:
        raise SystemExit(f"error: no *.trace.json.gz under {path} (run with log.profile_steps=[a,b])")
    return found[-1]


def kind_of(name: str) -> str:
    return next((k for k, rx in KINDS if rx.search(name)), "other")


def device_events(trace: dict) -> list[dict]:
    """Complete events of the first GPU's streams (process names like '/device:GPU:0')."""
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in trace.get("traceEvents", [])
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu = sorted(pid for pid, n in names.items() if re.search(r"/device:GPU:0\b", n))
    if not gpu:
        raise SystemExit("error: the trace has no '/device:GPU:0' process (was it taken on a GPU?)")
    return [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("pid") == gpu[0] and "dur" in e]


def fusion_origins(hlo_path: str) -> dict[str, str]:
    """Kernel name (dots as underscores) -> the fusion's op_name (and source line, when recorded) in the HLO. XLA
    compiles identical fusions once and launches that kernel under the first one's name (`deduplicated_name`), so
    such a name's time is that of every fusion sharing it: their count is appended."""
    origins, shared = {}, collections.Counter()
    rx = re.compile(r"^\s*(?:ROOT )?%?([\w.-]+) = .*?\b(?:fusion|custom-call)\(.*?metadata=\{([^}]*)\}")
    with open(hlo_path) as f:
        for line in f:
            m = rx.match(line)
            if not m:
                continue
            meta = dict(re.findall(r'(\w+)="?([^"\s]*(?:\s[^"=]*)?)"?', m.group(2)))
            where = f" @ {os.path.basename(meta['source_file'])}:{meta.get('source_line')}" if "source_file" in meta else ""
            origins[m.group(1).replace(".", "_")] = meta.get("op_name", "")[-100:] + where
            shared[meta.get("deduplicated_name", m.group(1)).replace(".", "_")] += 1
    return {name: origin + (f"  (the kernel of {shared[name]} fusions)" if shared[name] > 1 else "")
            for name, origin in origins.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/profile_summary.py", description=__doc__.split("\n\n")[0])
    p.add_argument("path", help="a profile directory (log.profile_dir) or a .trace.json.gz file")
    p.add_argument("--top", type=int, default=25, help="kernels to list")
    p.add_argument("--steps", type=int, default=1, help="steps in the trace, to report per-step times")
    p.add_argument("--hlo", help="the optimized HLO text of the step, to name where each fused kernel comes from")
    args = p.parse_args(argv)
    origins = fusion_origins(args.hlo) if args.hlo else {}
    path = find_trace(args.path)
    with gzip.open(path, "rt") as f:
        events = device_events(json.load(f))
    by_name, by_kind, launches = collections.Counter(), collections.Counter(), collections.Counter()
    for e in events:
        by_name[e["name"]] += e["dur"]
        launches[e["name"]] += 1
        by_kind[kind_of(e["name"])] += e["dur"]
    busy = sum(by_kind.values())
    span = (max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)) if events else 0
    per = 1e3 * args.steps
    print(f"{path}\nGPU 0: {len(events)} events, busy {busy / per:.1f} ms/step (summed over streams), "
          f"span {span / per:.1f} ms/step")
    for k, us in by_kind.most_common():
        print(f"  {k:<20} {us / per:9.2f} ms/step  {100 * us / busy:5.1f}%")
    print(f"top {args.top} kernels:")
    for name, us in by_name.most_common(args.top):
        print(f"  {us / per:9.2f} ms/step  {100 * us / busy:5.1f}%  {launches[name] / args.steps:6.0f}x  "
              f"[{kind_of(name)}] {name[:110]}")
        if name in origins:
            print(f"{'':31}{origins[name]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
