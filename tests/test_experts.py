"""Expert FFNs of a Mixture-of-Experts layer: dropless and capacity modes against a naive per-token reference,
the grouped-matmul custom VJP against autodiff, and expert parallelism against one device.

fp32, tiny shapes: B batch, S sequence, D model, F expert ffn, E experts, K experts per token.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from mlm_jax.model.experts import dropless_ffn, expert_ffn, sorted_ffn
from mlm_jax.ops.grouped_matmul import grouped_matmul
from mlm_jax.parallel.expert import expert_parallel_ffn
from mlm_jax.parallel.mesh import build_mesh
from mlm_jax.parallel.rules import DATA_AXES, MESH_AXES

S, D, F, K = 8, 16, 32, 2
TOL = dict(rtol=1e-5, atol=1e-6)


def make_inputs(B=8, E=8, seed=0):
    """x, router choices (distinct top-K experts, softmax weights), SwiGLU weights, and an output cotangent."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape, scale=1.0: jnp.asarray(scale * rng.standard_normal(shape), jnp.float32)
    weights_BSK, experts_BSK = jax.lax.top_k(jax.nn.softmax(normal(B, S, E)), K)
    return dict(x_BSD=normal(B, S, D), experts_BSK=experts_BSK, weights_BSK=weights_BSK,
                gate_EDF=normal(E, D, F, scale=0.3), up_EDF=normal(E, D, F, scale=0.3),
                down_EFD=normal(E, F, D, scale=0.3)), normal(B, S, D)


def reference(x_BSD, experts_BSK, weights_BSK, gate_EDF, up_EDF, down_EFD):
    """Every (token, k) through its own copy of its expert's weights: no sorting, no buffers."""
    h = (jax.nn.silu(jnp.einsum("bsd,bskdf->bskf", x_BSD, gate_EDF[experts_BSK]))
         * jnp.einsum("bsd,bskdf->bskf", x_BSD, up_EDF[experts_BSK]))
    return jnp.einsum("bsk,bskd->bsd", weights_BSK, jnp.einsum("bskf,bskfd->bskd", h, down_EFD[experts_BSK]))


DIFF = ("x_BSD", "weights_BSK", "gate_EDF", "up_EDF", "down_EFD")


def value_and_grads(fn, inputs, cotangent):
    """fn(**inputs) -> (y, dropped); returns y, dropped and the gradients of <y, cotangent> w.r.t. DIFF."""
    def loss(diff):
        y, dropped = fn(**inputs, **diff)
        return jnp.sum(y * cotangent), (y, dropped)

    (_, (y, dropped)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))({k: inputs.pop(k) for k in DIFF})
    return y, dropped, grads


def assert_same(a, b):
    for name in a:
        np.testing.assert_allclose(a[name], b[name], **TOL, err_msg=name)


@pytest.fixture(scope="module")
def dropless():
    """Local dropless output and gradients (E=8, B=8): the baseline the other tests compare with."""
    inputs, cotangent = make_inputs()
    return inputs, cotangent, value_and_grads(lambda **a: expert_ffn(**a, capacity_factor=None, impl="ragged"),
                                              dict(inputs), cotangent)


def test_dropless_matches_reference(dropless):
    inputs, cotangent, (y, dropped, grads) = dropless
    y_ref, _, grads_ref = value_and_grads(lambda **a: (reference(**a), 0), dict(inputs), cotangent)
    np.testing.assert_allclose(y, y_ref, **TOL)
    assert_same(grads, grads_ref)
    assert dropped == 0


def test_capacity_with_room_matches_dropless(dropless):
    inputs, cotangent, (y, _, grads) = dropless
    y_cap, dropped, grads_cap = value_and_grads(lambda **a: expert_ffn(**a, capacity_factor=4.0), dict(inputs),
                                                cotangent)
    assert dropped == 0
    np.testing.assert_allclose(y_cap, y, **TOL)
    assert_same(grads_cap, grads)


def test_capacity_drops_later_choices_first():
    """4 tokens, 2 experts, C = ceil(4*2/2 * 0.5) = 2. Expert 0 ranks the first choices of tokens 0, 2, 3, then
    token 1's second: keeps t0, t2. Expert 1 ranks token 1's first choice, then the second choices of t0, t2, t3:
    keeps t1, t0. Dropped: t3's first choice and the second choices of t1, t2, t3."""
    inputs, _ = make_inputs(B=1, E=2)
    inputs = {k: v[:, :4] if k.endswith("BSD") or k.endswith("BSK") else v for k, v in inputs.items()}
    inputs["experts_BSK"] = jnp.array([[[0, 1], [1, 0], [0, 1], [0, 1]]])
    kept_BSK = jnp.array([[[1, 1], [1, 0], [1, 0], [0, 0]]])
    y, dropped = jax.jit(expert_ffn, static_argnames="capacity_factor")(**inputs, capacity_factor=0.5)
    assert dropped == 4
    kept = {"weights_BSK": inputs["weights_BSK"] * kept_BSK}
    np.testing.assert_allclose(y, jax.jit(reference)(**{**inputs, **kept}), **TOL)


def kept_per_group(experts_BSK, group_rows, capacity_factor, E):
    """Naive capacity: per group of `group_rows` rows, per expert, the group's first choices in token order, then
    its second choices, each kept while the expert holds fewer than C of the group's assignments."""
    experts_BSK = np.asarray(experts_BSK)
    B, S, _ = experts_BSK.shape
    C = int(np.ceil(group_rows * S * K / E * capacity_factor))
    kept_BSK = np.zeros_like(experts_BSK)
    for g in range(0, B, group_rows):
        load = np.zeros(E, int)
        for k in range(K):
            for b in range(g, g + group_rows):
                for s in range(S):
                    e = experts_BSK[b, s, k]
                    kept_BSK[b, s, k] = load[e] < C
                    load[e] += 1
    return kept_BSK


@pytest.mark.parametrize("group_rows, capacity_factor", [(1, 0.5), (2, 0.5), (4, 0.25), (4, 0.5)])
def test_capacity_drops_by_rank_within_groups_of_rows(group_rows, capacity_factor):
    """Random routing against the naive per-group count: outputs, the count dropped, and the gradients (a dropped
    assignment is one whose combine weight is zero)."""
    inputs, cotangent = make_inputs(B=4, E=4, seed=1)
    kept_BSK = kept_per_group(inputs["experts_BSK"], group_rows, capacity_factor, 4)
    y, dropped, grads = value_and_grads(
        lambda **a: expert_ffn(**a, capacity_factor=capacity_factor, capacity_group_rows=group_rows),
        dict(inputs), cotangent)
    y_ref, _, grads_ref = value_and_grads(
        lambda **a: (reference(**{**a, "weights_BSK": a["weights_BSK"] * kept_BSK}), 0), dict(inputs), cotangent)
    assert dropped == (kept_BSK == 0).sum() > 0
    np.testing.assert_allclose(y, y_ref, **TOL)
    assert_same(grads, grads_ref)


def test_bad_capacity_is_rejected():
    inputs, _ = make_inputs(B=2, E=2)
    with pytest.raises(ValueError, match="capacity_factor=0"):
        expert_ffn(**inputs, capacity_factor=0)
    with pytest.raises(ValueError, match="capacity groups of 4"):
        expert_ffn(**inputs, capacity_factor=1.0, capacity_group_rows=4)


def _ragged_t(d_RN, rhs_GKN, sizes_G):
    return jax.lax.ragged_dot(d_RN, jnp.swapaxes(rhs_GKN, 1, 2), sizes_G)


def _ragged_wgrad(lhs_RK, d_RN, sizes_G):
    dims = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((0,), (0,)), ((), ())),
                                             lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
    return jax.lax.ragged_dot_general(lhs_RK, d_RN, sizes_G, dims)


def test_grouped_matmul_custom_vjp_matches_autodiff():
    """The kernels' custom VJP (here with ragged_dot stand-ins) against autodiff of ragged_dot, with padding rows
    (expert id E) past every group as expert parallelism sends them."""
    inputs, _ = make_inputs(B=2, E=4)
    x_ND = inputs["x_BSD"].reshape(-1, D)
    experts_R = jnp.concatenate([inputs["experts_BSK"].reshape(-1), jnp.full(8, 4)])
    rows_R = jnp.arange(experts_R.shape[0]) % x_ND.shape[0]
    cotangent_RD = jnp.asarray(np.random.default_rng(2).standard_normal((experts_R.shape[0], D)), jnp.float32)
    custom = grouped_matmul(jax.lax.ragged_dot, _ragged_t, _ragged_wgrad)

    def loss(diff, matmul):
        out_RD = sorted_ffn(diff["x"], rows_R, experts_R, diff["gate"], diff["up"], diff["down"], matmul)
        return jnp.sum(out_RD * cotangent_RD), out_RD

    diff = dict(x=x_ND, gate=inputs["gate_EDF"], up=inputs["up_EDF"], down=inputs["down_EFD"])
    grad = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
    (_, out), grads = grad(diff, custom)
    (_, out_ref), grads_ref = grad(diff, jax.lax.ragged_dot)
    np.testing.assert_allclose(out, out_ref, **TOL)
    assert not np.any(out[-8:])
    assert_same(grads, grads_ref)


def test_local_dropless_path_with_unpadded_custom_vjp_matches_the_reference():
    """The single-device dropless path (gather/permute with gather-only gradients, grouped matmuls without a
    padding mask) against the per-token reference, values and gradients."""
    inputs, cotangent = make_inputs(B=2, E=4)
    custom = grouped_matmul(jax.lax.ragged_dot, _ragged_t, _ragged_wgrad, padded=False)
    B = inputs["x_BSD"].shape[0]

    def loss(diff):
        x_TD, experts_TK = diff["x_BSD"].reshape(-1, D), inputs["experts_BSK"].reshape(-1, K)
        out_AD = dropless_ffn(x_TD, experts_TK, diff["gate_EDF"], diff["up_EDF"], diff["down_EFD"], custom)
        y = jnp.einsum("tkd,tk->td", out_AD.reshape(-1, K, D), diff["weights_BSK"].reshape(-1, K))
        return jnp.sum(y.reshape(B, S, D) * cotangent)

    def ref_loss(diff):
        return jnp.sum(reference(diff["x_BSD"], inputs["experts_BSK"], diff["weights_BSK"], diff["gate_EDF"],
                                 diff["up_EDF"], diff["down_EFD"]) * cotangent)

    diff = {k: v for k, v in inputs.items() if k != "experts_BSK"}
    value, grads = jax.jit(jax.value_and_grad(loss))(diff)
    value_ref, grads_ref = jax.jit(jax.value_and_grad(ref_loss))(diff)
    np.testing.assert_allclose(value, value_ref, **TOL)
    assert_same(grads, grads_ref)


def expert_parallel(inputs, cotangent, capacity_factor, group_rows=1, **degrees):
    """expert_parallel_ffn on a mesh of `degrees`, batch over the data axes, the weights' E over expert and their
    F over tensor; returns the outputs, gradients and the lowered StableHLO text."""
    mesh = build_mesh({a: degrees.get(a, 1) for a in MESH_AXES})
    batch = NamedSharding(mesh, PartitionSpec(DATA_AXES))
    EDF, EFD = NamedSharding(mesh, PartitionSpec("expert", None, "tensor")), NamedSharding(mesh, PartitionSpec(
        "expert", "tensor", None))
    shardings = dict(x_BSD=batch, experts_BSK=batch, weights_BSK=batch, gate_EDF=EDF, up_EDF=EDF, down_EFD=EFD)
    inputs = {k: jax.device_put(v, shardings[k]) for k, v in inputs.items()}
    fn = lambda **a: expert_parallel_ffn(**a, mesh=mesh, capacity_factor=capacity_factor,
                                         capacity_group_rows=group_rows, impl="ragged")
    hlo = jax.jit(fn).lower(**inputs).as_text()
    return value_and_grads(fn, inputs, cotangent), hlo


@pytest.mark.parametrize("degrees", [dict(expert=2, data=4), dict(expert=4, data=2), dict(expert=8),
                                     dict(expert=4, tensor=2)], ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_expert_parallel_dropless_matches_single_device(dropless, degrees):
    inputs, cotangent, (y, _, grads) = dropless
    (y_ep, dropped, grads_ep), hlo = expert_parallel(dict(inputs), cotangent, None, **degrees)
    assert dropped == 0
    np.testing.assert_allclose(y_ep, y, **TOL)
    assert_same(grads_ep, grads)
    assert "all_to_all" in hlo


def test_expert_parallel_capacity_with_room_matches_dropless(dropless):
    inputs, cotangent, (y, _, grads) = dropless
    (y_ep, dropped, grads_ep), hlo = expert_parallel(dict(inputs), cotangent, 8.0, expert=4, data=2)
    assert dropped == 0
    np.testing.assert_allclose(y_ep, y, **TOL)
    assert_same(grads_ep, grads)
    assert "all_to_all" in hlo


GROUPED = [  # (degrees, capacity_group_rows, capacity_factor); B=8 rows, whole groups on every device
    (dict(expert=2), 1, 0.5), (dict(expert=4), 2, 0.25), (dict(expert=8), 1, 0.5), (dict(data=2, expert=4), 1, 0.5),
    (dict(fsdp=2, expert=2), 2, 0.5), (dict(tensor=2, expert=2), 4, 0.25), (dict(data=2, tensor=2, expert=2), 2, 0.5),
    (dict(data=4, tensor=2), 2, 0.25), (dict(data=8), 1, 0.5),
]


@pytest.mark.parametrize("degrees, group_rows, capacity_factor", GROUPED,
                         ids=lambda v: "-".join(f"{k}{n}" for k, n in v.items()) if isinstance(v, dict) else str(v))
def test_expert_parallel_capacity_with_drops_matches_single_device(degrees, group_rows, capacity_factor):
    """Capacity counted per group of rows drops the same assignments on every layout as on one device: outputs,
    count dropped and gradients."""
    inputs, cotangent = make_inputs(seed=3)
    y, dropped, grads = value_and_grads(
        lambda **a: expert_ffn(**a, capacity_factor=capacity_factor, capacity_group_rows=group_rows),
        dict(inputs), cotangent)
    (y_ep, dropped_ep, grads_ep), hlo = expert_parallel(dict(inputs), cotangent, capacity_factor, group_rows,
                                                        **degrees)
    assert dropped_ep == dropped > 0
    np.testing.assert_allclose(y_ep, y, **TOL)
    assert_same(grads_ep, grads)
    assert ("all_to_all" in hlo) == ("expert" in degrees)


def test_expert_parallel_refuses_capacity_groups_split_over_devices():
    """Internal asserts (the config validation refuses these layouts first): a device holding part of a group."""
    inputs, _ = make_inputs()
    for degrees, group_rows in ((dict(data=2, expert=4), 2), (dict(context=2, expert=4), 1)):
        mesh = build_mesh({a: degrees.get(a, 1) for a in MESH_AXES})
        with pytest.raises(ValueError, match="capacity groups"):
            jax.jit(lambda **a: expert_parallel_ffn(**a, mesh=mesh, capacity_factor=1.0,
                                                    capacity_group_rows=group_rows)).lower(**inputs)


@pytest.mark.parametrize("degrees", [dict(expert=2, data=4), dict(tensor=2, data=4), dict(fsdp=4, tensor=2),
                                     dict(data=8)], ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_expert_parallel_bf16_gradients_compile(dropless, degrees):
    """bf16 inputs, so the psums and the cotangent sums of replicated inputs are bf16 all-reduces: XLA CPU used to
    abort the process compiling them (a sharding custom call at the root of their reduction). Dropless and
    capacity; the output's relative error against fp32 is bf16 rounding's."""
    inputs, cotangent, (y, _, _) = dropless
    inputs = {k: v.astype(jnp.bfloat16) if v.dtype == jnp.float32 else v for k, v in inputs.items()}
    for capacity_factor in (None, 8.0):
        (y_ep, _, grads_ep), _ = expert_parallel(dict(inputs), cotangent.astype(jnp.bfloat16), capacity_factor,
                                                 **degrees)
        assert y_ep.dtype == jnp.bfloat16 and all(np.all(np.isfinite(g.astype(np.float32)))
                                                 for g in grads_ep.values())
        error = np.linalg.norm(np.asarray(y_ep, np.float32) - y) / np.linalg.norm(y)
        assert error < 1.5e-2, error  # bf16 rounding of inputs, weights and products: 6e-3 here


def test_expert_parallel_nests_inside_pipeline_stages(dropless):
    """Called inside a shard_map over `stage` (as pipeline stages run their layers) with the trainer's mesh."""
    inputs, cotangent, (y, _, grads) = dropless
    mesh = build_mesh({a: dict(stage=2, expert=2, data=2).get(a, 1) for a in MESH_AXES})
    stage = jax.shard_map(lambda a: expert_parallel_ffn(**a, mesh=mesh, capacity_factor=None, impl="ragged"),
                          mesh=mesh, in_specs=(PartitionSpec(),), out_specs=(PartitionSpec(), PartitionSpec()),
                          axis_names={"stage"}, check_vma=False)
    y_ep, _, grads_ep = value_and_grads(lambda **a: stage(a), dict(inputs), cotangent)
    np.testing.assert_allclose(y_ep, y, **TOL)
    assert_same(grads_ep, grads)
