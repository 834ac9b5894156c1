"""Products of a few rows (decode steps) with llama-1b's weights: XLA's against `ops.gemv`'s Pallas kernel
over a grid of its block sizes, split counts, warps and pipeline stages. GPU time from CUPTI, per product, over
eight distinct weights so that none is read from L2.

    python benchmarks/few_rows.py --rows 32 [--budget 85]
"""
import argparse
import itertools
import time

import jax
import jax.numpy as jnp
from jax.experimental.mosaic.gpu import profiler

from mlm_jax.ops import gemv

SHAPES = {"qkv": (2048, 6144), "gate_up": (2048, 11264), "down": (5632, 2048), "out": (2048, 2048),
          "head": (2048, 32768)}  # (K, N) of llama-1b's products, q/k/v and gate/up fused
WEIGHTS = 8
GRID = list(itertools.product((32, 64, 128, 256), (64, 128, 256), (1, 2, 4, 8, 16), (4, 8), (3, 4)))


def per_product_us(product, x, ws) -> tuple[float, list]:
    """Microseconds of GPU time a product, the product rounded as a consumer would read it."""
    f = jax.jit(lambda x, ws: [(product(x, w).astype(jnp.float32) * 1.5).astype(x.dtype) for w in ws])
    ys = f(x, ws)
    return min(profiler.measure(f)(x, ws)[1] for _ in range(3)) * 1e3 / len(ws), ys


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--budget", type=float, default=85, help="seconds of kernel configs tried per shape")
    args = p.parse_args()
    key = jax.random.key(0)
    for name, (K, N) in SHAPES.items():
        x = jax.random.normal(key, (args.rows, K), jnp.bfloat16)
        ws = [jax.random.normal(jax.random.fold_in(key, i), (K, N), jnp.bfloat16) * 0.02 for i in range(WEIGHTS)]
        tbs = lambda us: K * N * 2 / us / 1e6  # noqa: E731
        xla_us, ref = per_product_us(jnp.dot, x, ws)
        print(f"{name} {args.rows} x {K} x {N}: XLA {xla_us:.2f} us, {tbs(xla_us):.2f} TB/s", flush=True)
        tried, stop = [], time.time() + args.budget
        for bk, bn, splits, warps, stages in GRID:
            if time.time() > stop:
                break
            if N % bn or K % (splits * bk) or (K // (splits * bk) == 1 and stages > 3):
                continue
            kernel = lambda x, w: gemv.matmul(x, w, block_k=bk, block_n=bn, splits=splits,  # noqa: E731
                                              num_warps=warps, num_stages=stages)
            us, ys = per_product_us(kernel, x, ws)
            err = float(jnp.max(jnp.abs(ys[0].astype(jnp.float32) - ref[0].astype(jnp.float32))))
            tried.append((us, (bk, bn, splits, warps, stages), err))
        for us, config, err in sorted(tried)[:3]:
            print(f"  kernel {us:.2f} us, {tbs(us):.2f} TB/s, (block_k, block_n, splits, warps, stages) {config}, "
                  f"max |error| {err:.3g}", flush=True)
        print(f"  ({len(tried)} configs tried)", flush=True)


if __name__ == "__main__":
    main()
