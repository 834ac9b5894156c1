"""What microbatches cost in the kernels themselves, at llama-1b's shapes on one GPU: the weight-gradient product
written in bf16 once (one batch), added into an fp32 sum in its epilogue (each microbatch under accumulation) and
written new in fp32, at 2,048 to 16,384 rows; and cuDNN's causal attention, forward and forward + backward, at
batch 1, 2, 4 and 8 of 2,048 positions (16 heads of 128).

    python benchmarks/microbatch_kernels.py [--results-dir DIR]

Products run eight distinct operand pairs in one jitted call (none read from L2, one dispatch); times are wall
time per product or call after two untimed calls. Appends one record per point to `<results-dir>/results.jsonl`
(`"bench": "microbatch_wgrad" | "microbatch_wgrad_layer" | "microbatch_attention"`). Needs a GPU; never run in CI.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import time

import jax
import jax.numpy as jnp

HERE = os.path.dirname(os.path.abspath(__file__))
PAIRS = 8
D, F = 2048, 5632
KERNELS = {"qkvo": (D, D, 4), "gate_up": (D, F, 2), "down": (F, D, 1)}  # (K, N, products of that shape a layer)


def timed(f, *args, n: int = 10) -> float:
    for _ in range(2):
        jax.block_until_ready(f(*args))
    t = time.perf_counter()
    for _ in range(n):
        out = f(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / n


def weight_gradients(rows: int) -> list[dict]:
    """Per kernel, microseconds a product: bf16 out, fp32 added into a sum (donated: in place), fp32 out."""
    out, layer = [], {"bf16_us": 0.0, "f32acc_us": 0.0, "f32new_us": 0.0}
    for name, (k, n, per_layer) in KERNELS.items():
        keys = jax.random.split(jax.random.key(0), 2 * PAIRS)
        xs = tuple(jax.random.normal(keys[i], (rows, k), jnp.bfloat16) for i in range(PAIRS))
        dys = tuple(jax.random.normal(keys[PAIRS + i], (rows, n), jnp.bfloat16) for i in range(PAIRS))
        bf16 = jax.jit(lambda xs, dys: tuple(x.T @ d for x, d in zip(xs, dys)))
        new = jax.jit(lambda xs, dys: tuple(jnp.dot(x.T, d, preferred_element_type=jnp.float32)
                                            for x, d in zip(xs, dys)))
        add = jax.jit(lambda sums, xs, dys: tuple(s + jnp.dot(x.T, d, preferred_element_type=jnp.float32)
                                                  for s, x, d in zip(sums, xs, dys)), donate_argnums=0)
        sums = tuple(jnp.zeros((k, n), jnp.float32) for _ in range(PAIRS))
        for _ in range(2):
            sums = add(sums, xs, dys)
        jax.block_until_ready(sums)
        t = time.perf_counter()
        for _ in range(10):
            sums = add(sums, xs, dys)
        jax.block_until_ready(sums)
        us = {"bf16_us": timed(bf16, xs, dys) / PAIRS * 1e6, "f32acc_us": (time.perf_counter() - t) / 10 / PAIRS * 1e6,
              "f32new_us": timed(new, xs, dys) / PAIRS * 1e6}
        for key, v in us.items():
            layer[key] += per_layer * v
        out.append({"bench": "microbatch_wgrad", "rows": rows, "kernel": name, **us})
    return out + [{"bench": "microbatch_wgrad_layer", "rows": rows, **layer}]


def attention(batch: int, heads: int = 16, seq: int = 2048, head_dim: int = 128) -> dict:
    q = jax.random.normal(jax.random.key(0), (batch, seq, heads, head_dim), jnp.bfloat16)

    def forward(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    grads = jax.jit(jax.grad(lambda q, k, v: forward(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
    fwd, both = timed(jax.jit(forward), q, q, q, n=30), timed(grads, q, q, q, n=30)
    return {"bench": "microbatch_attention", "batch": batch, "fwd_us": fwd * 1e6, "fwd_bwd_us": both * 1e6,
            "fwd_bwd_us_per_row": both * 1e6 / batch}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results-dir", default=HERE)
    args = p.parse_args()
    common = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "gpu": jax.devices()[0].device_kind, "n_gpus": 1, "jax_version": jax.__version__,
              "command": "python benchmarks/microbatch_kernels.py"}
    records = [r for rows in (2048, 4096, 8192, 16384) for r in weight_gradients(rows)]
    records += [attention(b) for b in (1, 2, 4, 8)]
    os.makedirs(args.results_dir, exist_ok=True)
    with open(os.path.join(args.results_dir, "results.jsonl"), "a") as f:
        for r in records:
            print(json.dumps(r), flush=True)
            f.write(json.dumps({**common, **r}) + "\n")


if __name__ == "__main__":
    main()
