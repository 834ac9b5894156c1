"""Every parallel layout computes the same function as one device: fp32, same seed, 3 steps of AdamW.

Loss within 1e-5 and every parameter leaf's gradient within 1e-4 relative, at every step (`layouts.py`).
"""
import dataclasses
import functools

import jax
import numpy as np
import pytest

from families import FAMILIES
from jaxprs import equations
from layouts import assert_matches, fit, leaves, reference
from mlm_jax import Trainer, load_config
from mlm_jax.data import loader as data_lib
from mlm_jax.train.step import gradients

BASE = ["model.dtype=float32", "train.steps=3", "train.log_every=1", "train.eval_every=0",
        "train.global_batch_size=8", "train.seq_len=64", "log.progress=never", "optim.warmup_steps=0",
        "optim.lr=1e-2", "data.max_bytes=2000000", "checkpoint.save=false"]


def run(overrides, num_devices, tmp_path):
    return fit(BASE, overrides, num_devices, tmp_path)


@pytest.fixture(scope="module")
def single_device(tmp_path_factory):
    return run(["parallel.data=1"], 1, tmp_path_factory.mktemp("ref"))


def test_single_device_reference_trains(single_device):
    losses = [r["loss"] for r in single_device.records]
    assert np.all(np.isfinite(losses)) and losses[2] < losses[0]
    assert all(np.all(np.isfinite(g)) and np.any(g != 0) for step in single_device.grads for g in step.values())


@pytest.mark.parametrize("layout", [
    pytest.param(["parallel.data=8"], id="data8"),
    pytest.param(["parallel.data=1", "parallel.fsdp=8"], id="fsdp8"),
    pytest.param(["parallel.data=2", "parallel.fsdp=2", "parallel.tensor=2"], id="data2-fsdp2-tensor2"),
    pytest.param(["parallel.data=2", "parallel.tensor=4", "parallel.sequence_parallel=true"], id="data2-tensor4-sp"),
    pytest.param(["parallel.data=8", "parallel.shard_optimizer=true"], id="data8-zero1"),
    pytest.param(["parallel.data=2", "parallel.fsdp=4", "parallel.rules=fsdp_full",
                  "parallel.shard_optimizer=true"], id="data2-fsdp4-fsdp_full-zero1"),
    pytest.param(["parallel.data=2", "parallel.fsdp=2", "parallel.tensor=2", "parallel.sequence_parallel=true",
                  "model.scan_layers=false", "model.remat=full"], id="data2-fsdp2-tensor2-sp-unrolled-remat"),
])
def test_layout_matches_single_device(layout, single_device, tmp_path):
    assert_matches(run(layout, 8, tmp_path), single_device)


@pytest.mark.parametrize("layout, num_devices", [
    pytest.param(["parallel.data=1"], 1, id="scanned"),
    pytest.param(["parallel.data=1", "model.scan_layers=false"], 1, id="unrolled"),
    pytest.param(["parallel.data=2", "parallel.fsdp=2", "parallel.tensor=2", "model.scan_layers=false"], 8,
                 id="unrolled-data2-fsdp2-tensor2"),
])
def test_gradient_accumulation_matches_one_batch(layout, num_devices, single_device, tmp_path):
    """Micro batch 2 x 4 accumulation steps on one device (or 1 x 2 on each of 4 data-parallel ranks) equals one
    batch of 8; unrolled, with one gradient sum per layer."""
    micro = "train.micro_batch_size=2" if num_devices == 1 else "train.micro_batch_size=1"
    assert_matches(run(layout + [micro], num_devices, tmp_path), single_device)


def test_accumulation_with_data_parallelism_matches_single_device(single_device, tmp_path):
    assert_matches(run(["parallel.data=4", "parallel.tensor=2", "train.micro_batch_size=1"], 8,
                                         tmp_path), single_device)


def test_gqa_qknorm_tied_layernorm_gelu_under_tensor_parallelism(tmp_path):
    variant = ["model.num_kv_heads=2", "model.qk_norm=true", "model.tie_embeddings=true", "model.norm=layernorm",
               "model.activation=gelu"]
    ref = reference(BASE, variant + ["parallel.data=1"], tmp_path / "ref")
    got = run(variant + ["parallel.data=2", "parallel.fsdp=2", "parallel.tensor=2",
                                           "parallel.sequence_parallel=true"], 8, tmp_path / "tp")
    assert_matches(got, ref)


@pytest.mark.parametrize("kv_heads, layout", [
    pytest.param(2, ["parallel.data=2", "parallel.tensor=4", "parallel.sequence_parallel=true"], id="kv2-tensor4-sp"),
    pytest.param(1, ["parallel.data=2", "parallel.fsdp=2", "parallel.tensor=2"], id="kv1-fsdp2-tensor2"),
])
def test_fewer_kv_heads_than_tensor_ranks_match_single_device(kv_heads, layout, tmp_path):
    variant = [f"model.num_kv_heads={kv_heads}", "model.num_layers=2"]
    ref = reference(BASE, variant + ["parallel.data=1"], tmp_path / "ref")
    assert_matches(run(variant + layout, 8, tmp_path / "tp"), ref)


FAMILY_LAYOUTS = [
    ("llama3-qwen3-window", ["parallel.data=2", "parallel.fsdp=2", "parallel.tensor=2",
                             "parallel.sequence_parallel=true"]),
    ("llama3-qwen3-window", ["parallel.stage=2", "parallel.data=2", "parallel.tensor=2",
                             "parallel.pipeline_schedule=zb1"]),
    ("gemma3", ["parallel.data=2", "parallel.fsdp=2", "parallel.tensor=2"]),
    ("qwen3-moe", ["parallel.data=1", "parallel.fsdp=2", "parallel.expert=2", "parallel.tensor=2"]),
    ("deepseek-v3", ["parallel.data=1", "parallel.fsdp=2", "parallel.expert=2", "parallel.tensor=2"]),
    # Pipeline chunks whose layers differ by kind, and differently in each chunk (a switch per slot): local and
    # global layers in every order over 2 x 2 chunks, with the single K/V head repeated over the tensor ranks
    ("gemma3", ["parallel.stage=2", "parallel.virtual_stages=2", "parallel.data=2", "parallel.tensor=2",
                "train.num_microbatches=2", "model.num_layers=4",
                "model.layer_types=[sliding_attention, full_attention, full_attention, sliding_attention]"]),
    # the dense first layer alone in chunk 0, two MoE layers (one fetched from the other stage) in chunk 1,
    # experts split over devices (the zero-bubble split of such a chunk: test_split_vjp)
    ("deepseek-v3", ["parallel.stage=2", "parallel.data=1", "parallel.expert=2", "parallel.tensor=2",
                     "train.num_microbatches=2", "parallel.pipeline_layers=[1,2]"]),
    # a dense layer in one chunk's second slot, which the other chunk leaves empty; both stacks whole on every stage
    ("qwen3-moe", ["parallel.stage=2", "parallel.data=4", "train.num_microbatches=2",
                   "model.num_layers=4", "model.scan_layers=false"]),
]


@pytest.mark.parametrize("family, layout", FAMILY_LAYOUTS,
                         ids=[f"{f}-{'-'.join(o.split('.')[1].replace('=', '') for o in lay[:3])}"
                              for f, lay in FAMILY_LAYOUTS])
def test_family_features_match_single_device(family, layout, tmp_path):
    # a layout may reshape the model, and the reference accumulates the pipeline's microbatches (the MoE
    # balancing losses are per microbatch)
    model = FAMILIES[family] + [o for o in layout if o.startswith(("model.", "train."))]
    ref = reference(BASE, model + ["parallel.data=1"], tmp_path / "ref")
    assert_matches(run(FAMILIES[family] + layout, 8, tmp_path / "layout"), ref)


@pytest.mark.parametrize("layout, num_devices", [
    pytest.param(["parallel.data=1"], 1, id="one-device"),
    pytest.param(["parallel.data=2", "parallel.fsdp=2", "parallel.tensor=2"], 8, id="data2-fsdp2-tensor2"),
])
def test_bf16_copies_cast_once_a_step_give_the_products_of_the_master_weights(layout, num_devices, tmp_path):
    """Accumulating per layer in bf16 over fp32 master weights, the kernels' bf16 copies made once a step
    (`StepPlan.cast_once`) give the loss and every leaf's gradient that casting in each microbatch's products gives."""
    cfg = load_config(None, BASE + layout + ["model.dtype=bfloat16", "model.scan_layers=false",
                                             "train.num_microbatches=2", f"train.output_dir={tmp_path}"])
    trainer = Trainer(cfg, devices=jax.devices()[:num_devices])
    plan = trainer.step_plan
    assert {("blocks", "mlp", "up", "kernel"), ("blocks", "attn", "q", "kernel")} <= plan.cast_once
    batch = data_lib.global_batch(trainer.loader, 0, trainer.batch_sharding)
    (m_once, g_once), (m_each, g_each) = (
        jax.jit(functools.partial(gradients, p))(trainer.state.params, batch)
        for p in (plan, dataclasses.replace(plan, cast_once=frozenset())))
    np.testing.assert_allclose(float(m_once["loss"]), float(m_each["loss"]), rtol=1e-6)
    once, each = leaves(g_once), leaves(g_each)
    for path in each:
        assert once[path].dtype == each[path].dtype == np.float32
        np.testing.assert_allclose(once[path], each[path], rtol=1e-5, atol=1e-7, err_msg=path)


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_weights_paired_for_fp32_sums_add_no_zeros_per_microbatch(param_dtype, tmp_path):
    """Accumulating per layer with recompute under FSDP, each layer's kernel paired for an fp32 sum stands beside an
    fp32 array already in memory (its master, or its sum): zeros made for it in each microbatch would be a buffer
    that each recomputed layer keeps, whole on every device (the sums are sharded)."""
    cfg = load_config(None, BASE + ["model.dtype=bfloat16", f"model.param_dtype={param_dtype}",
                                    "model.scan_layers=false", "model.remat=full", "parallel.data=1",
                                    "parallel.fsdp=4", "train.num_microbatches=2", f"train.output_dir={tmp_path}"])
    trainer = Trainer(cfg, devices=jax.devices()[:4])
    plan = trainer.step_plan
    assert ("blocks", "mlp", "up", "kernel") in plan.cast_once
    params = trainer.abstract_state.params
    shapes = {tuple(w.shape[1:]) for w in jax.tree.leaves(params["blocks"]) if w.ndim > 2}  # the layers' kernels
    jaxpr = jax.make_jaxpr(functools.partial(gradients, plan))(params, trainer.batch_shapes())
    zeros_per_microbatch = [eqn for eqn, loops in equations(jaxpr) if loops and eqn.primitive.name == "broadcast_in_dim"
                            and eqn.outvars[0].aval.dtype == np.float32 and eqn.outvars[0].aval.shape in shapes]
    assert not zeros_per_microbatch


@pytest.mark.parametrize("extra,devices", [
    pytest.param([], 1, id="head"),
    pytest.param(["model.tie_embeddings=true", "train.loss_chunks=2"], 1, id="tied-chunked-loss"),
    pytest.param(["parallel.stage=2", "parallel.virtual_stages=2", "parallel.pipeline_schedule=1f1b"], 2,
                 id="pipeline"),
])
def test_bf16_master_weights_sum_each_microbatchs_gradient_in_fp32(extra, devices, tmp_path):
    """Accumulating per layer over bf16 master weights, or through the pipeline executor, each microbatch's
    gradient of every weight (the products' kernels of `StepPlan.cast_once`, the embedding table as looked up and
    as the tied head, with or without the loss in chunks, the norms' scales) is summed in fp32 as it comes and
    rounded to bf16 once, after the sum: the gradient of the same weights held in fp32, rounded."""
    overrides = BASE + ["model.dtype=bfloat16", "model.scan_layers=false", "train.num_microbatches=4",
                        f"train.output_dir={tmp_path}", *extra]
    cfg = load_config(None, overrides + ["model.param_dtype=bfloat16"])
    trainer = Trainer(cfg, devices=jax.devices()[:devices])
    plan = trainer.step_plan
    assert plan.pipeline or {("blocks", "mlp", "up", "kernel"), ("embed", "embedding")} <= plan.cast_once
    batch = data_lib.global_batch(trainer.loader, 0, trainer.batch_sharding)
    params = trainer.state.params
    as_fp32 = jax.tree.map(lambda w: w.astype(np.float32), params)
    reference = Trainer(load_config(None, overrides), devices=jax.devices()[:devices]).step_plan
    _, g_bf16 = jax.jit(functools.partial(gradients, plan))(params, batch)
    _, g_fp32 = jax.jit(functools.partial(gradients, reference))(as_fp32, batch)
    got, want = leaves(g_bf16), leaves(jax.tree.map(lambda g: g.astype(jax.numpy.bfloat16), g_fp32))
    tied = "model.tie_embeddings=true" in extra
    assert len(got) == 7 + 2 + 2 + (not tied), list(got)  # the stacks' kernels and norms, table, final norm, head
    for path in got:
        np.testing.assert_array_equal(got[path], want[path], err_msg=path)
