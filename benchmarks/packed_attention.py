"""Documents kept apart on a Hopper GPU: cuDNN's packed layout (`mlm_jax.ops.packed_attention`) against XLA's masked
attention in float32, output and the gradients of q, k and v, for full-sequence and sliding-window attention, MHA and
GQA, rows within the layout's bound and a row beyond it (the masked fallback); then each kernel's forward + backward
time at llama-1b's attention shape, with and without documents.

    python benchmarks/packed_attention.py [--results-dir DIR]

Exits 1 when an error exceeds bfloat16's tolerance (2e-2 of the reference's largest magnitude). GPU only.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mlm_jax.model.attention import local_attention, segment_mask  # noqa: E402

TOLERANCE = 2e-2


def documents(rng, B: int, S: int, mean: int) -> np.ndarray:
    """Segment ids of rows cut into documents of about `mean` tokens."""
    ids = np.zeros((B, S), np.int32)
    for b in range(B):
        s, d = 0, 0
        while s < S:
            n = int(rng.integers(mean // 2, 3 * mean // 2 + 1))
            ids[b, s:s + n], s, d = d, s + n, d + 1
    return ids


def reference(q, k, v, segment_ids, window):
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    return jax.nn.dot_product_attention(*f32, mask=segment_mask(segment_ids, segment_ids), is_causal=True,
                                        implementation="xla",
                                        local_window_size=None if window is None else (window - 1, 0))


def ours(q, k, v, segment_ids, window, packed):
    return local_attention(q, k, v, impl="cudnn", window=window, segment_ids=segment_ids, packed_segments=packed)


def value_and_grads(fn, q, k, v, ct):
    out, vjp = jax.vjp(fn, q, k, v)
    return (out, *vjp(ct.astype(out.dtype)))


def check(name, B, S, N, K, H, mean, window, packed, rng) -> dict:
    keys = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 4)
    q, k, v, ct = (jax.random.normal(kk, (B, S, n, H), jnp.bfloat16) for kk, n in zip(keys, (N, K, K, N)))
    seg = jnp.asarray(documents(rng, B, S, mean))
    want = jax.jit(lambda q, k, v, ct: value_and_grads(lambda *a: reference(*a, seg, window), q, k, v, ct))(
        q, k, v, ct)
    got = jax.jit(lambda q, k, v, ct: value_and_grads(lambda *a: ours(*a, seg, window, packed), q, k, v, ct))(
        q, k, v, ct)
    errors = {part: float(jnp.max(jnp.abs(g.astype(jnp.float32) - w)) / float(jnp.max(jnp.abs(w))))
              for part, g, w in zip(("out", "dq", "dk", "dv"), got, want)}
    most = int(jnp.max(jnp.sum(jnp.diff(seg, axis=1) != 0, axis=1) + 1))
    return {"case": name, "shape": [B, S, N, K, H], "window": window, "packed_segments": packed,
            "segments_in_fullest_row": most, "path": "packed" if most <= packed else "masked fallback",
            "relative_error": errors, "ok": all(e <= TOLERANCE for e in errors.values())}


def timing(fn, *args, reps: int = 20) -> float:
    f = jax.jit(fn)
    jax.block_until_ready(f(*args))
    t = time.perf_counter()
    for _ in range(reps):
        out = f(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / reps * 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results-dir", default=os.path.dirname(os.path.abspath(__file__)))
    args = p.parse_args()
    rng = np.random.default_rng(0)
    cases = [check("mha, documents of ~256", 8, 2048, 16, 16, 128, 256, None, 32, rng),
             check("gqa 32/8 heads of 64, documents of ~256", 4, 2048, 32, 8, 64, 256, None, 32, rng),
             check("mha, sliding window 512", 4, 2048, 16, 16, 128, 700, 512, 32, rng),
             check("gqa, a row beyond the bound", 4, 2048, 32, 8, 64, 40, None, 32, rng)]
    for c in cases:
        print(json.dumps(c))
    B, S, N, H = 8, 2048, 16, 128
    keys = jax.random.split(jax.random.key(1), 3)
    q, k, v = (jax.random.normal(kk, (B, S, N, H), jnp.bfloat16) for kk in keys)
    seg = jnp.asarray(documents(rng, B, S, 256))

    def step(attend):
        return lambda q, k, v: jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32)),
                                        argnums=(0, 1, 2))(q, k, v)
    ms = {"no documents": timing(step(lambda q, k, v: ours(q, k, v, None, None, 0)), q, k, v),
          "documents, packed layout": timing(step(lambda q, k, v: ours(q, k, v, seg, None, 32)), q, k, v),
          "documents, mask (bias)": timing(step(lambda q, k, v: ours(q, k, v, seg, None, 0)), q, k, v),
          "documents, packed layout, bound 16": timing(step(lambda q, k, v: ours(q, k, v, seg, None, 16)), q, k, v)}
    for name, t in ms.items():
        print(f"{name:40s} {t:8.3f} ms forward + backward, [{B}, {S}, {N}, {H}]")
    record = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "gpu": jax.devices()[0].device_kind, "jax_version": jax.__version__,
              "benchmark": "packed_attention", "checks": cases, "forward_backward_ms": ms}
    with open(os.path.join(args.results_dir, "results.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")
    sys.exit(0 if all(c["ok"] for c in cases) else 1)


if __name__ == "__main__":
    main()
