"""A decode step's attention alone at a model's shapes: `ops.flash_decode`'s kernel (fed the fused q/k/v product,
as generation feeds it from 5 rows) against the path XLA runs without it (the row scale, RoPE, two cache scatters,
cuDNN's flash kernel), and the kernel's tensor-core configs over a grid at the largest batch.

    python benchmarks/decode_attention.py [--config configs/llama-1b.yaml] [--batches 32 8 2 1] [--cache 768]
        [--written 640] [--budget 100]

Each figure is the wall time of a jitted loop of 20 repeats of one attention per layer, each layer its own caches
(so that none is read from L2), over 20 x layers. It prints, it records nothing. On a CPU (a smoke test) the XLA
path attends through XLA's products and the kernel runs interpreted.
"""
import argparse
import contextlib
import functools
import itertools
import math
import time

import jax
import jax.numpy as jnp

from mlm_jax import load_config
from mlm_jax.infer import kv_cache
from mlm_jax.ops import flash_decode
from mlm_jax.model.rope import RopeConfig, apply_rope, tables

REPEATS = 20
GRID = list(itertools.product((32, 16, 64), (4, 8), (3, 4, 2)))  # (MMA_BLOCK, MMA_WARPS, MMA_STAGES)


def xla_path(N, K, H, rope, impl):
    def attend(y_BTKJH, cos, sin, k_BCKH, v_BCKH, positions_BT, row_scale_BT):
        B, G = y_BTKJH.shape[0], N // K
        q_BTNH = y_BTKJH[:, :, :, :G].reshape(B, 1, N, H)
        k_BTKH, v_BTKH = y_BTKJH[:, :, :, G], y_BTKJH[:, :, :, G + 1]
        q_BTNH, k_BTKH, v_BTKH = (x * row_scale_BT[:, :, None, None].astype(x.dtype) for x in (q_BTNH, k_BTKH, v_BTKH))
        q_BTNH, k_BTKH = apply_rope(q_BTNH, positions_BT, rope), apply_rope(k_BTKH, positions_BT, rope)
        k_BCKH, v_BCKH = kv_cache.write(k_BCKH, k_BTKH, positions_BT), kv_cache.write(v_BCKH, v_BTKH, positions_BT)
        return kv_cache.attend_cached(q_BTNH, k_BCKH, v_BCKH, positions_BT, None, impl), k_BCKH, v_BCKH
    return attend


def kernel_path(H, interpret, **constants):
    def attend(*args):
        with kernel_constants(**constants):
            return flash_decode.step(*args, scale=1 / math.sqrt(H), interpret=interpret)
    return attend


@contextlib.contextmanager
def kernel_constants(**constants):
    """`ops.flash_decode`'s module constants set (they are read while tracing), then restored."""
    kept = {name: getattr(flash_decode, name) for name in constants}
    for name, value in constants.items():
        setattr(flash_decode, name, value)
    try:
        yield
    finally:
        for name, value in kept.items():
            setattr(flash_decode, name, value)


def time_us(attend, B, L, N, K, H, C, written, rope) -> tuple[float, jax.Array]:
    """Microseconds of one layer's attention, and the first repeat's outputs."""
    keys = jax.random.split(jax.random.key(B), 4)
    positions_BT = jnp.full((B, 1), written - 1, jnp.int32)
    y_LBTKJH = jax.random.normal(keys[0], (L, B, 1, K, N // K + 2, H), jnp.bfloat16)
    row_scale_BT = jax.random.uniform(keys[1], (B, 1), minval=0.5, maxval=2.0)
    cos, sin = tables(positions_BT, rope)
    caches = [[jax.random.normal(jax.random.fold_in(key, i), (B, C, K, H), jnp.bfloat16) for i in range(L)]
              for key in keys[2:]]

    def layers(k_caches, v_caches):
        outs = [attend(y_LBTKJH[i], cos, sin, k_caches[i], v_caches[i], positions_BT, row_scale_BT) for i in range(L)]
        return jnp.stack([o[0] for o in outs]), [o[1] for o in outs], [o[2] for o in outs]

    first = jax.jit(layers)(*caches)[0]
    loop = jax.jit(lambda k, v: jax.lax.fori_loop(0, REPEATS, lambda i, c: layers(*c[1:]),
                                                  (jnp.zeros_like(first), k, v)), donate_argnums=(0, 1))
    out, *caches = loop(*caches)
    out.block_until_ready()
    best = math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        out, *caches = loop(*caches)
        out.block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return best * 1e6 / REPEATS / L, first


def _rate(cache_bytes: int, us: float) -> str:
    return f"{us:8.1f} us {cache_bytes / us / 1e6:5.2f} TB/s"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/llama-1b.yaml")
    p.add_argument("--batches", type=int, nargs="+", default=[32, 8, 2, 1])
    p.add_argument("--cache", type=int, default=768, help="cache slots a row")
    p.add_argument("--written", type=int, default=640, help="written slots (the new position the last)")
    p.add_argument("--budget", type=float, default=100, help="seconds of tensor-core configs tried")
    p.add_argument("overrides", nargs="*", help="section.key=value")
    args = p.parse_args()
    m = load_config(args.config, args.overrides).model
    N, K, H, L = m.num_heads, m.kv_heads, m.dim_per_head, m.num_layers
    rope = RopeConfig(theta=m.rope_theta, rotary_dim=H)
    gpu = jax.devices()[0].platform == "gpu"
    shape = {"L": L, "N": N, "K": K, "H": H, "C": args.cache, "written": args.written, "rope": rope}
    print(f"{jax.devices()[0].device_kind}: {L} layers, {N} heads, {K} K/V heads of {H}, cache {args.cache} slots, "
          f"{args.written} written; us a layer")
    for B in sorted(args.batches, reverse=True):
        cache_bytes = B * args.written * K * H * 2 * 2
        rate = functools.partial(_rate, cache_bytes)
        xla_us, want = time_us(xla_path(N, K, H, rope, "cudnn" if gpu else "xla"), B, **shape)
        print(f"batch {B:3d} ({cache_bytes / 1e6:.1f} MB of cache a layer): XLA path{'':22}{rate(xla_us)}")
        for name, rows in (("kernel, tensor-core products", 1), ("kernel, CUDA-core products", B + 1)):
            with kernel_constants(MMA_ROWS=rows):
                if not flash_decode.supports((B, 1, N, H), (B, args.cache, K, H), H):
                    print(f"   {name:<30} shapes not taken")
                    continue
            us, got = time_us(kernel_path(H, not gpu, MMA_ROWS=rows), B, **shape)
            error = float(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32)).max())
            used = " (used)" if (rows <= B) == (B >= flash_decode.MMA_ROWS) else ""
            print(f"   {name + used:<36}{rate(us)}  max |difference| {error:.3g}")
        if B == max(args.batches) and B >= flash_decode.MMA_ROWS and args.budget > 0:
            kept = (flash_decode.MMA_BLOCK, flash_decode.MMA_WARPS, flash_decode.MMA_STAGES)
            tried, end = [], time.time() + args.budget
            for config in GRID:
                if time.time() > end:
                    break
                if args.cache % config[0] == 0:
                    constants = dict(zip(("MMA_BLOCK", "MMA_WARPS", "MMA_STAGES"), config))
                    tried.append((time_us(kernel_path(H, not gpu, **constants), B, **shape)[0], config))
            tried.sort()
            print(f"   tensor-core configs (block, warps, stages), {len(tried)} tried, kept {kept}:")
            for us, config in tried[:6]:
                print(f"     {config}{rate(us)}")


if __name__ == "__main__":
    main()
