"""Mixture-of-experts: routing semantics, global-batch balancing losses, aux-loss-free bias updates, expert
parallelism against one device (fp32, 3 steps: loss within 1e-5, every leaf's gradient within 1e-4), and bad input."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from layouts import assert_matches, fit, leaves, reference
from mlm_jax import Trainer, load_config
from mlm_jax.config import ConfigError, MoEConfig
from mlm_jax.model.moe import MoE, MoELayerConfig
from mlm_jax.train.step import load_imbalance, update_router_bias
from mlm_jax.validation.plan import check_degrees

MOE = ["model.moe.num_experts=8", "model.moe.top_k=2", "model.ffn_size=64", "model.moe.z_loss_coef=1e-3"]
BASE = ["model.dtype=float32", "model.num_layers=2", "train.steps=3", "train.log_every=1", "train.eval_every=0",
        "train.global_batch_size=8", "train.seq_len=32", "log.progress=never", "optim.warmup_steps=0",
        "optim.lr=1e-2", "data.max_bytes=2000000", "checkpoint.resume=none", "checkpoint.save=false"] + MOE


SMALL_CAPACITY = ["model.moe.capacity_factor=0.5"]  # per row (capacity_group_rows=1): 4 of a row's 64 per expert


def run(overrides, num_devices, tmp_path):
    return fit(BASE, overrides, num_devices, tmp_path)


@pytest.fixture(scope="module")
def single_device(tmp_path_factory):
    return run(["parallel.data=1"], 1, tmp_path_factory.mktemp("ref"))


# -- routing ----------------------------------------------------------------------------------------------------------
def layer(**moe):
    cfg = MoELayerConfig(dim=8, ffn=16, moe=MoEConfig(num_experts=4, top_k=2, **moe))
    return MoE(cfg, std=0.5, out_std=0.5, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))


def test_softmax_router_renormalises_the_top_k_of_a_softmax_over_all_experts():
    moe = layer()
    x = jax.random.normal(jax.random.key(1), (2, 5, 8))
    experts, weights, stats = moe.route(x)
    probs = jax.nn.softmax(x @ moe.router.kernel[...], axis=-1)
    top, idx = jax.lax.top_k(probs, 2)
    np.testing.assert_array_equal(experts, idx)
    np.testing.assert_allclose(weights, top / top.sum(-1, keepdims=True), rtol=1e-6)
    load = np.bincount(np.asarray(idx).ravel(), minlength=4) / idx.size
    np.testing.assert_allclose(stats["load"], load, rtol=1e-6)
    np.testing.assert_allclose(stats["aux_loss"], 4 * np.sum(load * np.asarray(probs).mean((0, 1))), rtol=1e-6)
    np.testing.assert_allclose(stats["z_loss"], np.mean(jax.nn.logsumexp(x @ moe.router.kernel[...], -1) ** 2),
                               rtol=1e-6)


def test_sigmoid_router_bias_steers_the_choice_but_not_the_weights():
    moe = layer(router="sigmoid", router_bias_update=0.01)
    x = jax.random.normal(jax.random.key(2), (2, 5, 8))
    moe.router.bias[...] = jnp.array([0.0, 0.0, 0.0, 10.0])  # expert 3 always chosen
    experts, weights, _ = moe.route(x)
    assert np.all(np.any(np.asarray(experts) == 3, axis=-1))
    scores = jax.nn.sigmoid(x @ moe.router.kernel[...])
    chosen = jnp.take_along_axis(scores, experts, -1)
    np.testing.assert_allclose(weights, chosen / chosen.sum(-1, keepdims=True), rtol=1e-6)
    graphdef, state = nnx.split(moe)
    grads = jax.grad(lambda st: jnp.sum(nnx.merge(graphdef, st).route(x)[1] * jnp.arange(2.0)))(state)
    assert np.all(np.asarray(grads["router"]["bias"][...]) == 0)
    assert np.any(np.asarray(grads["router"]["kernel"][...]) != 0)


def test_layer_output_matches_a_per_token_loop():
    moe = layer(shared_experts=1)
    x = jax.random.normal(jax.random.key(3), (2, 3, 8))
    y, _ = moe(x)
    experts, weights, _ = moe.route(x)
    w = moe.experts
    expected = np.zeros((2, 3, 8), np.float32)
    for b in range(2):
        for s in range(3):
            for k in range(2):
                e = int(experts[b, s, k])
                h = jax.nn.silu(x[b, s] @ w.gate[e]) * (x[b, s] @ w.up[e])
                expected[b, s] += float(weights[b, s, k]) * np.asarray(h @ w.down[e])
    expected += np.asarray(moe.shared(x))
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)


# -- training and expert parallelism ----------------------------------------------------------------------------------
def test_moe_trains_and_logs_its_statistics(single_device):
    records = single_device.records
    rec = records[-1]
    assert records[-1]["loss"] < records[0]["loss"]
    assert rec["moe_aux_loss"] > 0
    assert rec["moe_z_loss"] > 0
    assert len(rec["moe_load_max_mean"]) == 2 and min(rec["moe_load_max_mean"]) >= 1.0
    assert rec["moe_dropped"] == [0.0, 0.0]
    json.dumps(rec)


@pytest.mark.parametrize("layout", [
    pytest.param(["parallel.expert=2", "parallel.data=4"], id="expert2"),
    pytest.param(["parallel.expert=4", "parallel.data=2"], id="expert4"),
    pytest.param(["parallel.expert=8", "parallel.data=1"], id="expert8"),
    pytest.param(["parallel.expert=4", "parallel.tensor=2", "parallel.data=1"], id="expert4-tensor2"),
])
def test_expert_parallel_dropless_matches_single_device(layout, single_device, tmp_path):
    assert_matches(run(layout, 8, tmp_path), single_device)


def test_global_balancing_trains_on_microbatches_what_one_batch_does(tmp_path, capsys):
    """`model.moe.aux_loss_scope=global` counts the step's expert loads: 4 microbatches on one device train what one
    batch does, every leaf; per microbatch (the default) the router's gradient differs, and the start-up says so."""
    scope, micro = ["model.moe.aux_loss_scope=global", "parallel.data=1"], ["train.num_microbatches=4"]
    got = run(scope + micro, 1, tmp_path / "global")
    one_batch = reference(BASE, scope, tmp_path / "one")
    assert_matches(got, one_batch)
    per_micro = reference(BASE, ["parallel.data=1"] + micro, tmp_path / "micro")
    per_micro.trainer.fit(1)
    assert "the objective changes with their number" in capsys.readouterr().out
    router = "['blocks']['moe']['router']['kernel']"
    want = leaves(one_batch.trainer.gradients(got.params[0], 0)[1])[router]
    differs = leaves(per_micro.trainer.gradients(got.params[0], 0)[1])[router]
    assert np.linalg.norm(differs - want) > 1e-3 * np.linalg.norm(want)


# Pipelines run 2 microbatches (one per stage): the balancing losses are per microbatch, so the reference
# accumulates the same two.
M2 = ["train.num_microbatches=2"]


# virtual stages: each stage runs two chunks (one stage's experts inside another's 1F1B or zero-bubble slots); a
# single chunk per stage is in the DeepSeek-V3 family test and the low-precision pipeline tests
VIRTUAL2 = ["parallel.stage=2", "parallel.expert=2", "parallel.data=2", "parallel.virtual_stages=2",
            "model.num_layers=4"]


@pytest.mark.parametrize("layout, capacity", [
    pytest.param(VIRTUAL2 + ["parallel.pipeline_schedule=1f1b"], SMALL_CAPACITY,
                 id="stage2-virtual2-expert2-1f1b-capacity"),
    pytest.param(VIRTUAL2 + ["parallel.pipeline_schedule=zb1"], [], id="stage2-virtual2-expert2-zb1-dropless"),
])
def test_moe_in_pipeline_stages_matches_single_device(layout, capacity, tmp_path):
    """Experts (and expert parallelism) inside stages; each layer's routing statistics reported in model order."""
    layers = [o for o in layout if o.startswith("model.")]
    ref = reference(BASE, layers + capacity + M2 + ["parallel.data=1"], tmp_path / "ref")
    got = run(layout + capacity, 8, tmp_path / "got")
    if capacity:
        assert all(d > 0 for r in got.records for d in r["moe_dropped"])
    assert_matches(got, ref)
    for step, (mine, params) in enumerate(zip(got.records, got.params)):  # the reference at the same weights
        theirs = ref.trainer.gradients(params, step)[0]
        np.testing.assert_allclose(mine["moe_load_max_mean"], load_imbalance(theirs["moe_load"]), rtol=1e-5)
        np.testing.assert_allclose(mine["moe_aux_loss"], theirs["moe_aux_loss"], rtol=1e-5)


def test_capacity_mode_without_drops_equals_dropless(single_device, tmp_path):
    got = run(["parallel.expert=4", "parallel.data=2", "model.moe.capacity_factor=8.0"], 8, tmp_path)
    assert all(d == 0 for r in got.records for d in r["moe_dropped"])
    assert_matches(got, single_device)




@pytest.fixture(scope="module")
def single_device_small_capacity(tmp_path_factory):
    return run(["parallel.data=1"] + SMALL_CAPACITY, 1, tmp_path_factory.mktemp("ref_capacity"))


def test_small_capacity_drops_tokens_and_says_so(single_device_small_capacity):
    records = single_device_small_capacity.records
    assert all(d >= 0.5 - 1e-6 for d in records[0]["moe_dropped"])  # capacity holds half the assignments


@pytest.mark.parametrize("layout", [
    pytest.param(["parallel.expert=4", "parallel.data=2"], id="expert4-data2"),
    pytest.param(["parallel.expert=2", "parallel.data=2", "parallel.tensor=2"], id="expert2-data2-tensor2"),
])
def test_capacity_with_drops_matches_single_device(layout, single_device_small_capacity, tmp_path):
    """Capacity counted per group of rows, not per device: every layout drops what one device drops."""
    got = run(layout + SMALL_CAPACITY, 8, tmp_path)
    assert all(d > 0 for r in got.records for d in r["moe_dropped"])
    assert_matches(got, single_device_small_capacity)


@pytest.mark.parametrize("layout", [
    pytest.param(["parallel.expert=2", "parallel.data=4"], id="expert2-data4"),
    pytest.param(["parallel.tensor=2", "parallel.data=4"], id="tensor2-data4"),
])
def test_bf16_moe_trains_on_several_devices(layout, tmp_path):
    """XLA CPU used to abort the process compiling this step (bf16 all-reduces inside the expert-parallel
    shard_map): a regression kills pytest here."""
    overrides = ["model.dtype=bfloat16", "model.num_layers=1", "train.steps=2"]
    cfg = load_config(None, BASE + [f"train.output_dir={tmp_path}"] + overrides + layout)
    records = Trainer(cfg, devices=jax.devices()[:8]).fit()
    assert len(records) == 2 and all(np.isfinite(r["loss"]) for r in records)


def test_deepseek_style_model_with_dense_layers_and_bias_updates_trains(tmp_path):
    overrides = ["parallel.data=2", "parallel.expert=2", "model.num_layers=3", "model.moe.router=sigmoid",
                 "model.moe.router_bias_update=0.01", "model.moe.aux_loss_coef=0", "model.moe.shared_experts=1",
                 "model.moe.first_dense_layers=1", "model.moe.every_n_layers=1", "model.scan_layers=false"]
    cfg = load_config(None, BASE + [f"train.output_dir={tmp_path}"] + overrides)
    trainer = Trainer(cfg, devices=jax.devices()[:4])
    records = trainer.fit()
    assert len(records[-1]["moe_load_max_mean"]) == 2
    bias = np.asarray(trainer.state.params["blocks"]["moe"]["router"]["bias"])
    assert bias.shape == (2, 8) and np.all(np.abs(bias) > 0)  # moved every step, by +-0.01
    assert "mlp" in trainer.state.params["dense_blocks"]


@pytest.mark.parametrize("overrides, message", [
    (["parallel.expert=3", "parallel.data=1"], "model.moe.num_experts=8 is not divisible by parallel.expert=3"),
    (["model.moe.top_k=9"], "model.moe.top_k=9 exceeds model.moe.num_experts=8"),
    (["model.moe.router_bias_update=0.1"], "needs model.moe.router=sigmoid"),
    (["model.moe.capacity_factor=0"], "must be positive"),
    (["model.moe.aux_loss_scope=global", "parallel.stage=2", "parallel.data=4"],
     "model.moe.aux_loss_scope=global with parallel.stage=2: the pipeline counts the expert loads per microbatch"),
], ids=["experts-by-ep", "top-k", "bias-without-sigmoid", "capacity", "global-balance-in-pipeline"])
def test_bad_moe_settings_are_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_degrees(load_config(None, BASE + overrides), 8 if "expert=3" not in overrides[0] else 3)


def test_router_bias_update_keeps_the_bias_dtype():
    """bf16 parameters: the balancing step (fp32 loads) must not promote the bias, or the next step recompiles."""
    params = {"blocks": {"moe": {"router": {"bias": jnp.zeros((2, 4), jnp.bfloat16), "kernel": jnp.zeros((2, 3, 4))}}}}
    load_LE = jnp.array([[0.4, 0.3, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]])
    bias = update_router_bias(params, load_LE, 0.01)["blocks"]["moe"]["router"]["bias"]
    assert bias.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.sign(np.asarray(bias, np.float32)), [[-1, -1, 1, 1], [0, 0, 0, 0]])
