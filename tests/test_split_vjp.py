"""A chunk's backward split into B (input gradient) and W (weight gradient) gives the pullback's gradients, runs
each of the backward's matmuls once (W only the weight-gradient ones), and is analysed once for every later trace.

fp32; a 2-layer MLP stack and the real model's blocks (2 layers, hidden 64), layers unrolled and scanned.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax.sharding import PartitionSpec
from jaxprs import equations, trips

from mlm_jax import load_config
from mlm_jax.model.transformer import layer_kinds, model_spec
from mlm_jax.parallel.recompute import stash_policy
from mlm_jax.parallel.split_vjp import split_pullback
from mlm_jax.parallel.stages import ChunkSlots, run_chunk

L, B, S, D, F = 2, 2, 8, 64, 128  # layers, batch rows, sequence, model, ffn


@functools.cache
def _mlp(layout: str):
    """A residual MLP stack over (L, D, F) / (L, F, D) weights, layers unrolled, scanned, or scanned with each
    layer a scan of 2 steps (a scan inside the scan)."""
    def layer(x_BSD, w):
        return x_BSD + jax.nn.gelu(x_BSD @ w["in_DF"]) @ w["out_FD"], None

    def f(w, x_BSD):
        if layout == "scan":
            return jax.lax.scan(layer, x_BSD, w)[0]
        if layout == "nested":
            return jax.lax.scan(lambda x, w: (jax.lax.scan(lambda x, _: layer(x, w), x, None, length=2)[0], None),
                                x_BSD, w)[0]
        for i in range(L):
            x_BSD = layer(x_BSD, jax.tree.map(lambda a: a[i], w))[0]
        return x_BSD

    k1, k2 = jax.random.split(jax.random.key(0))
    w = {"in_DF": jax.random.normal(k1, (L, D, F)) / D ** 0.5, "out_FD": jax.random.normal(k2, (L, F, D)) / F ** 0.5}
    return f, w, 2 * L * (2 if layout == "nested" else 1)


@functools.cache
def _model(scan: bool, *overrides, active=None, local=None):
    """The model's blocks as a pipeline chunk runs them (`_Stage.chunk`: `active`, whether each of the last layers
    runs, as in a chunk shorter than its stage's room; `local`, traced window flags, as in a chunk whose layer kinds
    differ from other chunks'), and its number of weight matmuls: one for each (L, ...) weight of 3 dims or more,
    in each layer, but one for an MoE layer's gate and up experts (`model.experts`: one grouped matmul)."""
    m = load_config(None, [f"model.num_layers={L}", f"model.hidden_size={D}", "model.num_heads=4",
                           f"model.ffn_size={F}", "model.vocab_size=128", "model.dtype=float32",
                           f"model.scan_layers={str(scan).lower()}", *overrides]).model
    spec = model_spec(m)
    keys = iter(jax.random.split(jax.random.key(0), len(jax.tree.leaves(spec.shapes))))
    params = jax.tree.map(lambda s: 0.1 * jax.random.normal(next(keys), s.shape, s.dtype), spec.shapes)
    positions_BS = jnp.broadcast_to(jnp.arange(S), (B, S))
    kinds = layer_kinds(m)
    optional = (False,) * (L - len(active or ())) + (True,) * len(active or ())
    slots = ChunkSlots(stacks=tuple(stack for stack, _ in kinds), optional=optional,
                       local=tuple(None if local else is_local for _, is_local in kinds))
    stacks = sorted({stack for stack, _ in kinds})

    def f(pools, x_BSD):
        on = None if active is None else jnp.asarray((True,) * (L - len(active)) + tuple(active))
        flags = None if local is None else jnp.asarray(local)
        return run_chunk(nnx.merge(spec.graphdef, params), x_BSD, positions_BS, pools, slots, on, flags)[0]
    pools = {stack: params[stack] for stack in stacks}
    matmuls = sum(sum(a.ndim >= 3 for a in jax.tree.leaves(w)) * len(jax.tree.leaves(w)[0]) for w in pools.values())
    matmuls -= sum(len(w["moe"]["experts"]["gate"]) for w in pools.values() if "moe" in w)  # gate+up: one product
    return f, pools, matmuls


CASES = {
    "mlp-unrolled": lambda: _mlp("unrolled"),
    "mlp-scan": lambda: _mlp("scan"),
    "mlp-scan-in-scan": lambda: _mlp("nested"),
    "model-unrolled": lambda: _model(False),
    "model-scan": lambda: _model(True),
    "model-unrolled-remat-dots": lambda: _model(False, "model.remat=dots"),
    "model-scan-remat-full": lambda: _model(True, "model.remat=full"),
    "moe-unrolled": lambda: _model(False, "model.moe.num_experts=4"),
    "moe-scan": lambda: _model(True, "model.moe.num_experts=4"),
    "model-unrolled-layer-skipped": lambda: _model(False, active=(False,)),
    "model-scan-layer-skipped": lambda: _model(True, active=(False, True)),
    "moe-scan-layer-skipped": lambda: _model(True, "model.moe.num_experts=4", active=(True, False)),
    "dense-then-moe-unrolled": lambda: _model(False, "model.moe.num_experts=4", "model.moe.first_dense_layers=1"),
    "window-chosen-per-chunk-scan": lambda: _model(True, "model.sliding_window=4", "model.local_rope_theta=100",
                                                   local=(True, False)),
}


def _vjp(f, w, x):
    """As the pipeline's forward slot takes a chunk's VJP."""
    return jax.vjp(jax.checkpoint(f, policy=stash_policy, prevent_cse=False), w, x)


def _analysed(f, w, x):
    """(split, the pullback's treedef, its residual leaves' shapes), analysed under `eval_shape`."""
    found = {}

    def analyse(w, x):
        y, pullback = _vjp(f, w, x)
        leaves, treedef = jax.tree.flatten(pullback)
        found.update(split=split_pullback(pullback, y), treedef=treedef,
                     residuals=[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in leaves])
        return y

    jax.eval_shape(analyse, w, x)
    return found["split"], found["treedef"], found["residuals"]


def _inputs(seed=1):
    kx, kg = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, (B, S, D)), jax.random.normal(kg, (B, S, D))


def _assert_close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6 * float(jnp.max(jnp.abs(w))))


def _matmuls(jaxpr) -> int:
    """Matmul equations (dot_general, ragged_dot_general), through sub-jaxprs, times scan lengths."""
    return sum(trips(loops) for eqn, loops in equations(jaxpr) if "dot" in eqn.primitive.name)


@pytest.mark.parametrize("case", list(CASES))
def test_input_grad_then_weight_grad_match_the_pullback(case):
    f, w, _ = CASES[case]()
    x, g = _inputs()
    found = {}

    @jax.jit
    def grads(w, x, g):
        y, pullback = _vjp(f, w, x)
        split = found["split"] = split_pullback(pullback, y)
        g_x, kept = split.input_grad(pullback, g)
        return (split.weight_grad(pullback, kept), g_x), kept, pullback(g)

    got, kept, want = grads(w, x, g)
    assert [(k.shape, k.dtype) for k in kept] == [(s.shape, s.dtype) for s in found["split"].kept_shapes]
    _assert_close(got, want)


@pytest.mark.parametrize("case", list(CASES))
def test_weight_grad_runs_only_the_weight_matmuls(case):
    f, w, weight_matmuls = CASES[case]()
    x, g = _inputs()
    split, treedef, res = _analysed(f, w, x)
    full = jax.make_jaxpr(lambda res, g: jax.tree.unflatten(treedef, res)(g))(res, g)
    b = jax.make_jaxpr(lambda res, g: split.input_grad(jax.tree.unflatten(treedef, res), g))(res, g)
    w_jaxpr = jax.make_jaxpr(lambda res, k: split.weight_grad(jax.tree.unflatten(treedef, res), k))(
        res, list(split.kept_shapes))
    assert _matmuls(b) + _matmuls(w_jaxpr) == _matmuls(full)
    assert _matmuls(w_jaxpr) == weight_matmuls


def test_kept_values_are_the_matmul_cotangents():
    """Per layer, the output cotangents of the 7 weight matmuls (q, k, v, o, gate, up, down) and of the 2 norms
    (their scales' gradients): nothing W can recompute from the residuals."""
    f, w, _ = _model(False)
    split = _analysed(f, w, _inputs()[0])[0]
    per_layer = sorted(s.shape for s in split.kept_shapes[:len(split.kept_shapes) // L])
    assert len(split.kept_shapes) == 9 * L
    assert per_layer == sorted([(B, S, D)] * 4 + [(B, S, F)] * 2 + [(B, S, 4, D // 4)] * 3)


@pytest.mark.parametrize("case", ["mlp-unrolled", "model-scan", "model-unrolled"])
def test_analysis_under_eval_shape_serves_jit_and_scan_bodies(case):
    """Analysed once under `eval_shape`; then, in a jitted program, one scan over microbatches runs the forward and
    B and stashes the residual leaves and kept values into buffers from `kept_shapes`, and a second scan rebuilds
    each pullback from its stash (with the analysed trace's treedef) and runs W."""
    f, w, _ = CASES[case]()
    M = 3
    xs, gs = (jnp.stack(a) for a in zip(*(_inputs(seed) for seed in range(M))))
    split, treedef, res = _analysed(f, w, xs[0])

    @jax.jit
    def split_backward(w, xs, gs):
        def forward_and_b(stash, m):
            _, pullback = _vjp(f, w, xs[m])
            g_x, kept = split.input_grad(pullback, gs[m])
            stash = [s.at[m].set(a) for s, a in zip(stash, jax.tree.leaves(pullback) + kept, strict=True)]
            return stash, g_x

        stash = [jnp.zeros((M, *s.shape), s.dtype) for s in [*res, *split.kept_shapes]]
        stash, g_xs = jax.lax.scan(forward_and_b, stash, jnp.arange(M))

        def weight(acc, stashed):
            pullback = jax.tree.unflatten(treedef, stashed[:len(res)])
            return jax.tree.map(jnp.add, acc, split.weight_grad(pullback, stashed[len(res):])), None

        g_w, _ = jax.lax.scan(weight, jax.tree.map(jnp.zeros_like, w), stash)
        return g_w, g_xs

    @jax.jit
    def reference(w, xs, gs):
        def body(acc, xg):
            g_w, g_x = _vjp(f, w, xg[0])[1](xg[1])
            return jax.tree.map(jnp.add, acc, g_w), g_x
        return jax.lax.scan(body, jax.tree.map(jnp.zeros_like, w), (xs, gs))

    _assert_close(split_backward(w, xs, gs), reference(w, xs, gs))


@pytest.mark.parametrize("check_vma", [False, True])
def test_split_inside_shard_map_with_collectives(check_vma):
    """As in the pipeline's per-stage body: a manual `stage` axis, and collectives in the chunk's backward."""
    f0, w, _ = _mlp("scan")

    def f(w, x_BSD):
        y_BSD = f0(w, x_BSD)
        return y_BSD + jax.lax.ppermute(y_BSD, "stage", [(0, 1), (1, 0)]) + jax.lax.psum(y_BSD, "stage")

    def per_stage(w, x, g):
        y, pullback = _vjp(f, w, x)
        split = split_pullback(pullback, y)
        g_x, kept = split.input_grad(pullback, g)
        return (split.weight_grad(pullback, kept), g_x), pullback(g)

    mesh = jax.make_mesh((2, 4), ("stage", "data"))
    stage = PartitionSpec("stage")
    got, want = jax.jit(jax.shard_map(per_stage, mesh=mesh, in_specs=(PartitionSpec(), stage, stage),
                                      out_specs=stage, axis_names={"stage"}, check_vma=check_vma))(w, *_inputs())
    _assert_close(got, want)
