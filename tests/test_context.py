"""Context-parallel attention against plain causal attention on the unpermuted sequence, forward and gradient."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from mlm_jax.parallel import context
from mlm_jax.parallel.context import context_attention, load_balance_order, with_lse_gradient

AXES = ("data", "stage", "fsdp", "context", "expert", "tensor")
TOL = dict(rtol=1e-5, atol=1e-5)


def run(f, *args):
    return jax.jit(f)(*args)


def make_mesh(**degrees):
    shape = tuple(degrees.get(a, 1) for a in AXES)
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=jax.devices()[:np.prod(shape)])


def qkv(B=2, S=64, N=4, K=2, H=16, seed=0):
    kq, kk, kv, kc = jax.random.split(jax.random.key(seed), 4)
    return (jax.random.normal(kq, (B, S, N, H)), jax.random.normal(kk, (B, S, K, H)),
            jax.random.normal(kv, (B, S, K, H)), jax.random.normal(kc, (B, S, N, H)))


def value_and_grads(attention, q, k, v, cot):
    """Output and d/d(q, k, v) of sum(out * cot): every output element gets its own weight."""
    out, pullback = jax.vjp(attention, q, k, v)
    return out, pullback(cot)


@jax.jit
def reference(q, k, v, cot):
    """Plain causal attention on the unpermuted sequence, and its gradients."""
    return value_and_grads(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True), q, k, v, cot)


@pytest.mark.parametrize("cp", [2, 4])
def test_load_balance_order_gives_rank_r_chunks_r_and_mirror(cp):
    S = 8 * cp
    perm = load_balance_order(S, cp)
    assert perm.dtype == np.int32 and sorted(perm) == list(range(S))
    c = S // (2 * cp)
    x = jax.device_put(jnp.arange(S)[None][:, perm], NamedSharding(make_mesh(context=cp), P(None, "context")))
    for shard in x.addressable_shards:
        r = shard.index[1].start // (2 * c)
        np.testing.assert_array_equal(shard.data[0], np.r_[r * c:(r + 1) * c, (2 * cp - 1 - r) * c:(2 * cp - r) * c])


def assert_matches_reference(perm, got, q, k, v, cot):
    want_out, want_grads = reference(q, k, v, cot)
    inv = np.argsort(perm)
    got_out, got_grads = got
    np.testing.assert_allclose(got_out[:, inv], want_out, **TOL)
    for name, g, w in zip("qkv", got_grads, want_grads):
        np.testing.assert_allclose(g[:, inv], w, **TOL, err_msg=f"d{name}")


def check_matches_reference(mesh, strategy, impl="xla", spec=P(), **shape):
    q, k, v, cot = qkv(**shape)
    perm = load_balance_order(q.shape[1], mesh.shape["context"])
    put = lambda x: jax.device_put(x[:, perm], NamedSharding(mesh, spec))
    got = run(lambda *a: value_and_grads(
        lambda q, k, v: context_attention(q, k, v, mesh=mesh, strategy=strategy, impl=impl), *a),
        put(q), put(k), put(v), put(cot))
    assert_matches_reference(perm, got, q, k, v, cot)


@pytest.mark.parametrize("strategy", ["allgather", "ring"])
@pytest.mark.parametrize("cp, N, K", [(2, 4, 2), (4, 4, 1), (8, 2, 2)])  # GQA, MQA, MHA
def test_cp_matches_causal_attention_forward_and_gradient(cp, N, K, strategy):
    check_matches_reference(make_mesh(context=cp), strategy, N=N, K=K)


@pytest.mark.parametrize("strategy", ["allgather", "ring"])
def test_cp2_with_batch_on_data_and_heads_on_tensor_matches(strategy):
    check_matches_reference(make_mesh(data=2, context=2, tensor=2), strategy, spec=P("data", "context", "tensor"),
                            S=128)


def test_cp2_with_tensor4_not_dividing_kv_heads_matches():
    """Heads stay whole when `tensor` does not divide the kv heads (GQA groups must stay on one device)."""
    check_matches_reference(make_mesh(context=2, tensor=4), "ring", spec=P(None, "context"), K=2)


def test_cp_ring_through_the_cudnn_path_with_xla_kernel_matches(monkeypatch):
    """Merging blocks whose lse gradient comes from the custom VJP (CPU stand-in for cuDNN)."""
    monkeypatch.setattr(context, "_fused_attention_with_lse_gradient", with_lse_gradient(
        lambda q, k, v, causal, impl, mask=None: context._fused_attention(q, k, v, causal, "xla", mask)))
    check_matches_reference(make_mesh(context=4), "ring", impl="cudnn")


@pytest.mark.parametrize("causal", [True, False])
def test_lse_gradient_correction_matches_autodiff(causal):
    """The cuDNN path's custom VJP, on CPU: XLA's fused kernel (lse without gradient) against plain jnp."""
    q, k, v, cot = qkv(S=32, seed=1)
    cot_lse = jax.random.normal(jax.random.key(2), q.shape[:3])
    fused = with_lse_gradient(context._fused_attention)

    def grads(attention):
        weighted = lambda out, lse: jnp.sum(out * cot) + jnp.sum(lse * cot_lse)
        return run(jax.grad(lambda *a: weighted(*attention(*a)), argnums=(0, 1, 2)), q, k, v)

    want = grads(lambda q, k, v: context._jnp_attention(q, k, v, causal))
    got = grads(lambda q, k, v: fused(q, k, v, causal, "xla"))
    for name, g, w in zip("qkv", got, want):
        np.testing.assert_allclose(g, w, **TOL, err_msg=f"d{name}")


def test_cp_inside_outer_stage_shard_map_matches():
    """As the pipeline runs it: forward and backward both inside a shard_map over `stage`."""
    mesh = make_mesh(stage=2, context=2)
    q, k, v, cot = qkv()
    perm = load_balance_order(64, 2)
    inner = lambda q, k, v: context_attention(q, k, v, mesh=mesh, strategy="ring", impl="xla")
    outer = jax.shard_map(lambda *a: value_and_grads(inner, *a), mesh=mesh, in_specs=P(), out_specs=P(),
                          axis_names={"stage"}, check_vma=False)
    assert_matches_reference(perm, run(outer, q[:, perm], k[:, perm], v[:, perm], cot[:, perm]), q, k, v, cot)


@pytest.mark.parametrize("strategy, present, absent", [("ring", "collective_permute", "all_gather"),
                                                        ("allgather", "all_gather", "collective_permute")])
def test_strategy_lowers_to_its_collective(strategy, present, absent):
    mesh = make_mesh(context=4)
    q, k, v, _ = qkv()
    hlo = jax.jit(lambda q, k, v: context_attention(q, k, v, mesh=mesh, strategy=strategy, impl="xla")).lower(
        q, k, v).as_text()
    assert present in hlo and absent not in hlo
