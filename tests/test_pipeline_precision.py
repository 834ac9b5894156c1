"""Every pipelined layout of the equivalence tests trains in low precision as well as one device does: bf16
compute, bf16 parameters, ZeRO-1 and fp8 matmuls at once, 10 steps, its losses tracking the float32 run of one
device. "As well as one device" is measured, not assumed: the same precision on one device strays from float32 by
some amount over the 10 steps, and the pipelined run may stray at most twice that (plus 1e-3).

One mode covers what the stages see of each precision: bf16 weights inside them (stored so, or ZeRO-1's bf16
compute copy of fp32 masters, cast outside the pipeline and tested without stages), bf16 activations and
gradients, fp8 matmuls, and the sharded optimizer around them.

This also proves the traces compile: bf16 weights inside stages (stored so, or cast from fp32 masters by ZeRO-1)
once made the 1F1B backward's branches disagree on gradient dtypes, and GPipe's bf16 psum over stages crashed
XLA CPU.
"""
import jax
import numpy as np
import pytest

from mlm_jax import Trainer, load_config
from test_pipeline import LAYOUTS

BASE = ["model.hidden_size=64", "model.num_heads=4", "model.num_kv_heads=2",
        "model.ffn_size=128", "model.vocab_size=264", "train.steps=10", "train.log_every=1", "train.eval_every=0",
        "train.global_batch_size=16", "train.seq_len=16", "log.progress=never", "optim.warmup_steps=0",
        "optim.lr=3e-3", "data.max_bytes=2000000", "checkpoint.save=false", "checkpoint.resume=none"]
MOE = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.expert_ffn_size=64"]
PRECISIONS = {"bf16-params-zero1-fp8": ["model.dtype=bfloat16", "model.param_dtype=bfloat16",
                                        "parallel.shard_optimizer=true", "model.precision=fp8"]}
SCHEDULES = ("1f1b", "zb1", "gpipe")
PIPELINED = {**{f"{name}-{SCHEDULES[i % 3]}": (layout + [f"parallel.pipeline_schedule={SCHEDULES[i % 3]}"], [])
                for i, (name, layout) in enumerate(LAYOUTS.items())},
             "stage2-context2-ring-zb1": (["parallel.stage=2", "parallel.context=2", "parallel.data=2",
                                           "parallel.context_strategy=ring", "parallel.pipeline_schedule=zb1",
                                           "model.num_layers=2"], []),
             "stage2-expert2-moe-1f1b": (["parallel.stage=2", "parallel.expert=2", "parallel.data=2",
                                          "model.num_layers=2"], MOE)}


def losses(overrides, num_devices, tmp_path) -> np.ndarray:
    cfg = load_config(None, BASE + overrides + [f"train.output_dir={tmp_path}"])
    trainer = Trainer(cfg, devices=jax.devices()[:num_devices])
    out = np.array([r["loss"] for r in trainer.fit() if "loss" in r])
    assert len(out) == 10 and np.all(np.isfinite(out)) and int(trainer.state.skipped_steps) == 0
    return out


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    """(model overrides, precision or "float32") -> the loss curve of one device."""
    cache = {}

    def get(model: list[str], precision: str):
        key = (tuple(model), precision)
        if key not in cache:
            overrides = model + (["model.dtype=float32"] if precision == "float32" else PRECISIONS[precision])
            cache[key] = losses([o for o in overrides if "shard_optimizer" not in o] + ["parallel.data=1"], 1,
                                tmp_path_factory.mktemp("one"))
        return cache[key]
    return get


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("layout", list(PIPELINED))
def test_pipelined_low_precision_tracks_float32(layout, precision, one_device, tmp_path):
    overrides, model = PIPELINED[layout]
    model = model + [o for o in overrides if o.startswith("model.")]  # the layout's depth
    reference, same_precision = one_device(model, "float32"), one_device(model, precision)
    strays = np.max(np.abs(same_precision - reference))
    got = losses(model + overrides + PRECISIONS[precision], 8, tmp_path)
    assert np.max(np.abs(got - reference)) <= 2 * strays + 1e-3, (got - reference, strays)
