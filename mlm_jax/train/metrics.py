"""Throughput accounting (tokens/s, TFLOP/s per device, MFU), metrics.jsonl, and the progress line."""
from __future__ import annotations

import json
import math
import os
import sys
import time

from mlm_jax.config import ModelConfig

# Dense bf16 peak FLOP/s by device kind (substring match); None (no MFU) for anything else, CPUs included.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "B200": 2250e12}


def peak_flops(device_kind: str) -> float | None:
    return next((v for k, v in PEAK_FLOPS.items() if k.lower() in device_kind.lower()), None)


def flops_per_token(m: ModelConfig, num_params: int, seq_len: int) -> float:
    """Training FLOPs per token: 6 x non-embedding parameters, plus 6 x N x (H_qk + H_v) per key a query sees in
    each layer (S / 2 on average under the causal mask, about w (1 - w / 2S) within a sliding window w).

    In an MoE model only the `top_k` experts a token visits count (the active parameters)."""
    non_embedding = num_params - m.vocab_size * m.hidden_size
    if m.moe.enabled:
        moe_layers = sum(m.moe.is_moe_layer(i) for i in range(m.num_layers))
        non_embedding -= moe_layers * 3 * m.hidden_size * m.expert_ffn * (m.moe.num_experts - m.moe.top_k)
    head = 6 * m.vocab_size * m.hidden_size if m.tie_embeddings else 0
    def keys(i: int) -> float:
        w = min(m.sliding_window, seq_len) if m.is_local(i) else seq_len
        return w * (1 - w / (2 * seq_len))

    qk, v = m.dim_per_head, m.dim_per_head
    if m.mla.enabled:
        qk, v = m.mla.qk_head_dim, m.mla.v_head_dim
    attention = 6 * m.num_heads * (qk + v) * sum(keys(i) for i in range(m.num_layers))
    return 6 * non_embedding + head + attention


def throughput(tokens: int, seconds: float, flops_token: float, num_devices: int, peak: float | None) -> dict:
    tflops = tokens * flops_token / seconds / num_devices / 1e12
    return {"tokens_per_s": tokens / seconds, "tflops_per_device": tflops,
            "mfu": tflops * 1e12 / peak if peak else None, "step_time_s": seconds}


def device_memory(devices) -> dict:
    """The most memory any of `devices` (this process's) holds now and has held at most so far, in GiB, where the
    backend reports it (GPUs; not the CPU): a query of the allocator's counters, no wait for the device."""
    stats = [s for s in (d.memory_stats() for d in devices) if s and "peak_bytes_in_use" in s]
    if not stats:
        return {}
    return {"memory_gib": max(s.get("bytes_in_use", 0) for s in stats) / 2**30,
            "memory_peak_gib": max(s["peak_bytes_in_use"] for s in stats) / 2**30}


class MetricsLog:
    """Appends one JSON object per logged step to `<output_dir>/metrics.jsonl` and prints progress."""

    def __init__(self, output_dir: str | None, total_steps: int, progress: str = "auto", enabled: bool = True):
        self.enabled = enabled
        self.path = os.path.join(output_dir, "metrics.jsonl") if output_dir and enabled else None
        self.total = total_steps
        self.tty = progress == "always" or (progress == "auto" and sys.stdout.isatty())
        self.start = time.perf_counter()
        self.open_line = False

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        record = {k: plain(v) for k, v in record.items()}
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        self._print(record)

    def _print(self, r: dict) -> None:
        parts = [f"step {r['step']}/{self.total}"]
        for key in ("loss", "eval_loss"):
            if key in r:
                parts.append(f"{key} {r[key]:.4f}" if r[key] is not None else f"{key} nan")
        tasks = {k[len("eval/"):]: v for k, v in r.items() if k.startswith("eval/") and "_stderr" not in k}
        parts += [f"{k} {v:.4g}" if v is not None else f"{k} nan" for k, v in tasks.items()]
        evaluation = "eval_loss" in r or bool(tasks)  # printed on a line of its own, without an ETA
        if r.get("tokens_per_s"):
            parts.append(f"{r['tokens_per_s']:,.0f} tok/s")
        if r.get("mfu") is not None:
            parts.append(f"MFU {100 * r['mfu']:.1f}%")
        if r.get("skipped_steps"):
            parts.append(f"skipped {r['skipped_steps']}")
        if r.get("straggler"):
            parts.append(f"slowest process {r['slowest_process']} ({r['slowest_host']}) "
                         f"{r['slowest_process_s']:.3g} s/step, {r['slowest_process_s'] / r['process_median_s']:.1f}x "
                         f"the median")
        done = r["step"] / self.total if self.total else 1.0
        if 0 < done < 1 and not evaluation:
            eta = (time.perf_counter() - self.start) * (1 - done) / done
            parts.append(f"ETA {int(eta // 60)}m{int(eta % 60):02d}s")
        line = " | ".join(parts)
        if self.tty and not evaluation:
            sys.stdout.write("\r\033[K" + line)
            self.open_line = True
        else:
            self.end_line()
            print(line)
        sys.stdout.flush()

    def end_line(self) -> None:
        if self.open_line:
            sys.stdout.write("\n")
            self.open_line = False


def plain(v):
    """JSON-safe scalars and lists (per-layer metrics); non-finite floats as null."""
    if hasattr(v, "tolist"):
        v = v.tolist()
    if isinstance(v, list):
        return [plain(x) for x in v]
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v
