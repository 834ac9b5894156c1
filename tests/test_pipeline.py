"""Pipeline parallelism computes the same function as one device, for every schedule and composed with the rest.

fp32, a layer or two per chunk, global batch 16, 3 steps of AdamW: loss within 1e-5, every leaf's gradient within
1e-4 relative.
"""
import re

import jax
import numpy as np
import pytest

from layouts import assert_matches, fit, reference
from mlm_jax import Trainer, load_config
from mlm_jax.config import ConfigError
from mlm_jax.parallel.stash import segments, stash_plan
from mlm_jax.validation.plan import check_degrees

BASE = ["model.dtype=float32", "model.num_layers=8", "train.steps=3", "train.log_every=1", "train.eval_every=0",
        "train.global_batch_size=16", "train.seq_len=32", "log.progress=never", "optim.warmup_steps=0",
        "optim.lr=1e-2", "data.max_bytes=2000000", "checkpoint.resume=none", "checkpoint.save=false"]


@pytest.fixture(scope="module")
def single_device(tmp_path_factory):
    """The layout's model (its `model.*` overrides) trained on one device, once per model."""
    cache = {}

    def get(overrides):
        model = tuple(o for o in overrides if o.startswith("model."))
        if model not in cache:
            cache[model] = reference(BASE, [*model, "parallel.data=1"], tmp_path_factory.mktemp("ref"))
        return cache[model]
    return get


# Each layout names its depth: compile time grows with it, so as few layers as its chunks need.
LAYOUTS = {
    # unequal chunks: a layer moves between the stages, and the shorter chunk skips its padded slots
    "stage2-layers-3-1": ["parallel.stage=2", "parallel.data=4", "model.num_layers=4",
                          "parallel.pipeline_layers=[3,1]"],
    "stage4": ["parallel.stage=4", "parallel.data=2", "model.num_layers=4"],
    "stage2-virtual2": ["parallel.stage=2", "parallel.virtual_stages=2", "parallel.data=4", "model.num_layers=4"],
    "stage2-virtual2-unrolled-layers-1-2-2-1": ["parallel.stage=2", "parallel.virtual_stages=2", "parallel.data=4",
                                                "model.num_layers=6", "model.scan_layers=false",
                                                "parallel.pipeline_layers=[1,2,2,1]"],
    "stage4-virtual2-m8-remat": ["parallel.stage=4", "parallel.virtual_stages=2", "parallel.data=2",
                                 "train.num_microbatches=8", "model.remat=full", "model.num_layers=8"],
    "stage2-tensor2-data2-sp": ["parallel.stage=2", "parallel.tensor=2", "parallel.data=2",
                                "parallel.sequence_parallel=true", "model.num_layers=2"],
    "stage2-fsdp2-virtual2-zero1": ["parallel.stage=2", "parallel.fsdp=2", "parallel.data=2",
                                    "parallel.virtual_stages=2", "parallel.shard_optimizer=true", "model.num_layers=4"],
}


# GPipe (autodiff of the forward ticks) is the simpler reference schedule: two layouts suffice for it. zb1 runs
# where the split backward meets something 1F1B's does not (four stages are stage4-virtual2-m8-remat's).
CASES = [(layout, schedule) for layout in LAYOUTS for schedule in ("1f1b", "zb1", "gpipe")
         if schedule == "1f1b" or (schedule == "zb1" and "unrolled" not in layout and layout != "stage4")
         or layout in ("stage2-virtual2", "stage2-layers-3-1")]


@pytest.mark.parametrize("layout, schedule", CASES, ids=[f"{layout}-{schedule}" for layout, schedule in CASES])
def test_pipeline_matches_single_device(layout, schedule, single_device, tmp_path):
    got = fit(BASE, LAYOUTS[layout] + [f"parallel.pipeline_schedule={schedule}"], 8, tmp_path)
    assert_matches(got, single_device(LAYOUTS[layout]))
    assert_stash_reported(got.trainer, schedule)


def assert_stash_reported(trainer, schedule):
    """The executor tells the trainer its stash: the plan's slots of a chunk's residuals, which hold at least
    the input of every layer of the widest chunk (fp32, the stage's whole microbatch), and zb1's cotangents."""
    if schedule == "gpipe":
        assert trainer.stash is None
        return
    s, cfg, stash = trainer.schedule, trainer.cfg, trainer.stash
    plan = stash_plan(s, segments(s))
    slots, cotangent_slots = plan.res_slots, plan.cot_slots
    rows = cfg.train.global_batch_size // s.microbatches
    assert stash.slots == slots
    assert stash.residual_bytes >= max(trainer.chunks.sizes) * rows * cfg.train.seq_len * cfg.model.hidden_size * 4
    assert (stash.cotangent_slots, stash.cotangent_bytes > 0) == ((cotangent_slots, True) if schedule == "zb1"
                                                                  else (0, False))
    assert stash.total_bytes == slots * stash.residual_bytes + stash.cotangent_slots * stash.cotangent_bytes


def test_layers_whole_on_every_stage_when_the_stages_do_not_divide_them(single_device, tmp_path):
    """3 stages, 4 layers: the layer dim is not split over the stages; each gathers its chunk and the gradients
    are summed over the stages."""
    overrides = ["parallel.stage=3", "parallel.data=2", "train.num_microbatches=4", "model.num_layers=4",
                 "parallel.pipeline_layers=[1,2,1]"]
    got = fit(BASE, overrides, 6, tmp_path)
    assert got.trainer.chunks.sizes == (1, 2, 1) and not got.trainer.chunks.pools["blocks"].sharded
    assert_matches(got, single_device(overrides))


@pytest.mark.parametrize("overrides, message", [
    (["parallel.stage=4", "parallel.data=2", "model.num_layers=6"], "model.num_layers=6 is not divisible by parallel.stage=4"),
    (["parallel.stage=2", "parallel.virtual_stages=2", "parallel.data=4", "model.num_layers=6"],
     "not divisible by parallel.stage=2 x parallel.virtual_stages=2"),
    (["parallel.stage=4", "parallel.virtual_stages=2", "parallel.data=2", "train.num_microbatches=6",
      "train.global_batch_size=12"], "must be a multiple of parallel.stage=4"),
    (["parallel.stage=4", "parallel.data=2", "train.num_microbatches=2"], "cannot fill parallel.stage=4"),
    (["parallel.stage=2", "parallel.data=4", "train.num_microbatches=3"], "not divisible by train.num_microbatches=3"),
    (["parallel.stage=2", "parallel.data=4", "train.num_microbatches=4", "train.micro_batch_size=2"],
     "!= train.global_batch_size=16"),
    (["parallel.virtual_stages=2"], "needs pipeline stages"),
    (["parallel.stage=2", "parallel.data=4", "parallel.pipeline_layers=[5,2]"],
     r"parallel.pipeline_layers=\[5, 2\]: expected 2 chunk sizes .* summing to model.num_layers=8"),
    (["parallel.stage=2", "parallel.virtual_stages=2", "parallel.data=4", "parallel.pipeline_layers=[4,4]"],
     "expected 4 chunk sizes"),
    (["parallel.stage=2", "parallel.data=4", "parallel.pipeline_layers=[9,-1]"], "integers >= 0"),
    (["parallel.stage=2", "parallel.data=4", "parallel.pipeline_layers=uneven"],
     "parallel.pipeline_layers='uneven': expected one of even, balanced or a list of 2 chunk sizes"),
    (["parallel.pipeline_layers=[8]"], "needs pipeline stages"),
    (["parallel.stage=8", "parallel.data=1", "model.num_layers=6", "parallel.pipeline_layers=balanced"],
     "model.num_layers=6 cannot fill the 8 chunks"),
], ids=["layers-by-stage", "layers-by-chunks", "m-by-stage-interleaved", "m-below-stage", "batch-by-m",
        "micro-and-m-disagree", "virtual-without-stages", "chunk-sizes-sum", "chunk-sizes-count",
        "chunk-sizes-negative", "split-unknown", "chunk-sizes-without-stages", "balanced-too-few-layers"])
def test_bad_pipeline_layouts_are_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_degrees(load_config(None, BASE + overrides), 8)


EVAL_LAYOUTS = {name: LAYOUTS[name] for name in ("stage4", "stage2-virtual2", "stage2-tensor2-data2-sp")}
# layers of several kinds, differently in each chunk: a dense layer among MoE ones, sliding-window and full layers
EVAL_LAYOUTS["stage2-virtual2-dense-and-moe-windowed"] = [
    "parallel.stage=2", "parallel.virtual_stages=2", "parallel.data=2", "parallel.expert=2", "model.num_layers=4",
    "model.moe.num_experts=4", "model.moe.dense_layers=[2]", "model.sliding_window=8", "model.local_rope_theta=100",
    "model.layer_types=[sliding_attention, full_attention, sliding_attention, sliding_attention]"]


@pytest.mark.parametrize("layout", list(EVAL_LAYOUTS))
def test_pipelined_evaluation_equals_plain_evaluation(layout, tmp_path):
    """`Trainer.evaluate` with stages runs the pipeline's forward ticks; same initial weights, same loss."""
    common = BASE + ["train.eval_batches=2"] + [o for o in EVAL_LAYOUTS[layout] if "model." in o]
    plain = Trainer(load_config(None, common + [f"train.output_dir={tmp_path / 'plain'}"]), devices=jax.devices()[:1])
    piped = Trainer(load_config(None, common + EVAL_LAYOUTS[layout] + [f"train.output_dir={tmp_path / 'piped'}"]),
                    devices=jax.devices()[:8])
    assert piped.schedule is not None
    np.testing.assert_allclose(piped.evaluate(), plain.evaluate(), rtol=1e-5)


HEAD_RUNS = {"plain": ["parallel.data=8", "train.num_microbatches=2", "model.scan_layers=false"],
             **{s: ["parallel.stage=2", "parallel.data=4", f"parallel.pipeline_schedule={s}"] for s in ("1f1b", "gpipe")}}


@pytest.mark.parametrize("run", list(HEAD_RUNS))
def test_the_heads_weight_gradient_is_an_fp32_product_as_in_plain_accumulation(run, tmp_path):
    """bf16: every microbatch's gradient of the head's kernel comes out of its product in fp32 and is summed so, as
    plain accumulation's does (`linear.master_einsum`), never rounded to bf16 first: each product with the kernel's
    shape in the lowered step (its weight gradients; the logits and the input gradient have activation shapes)."""
    overrides = BASE + ["model.dtype=bfloat16", "model.num_layers=4", f"train.output_dir={tmp_path}"] + HEAD_RUNS[run]
    trainer = Trainer(load_config(None, overrides), devices=jax.devices())
    d, v = trainer.state.params["head"]["kernel"].shape
    text = trainer._train_step.lower(trainer.abstract_state, trainer.batch_shapes()).as_text()
    products = re.findall(rf"stablehlo\.dot_general.*-> tensor<(?:{d}x{v}|{v}x{d})x(\w+)>", text)
    assert products and set(products) == {"f32"}, products
