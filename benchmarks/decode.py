"""Generation speed of mlm_jax against Hugging Face transformers on the same llama-shaped model (random bf16
weights), with the memory-bandwidth roofline of decoding.

    python benchmarks/decode.py [--config configs/llama-1b.yaml] [--batches 1 32] [--prompt-len 512]
        [--new-tokens 256] [--repeats 5] [--rounds 1] [--bandwidth 4.3e12] [--skip-hf] [--results-dir DIR]
        [section.key=value ...]

For each batch size B, prompts of P random token ids and N new tokens (no stop tokens: every row decodes all N):
prefill = the median time of a generate call with one new token (P tokens per row in), and decode = the median
time of a call with N new tokens minus the prefill, over B x (N - 1) tokens. Each generate call returns its
tokens to the host, so it is synced. Ours runs `mlm_jax.generate.generate` in a subprocess that imports jax;
transformers runs `LlamaForCausalLM.generate` (SDPA attention, a static cache, which it compiles on CUDA) in a
second subprocess that imports torch, after ours has exited: the two never hold accelerator memory at once, and
this parent process imports neither. With --rounds R the two alternate R times (ours, transformers, ours, ...), and
each time is the median over the rounds of each round's median: a machine that speeds up or slows down during the
call moves both alike.

Roofline of one decode step at batch B: bytes = 2 x (all parameters, minus the input embedding table, of which a
step reads only B rows; an output head counts whole, tied or not) + the KV cache, L x 2 (keys, values) x K kv
heads x head_dim x 2 bytes per position, times B rows times the positions a step attends to averaged over the
decode steps (P + N/2); time = bytes / --bandwidth. `roofline_fraction` = that time / the measured time per step. The
same subprocess measures a 2 GiB device-to-device copy (bytes read + written over time) and a 2 GiB read (a
reduction: what a decode step's products can reach) as checks of --bandwidth. Results: a table, one line per
batch size appended to <results-dir>/results.jsonl (`"bench": "decode"`) and one row to <results-dir>/RESULTS.md
(default: benchmarks/). See benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from mlm_jax import ConfigError, load_config  # noqa: E402  (light: no jax)

BF16_ONLY = ["model.dtype=bfloat16", "model.param_dtype=bfloat16"]  # after the user's: the roofline counts 2 bytes
COPY_BYTES = 2 * 2**30


def median_time(fn, repeats: int) -> float:
    """Median wall time of `fn()` (which syncs) over `repeats` calls, after one untimed call that compiles."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_ours(args, cfg) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from mlm_jax.config import ParallelConfig
    from mlm_jax.infer.generate import generate
    from mlm_jax.model.transformer import model_spec
    from mlm_jax.setup import setup
    from mlm_jax.train.state import init_params

    m, P, N = cfg.model, args.prompt_len, args.new_tokens
    params = init_params(m, 0, None)
    kernels = setup(dataclasses.replace(cfg, parallel=ParallelConfig(data=1)), jax.devices()[:1]).plan.kernels
    model = nnx.merge(model_spec(m, kernels).graphdef, params)
    src = jnp.zeros(COPY_BYTES // 2, jnp.uint16)
    copy = jax.jit(jnp.copy)  # a real copy kernel: XLA cannot alias a parameter that is not donated
    copy_s = median_time(lambda: copy(src).block_until_ready(), args.repeats)
    read = jax.jit(jnp.max)
    read_s = median_time(lambda: read(src).block_until_ready(), args.repeats)
    del src
    rng, runs = np.random.default_rng(0), {}
    for B in args.batches:
        prompts = rng.integers(0, m.vocab_size, (B, P)).tolist()

        def call(n):
            out = generate(model, prompts, max_new_tokens=n)
            assert all(len(row) == n for row in out), "a row stopped early"
        runs[B] = {"prefill_s": median_time(lambda: call(1), args.repeats),
                   "generate_s": median_time(lambda: call(N), args.repeats)}
        print(f"  ours batch {B}: prefill {runs[B]['prefill_s'] * 1e3:.1f} ms, generate {N} "
              f"{runs[B]['generate_s'] * 1e3:.1f} ms", flush=True)
    device = jax.devices()[0]
    return {"platform": device.platform, "gpu": device.device_kind, "jax_version": jax.__version__,
            "num_params": int(sum(x.size for x in jax.tree.leaves(params))),
            "measured_copy_bandwidth": 2 * COPY_BYTES / copy_s, "measured_read_bandwidth": COPY_BYTES / read_s,
            "runs": runs}


def run_hf(args, cfg) -> dict:
    import torch
    import transformers

    m, P, N = cfg.model, args.prompt_len, args.new_tokens
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # one static graph per batch size (dynamo would otherwise make the batch dim dynamic at the second size)
    torch._dynamo.config.automatic_dynamic_shapes = False
    hf_cfg = transformers.LlamaConfig(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.ffn_size,
        num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads, num_key_value_heads=m.kv_heads,
        head_dim=m.dim_per_head, rms_norm_eps=m.norm_eps, tie_word_embeddings=m.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta}, max_position_embeddings=P + N)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM._from_config(hf_cfg, dtype=torch.bfloat16,
                                                           attn_implementation="sdpa").eval()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    runs = {}
    for B in args.batches:
        ids = torch.randint(0, m.vocab_size, (B, P), generator=torch.Generator().manual_seed(B)).to(device)

        def call(n):
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, cache_implementation="static", pad_token_id=0)
            sync()
            assert out.shape == (B, P + n), f"generate returned {tuple(out.shape)}"
        try:
            runs[B] = {"prefill_s": median_time(lambda: call(1), args.repeats),
                       "generate_s": median_time(lambda: call(N), args.repeats)}
            print(f"  transformers batch {B}: prefill {runs[B]['prefill_s'] * 1e3:.1f} ms, generate {N} "
                  f"{runs[B]['generate_s'] * 1e3:.1f} ms", flush=True)
        except Exception as e:  # noqa: BLE001  (recorded: e.g. a static cache the version cannot build)
            runs[B] = {"error": f"{type(e).__name__}: {e}"[:500]}
            print(f"  transformers batch {B} failed: {runs[B]['error']}", flush=True)
    return {"device": device, "gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "torch_version": torch.__version__, "transformers_version": transformers.__version__,
            "note": None if device == "cuda" else "no CUDA: ran on the CPU, eager (no torch.compile)",
            "runs": runs}


def hf_mismatches(m) -> list[str]:
    """What of our config LlamaForCausalLM does not express (the comparison is then not like for like)."""
    checks = {"norm": m.norm != "rmsnorm", "activation": m.activation != "swiglu", "qk_norm": m.qk_norm,
              "qkv_bias": m.qkv_bias, "post_norms": m.post_norms, "scale_embeddings": m.scale_embeddings,
              "sliding_window": m.sliding_window is not None, "rope_scaling": m.rope_scaling.rope_type != "default",
              "partial_rotary_factor": m.partial_rotary_factor != 1, "final_logit_softcap": m.final_logit_softcap,
              "attention_scale": m.attention_scale, "norm_scale_offset": m.norm_scale_offset,
              "moe": m.moe.enabled, "mla": m.mla.enabled}
    return [f"model.{k} differs from Llama" for k, bad in checks.items() if bad]


def roofline_bytes(m, num_params: int, batch: int, P: int, N: int) -> float:
    embed = m.vocab_size * m.hidden_size
    weights = num_params - embed + (embed if m.tie_embeddings else 0)
    kv_per_position = m.num_layers * 2 * m.kv_heads * m.dim_per_head * 2
    return 2 * weights + kv_per_position * batch * (P + N / 2)


def child(args, which: str, json_out: str) -> tuple[dict | None, str | None]:
    cmd = [sys.executable, os.path.abspath(__file__), *args.argv, "--child", which, "--json-out", json_out]
    try:
        rc = subprocess.run(cmd, timeout=args.timeout).returncode
    except subprocess.TimeoutExpired:
        return None, f"{which} timed out after {args.timeout:g} s"
    if rc == 0 and os.path.exists(json_out):
        with open(json_out) as f:
            return json.load(f), None
    return None, f"{which} failed (exit code {rc})"


def rates(run: dict | None, B: int, P: int, N: int) -> tuple[float | None, float | None, float | None]:
    """(prefill tokens/s, decode tokens/s, seconds per decode step) of one batch size, None where it failed or
    where decoding took less time than the noise of the prefill's (too few new tokens)."""
    if not run or "error" in run:
        return None, None, None
    step = (run["generate_s"] - run["prefill_s"]) / (N - 1)
    return (B * P / run["prefill_s"], *((B / step, step) if step > 0 else (None, None)))


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _ratio(a, b):
    return a / b if a and b else None


def records(args, cfg, ours: dict, hf: dict | None, hf_error: str | None) -> list[dict]:
    m, P, N = cfg.model, args.prompt_len, args.new_tokens
    out = []
    for B in args.batches:
        o_pre, o_dec, o_step = rates(ours["runs"][str(B)], B, P, N)
        hf_run = hf["runs"].get(str(B)) if hf else None
        h_pre, h_dec, h_step = rates(hf_run, B, P, N)
        nbytes = roofline_bytes(m, ours["num_params"], B, P, N)
        cmd = ["python", "benchmarks/decode.py", "--config", args.config, "--batches", str(B), "--prompt-len",
               str(P), "--new-tokens", str(N), "--repeats", str(args.repeats),
               *(["--rounds", str(args.rounds)] if args.rounds > 1 else []), "--bandwidth", f"{args.bandwidth:g}"]
        out.append({
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "bench": "decode",
            "gpu": ours["gpu"], "config": cfg.name, "batch": B, "prompt_len": P, "new_tokens": N,
            "ours_prefill_tokens_per_s": o_pre, "ours_decode_tokens_per_s": o_dec,
            "hf_prefill_tokens_per_s": h_pre, "hf_decode_tokens_per_s": h_dec,
            "ratio_decode": _ratio(o_dec, h_dec), "ratio_prefill": _ratio(o_pre, h_pre),
            "roofline_bytes_per_step": nbytes, "roofline_step_s": nbytes / args.bandwidth,
            "ours_decode_step_s": o_step, "hf_decode_step_s": h_step,
            "roofline_fraction": nbytes / args.bandwidth / o_step if o_step else None,
            "hf_roofline_fraction": nbytes / args.bandwidth / h_step if h_step else None,
            "bandwidth": args.bandwidth, "measured_copy_bandwidth": ours["measured_copy_bandwidth"],
            "measured_read_bandwidth": ours["measured_read_bandwidth"],
            "ours": ours["runs"][str(B)], "hf": hf_run, "hf_error": hf_error or (hf_run or {}).get("error"),
            "hf_device": hf and hf["device"], "hf_note": hf and hf["note"], "hf_warnings": hf_mismatches(m),
            "num_params": ours["num_params"], "platform": ours["platform"], "jax_version": ours["jax_version"],
            "torch_version": hf and hf["torch_version"], "transformers_version": hf and hf["transformers_version"],
            "command": shlex.join(cmd + (["--skip-hf"] if args.skip_hf else []) + args.overrides),
            "config_path": args.config, "overrides": args.overrides, "repeats": args.repeats, "rounds": args.rounds})
    return out


def write(results_dir: str, rec: dict) -> None:
    os.makedirs(results_dir, exist_ok=True)
    with open(os.path.join(results_dir, "results.jsonl"), "a") as f:
        f.write(json.dumps(rec) + "\n")
    cells = [rec["date"][:10], f"{rec['gpu']} x1", f"{rec['config']} (decode, batch {rec['batch']}, prompt "
             f"{rec['prompt_len']} + {rec['new_tokens']} new)", f"`{rec['command']}`",
             _fmt(rec["ours_decode_tokens_per_s"], ",.0f") + " decode", "-",
             _fmt(rec["roofline_fraction"], ".0%") + " of roofline",
             "HF " + _fmt(rec["hf_decode_tokens_per_s"], ",.0f"), _fmt(rec["ratio_decode"], ".2f") +
             f" (prefill {_fmt(rec['ratio_prefill'], '.2f')})", "-", "-"]
    with open(os.path.join(results_dir, "RESULTS.md"), "a") as f:
        f.write("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |\n")


COLS = [("batch", 5), ("prefill tok/s", 13), ("HF prefill", 11), ("ratio", 6), ("decode tok/s", 12),
        ("HF decode", 10), ("ratio", 6), ("ms/step", 8), ("roofline ms", 11), ("of roofline", 11)]


def table(recs: list[dict]) -> str:
    rows = [[h for h, _ in COLS]]
    for r in recs:
        step_ms = r["ours_decode_step_s"] and 1e3 * r["ours_decode_step_s"]
        rows.append([str(r["batch"]), _fmt(r["ours_prefill_tokens_per_s"], ",.0f"),
                     _fmt(r["hf_prefill_tokens_per_s"], ",.0f"), _fmt(r["ratio_prefill"], ".2f"),
                     _fmt(r["ours_decode_tokens_per_s"], ",.0f"), _fmt(r["hf_decode_tokens_per_s"], ",.0f"),
                     _fmt(r["ratio_decode"], ".2f"), _fmt(step_ms, ".3f"), f"{r['roofline_step_s'] * 1e3:.3f}",
                     _fmt(r["roofline_fraction"], ".1%")])
    return "\n".join("  ".join(c.rjust(w) for c, (_, w) in zip(row, COLS)) for row in rows)


def combined(results: list[dict]) -> dict:
    """One subprocess's result from several rounds' (the first's, with each batch's times the median over the
    rounds that measured it, and those rounds' own times kept in `rounds`); a single round as it is."""
    if len(results) == 1:
        return results[0]
    out = {**results[0], "runs": {}}
    for B in results[0]["runs"]:
        runs = [r["runs"][B] for r in results if B in r["runs"] and "error" not in r["runs"][B]]
        if not runs:
            out["runs"][B] = results[0]["runs"][B]
            continue
        out["runs"][B] = {k: statistics.median(run[k] for run in runs) for k in ("prefill_s", "generate_s")}
        out["runs"][B]["rounds"] = runs
    for key in ("measured_copy_bandwidth", "measured_read_bandwidth"):
        if key in out:
            out[key] = statistics.median(r[key] for r in results)
    return out


def main_parent(args, cfg) -> int:
    if not args.skip_hf:
        for w in hf_mismatches(cfg.model):
            print(f"warning: transformers cannot match: {w}", file=sys.stderr)
    ours_rounds, hf_rounds, hf_error = [], [], None
    with tempfile.TemporaryDirectory(prefix="mlm_jax-decode-") as tmp:
        for r in range(args.rounds):
            if args.rounds > 1:
                print(f"round {r + 1} of {args.rounds}", flush=True)
            ours, err = child(args, "ours", os.path.join(tmp, f"ours{r}.json"))
            if ours is None:
                print(f"error: {err}", file=sys.stderr)
                return 1
            ours_rounds.append(ours)
            if not args.skip_hf:  # after ours has exited and released the device
                hf, hf_error = child(args, "hf", os.path.join(tmp, f"hf{r}.json"))
                if hf_error:
                    print(f"warning: {hf_error}", file=sys.stderr)
                else:
                    hf_rounds.append(hf)
    ours, hf = combined(ours_rounds), combined(hf_rounds) if hf_rounds else None
    recs = records(args, cfg, ours, hf, None if hf else hf_error)
    results_dir = args.results_dir or HERE
    for rec in recs:
        write(results_dir, rec)
        if rec["ours_decode_step_s"] is None:
            print(f"warning: batch {rec['batch']}: decoding took no longer than prefilling (within noise); "
                  f"raise --new-tokens", file=sys.stderr)
    print(f"\n{cfg.name} on {ours['gpu']}: prompt {args.prompt_len}, {args.new_tokens} new tokens; copy bandwidth "
          f"{ours['measured_copy_bandwidth']:.3g} B/s, read {ours['measured_read_bandwidth']:.3g} B/s (roofline at "
          f"{args.bandwidth:.3g})")
    print(table(recs))
    print(f"\nappended {len(recs)} line(s) to {os.path.join(results_dir, 'results.jsonl')} and "
          f"{os.path.join(results_dir, 'RESULTS.md')}")
    return 0


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python benchmarks/decode.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=os.path.relpath(os.path.join(ROOT, "configs", "llama-1b.yaml")),
                   help="YAML file of the model shape (default: configs/llama-1b.yaml)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32], help="batch sizes, one record each")
    p.add_argument("--prompt-len", type=int, default=512, help="prompt tokens per row (random ids)")
    p.add_argument("--new-tokens", type=int, default=256, help="tokens generated per row (N >= 2)")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per measurement (the median is kept)")
    p.add_argument("--rounds", type=int, default=1,
                   help="times ours and transformers alternate; each time is the median over the rounds")
    p.add_argument("--bandwidth", type=float, default=4.3e12,
                   help="memory bandwidth of the roofline, bytes/s (an H200's device-to-device copy)")
    p.add_argument("--skip-hf", action="store_true", help="measure ours only")
    p.add_argument("--results-dir", help="where results.jsonl and RESULTS.md are appended (default: benchmarks/)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per subprocess (ours or transformers)")
    p.add_argument("--child", choices=["ours", "hf"], help=argparse.SUPPRESS)
    p.add_argument("--json-out", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides of the shape")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_intermixed_args(argv)
    args.argv = argv
    if args.new_tokens < 2 or min(args.prompt_len, args.repeats, args.rounds, *args.batches) < 1:
        p.error("--new-tokens must be >= 2, and --prompt-len, --repeats, --rounds and --batches >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, [*args.overrides, *BF16_ONLY])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.child is None:
        return main_parent(args, cfg)
    result = (run_ours if args.child == "ours" else run_hf)(args, cfg)
    with open(args.json_out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
