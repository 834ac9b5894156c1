"""Every layout and precision either trains or is refused in one line before anything is traced; none ends in a
traceback or an abort.

- Degrees: every assignment of the six mesh degrees whose product is 8 (56), for a dense model with sequence
  parallelism and virtual stages wherever they apply, and for an MoE model without them (the equivalence tests
  cover stages without virtual ones).
- Precision: every model.dtype x model.param_dtype x model.precision, with and without gradient accumulation, on
  a plain and on a pipelined layout.

The expected outcome of each case is stated, not observed: a case that should train and is refused fails, and so
does one that should be refused and trains.
"""
import itertools
import math

import jax
import numpy as np
import pytest

from mlm_jax import Trainer, load_config
from mlm_jax.config import ConfigError

AXES = ("data", "stage", "fsdp", "context", "expert", "tensor")
ASSIGNMENTS = [dict(zip(AXES, d)) for d in itertools.product((1, 2, 4, 8), repeat=6) if math.prod(d) == 8]
BASE = ["train.steps=2", "train.log_every=1", "train.eval_every=0", "train.global_batch_size=16", "train.seq_len=16",
        "log.progress=never", "data.max_bytes=2000000", "checkpoint.every=0", "model.vocab_size=264",
        "model.hidden_size=64", "model.num_heads=8", "model.ffn_size=64", "optim.warmup_steps=0"]
DENSE = ["model.num_layers=16"]  # 16 layers: 8 stages x 2 virtual
MOE = ["model.num_layers=2", "model.moe.num_experts=8", "model.moe.expert_ffn_size=32"]


def attempt(overrides, tmp_path) -> str | None:
    """None when `overrides` trained 2 finite steps on all 8 devices, else the one-line refusal."""
    try:
        trainer = Trainer(load_config(None, BASE + overrides + [f"train.output_dir={tmp_path}"]),
                          devices=jax.devices())
    except ConfigError as e:
        message = str(e)
        assert message and "\n" not in message, message
        return message
    records = trainer.fit()
    assert [r["step"] for r in records] == [1, 2]
    assert all(np.isfinite(r["loss"]) for r in records), records
    return None


def layout(d: dict, sp: bool, virtual: bool) -> list[str]:
    out = [f"parallel.{a}={n}" for a, n in d.items()]
    if sp and d["tensor"] > 1:
        out.append("parallel.sequence_parallel=true")
    if virtual and d["stage"] > 1:
        out.append("parallel.virtual_stages=2")
    return out


def name(d: dict) -> str:
    return "-".join(f"{a}{n}" for a, n in d.items() if n > 1)


@pytest.mark.parametrize("degrees", ASSIGNMENTS, ids=name)
def test_dense_with_sequence_parallelism_and_virtual_stages_trains(degrees, tmp_path):
    assert attempt(DENSE + layout(degrees, sp=True, virtual=True), tmp_path) is None


@pytest.mark.parametrize("degrees", ASSIGNMENTS, ids=name)
def test_moe_without_sequence_parallelism_trains_or_is_refused_inside_pipeline_stages(degrees, tmp_path):
    refusal = attempt(MOE + layout(degrees, sp=False, virtual=False), tmp_path)
    if degrees["stage"] > 1:
        assert refusal is not None and "do not run in the pipeline" in refusal
    else:
        assert refusal is None


DTYPES = ("float32", "bfloat16", "float16")
# Accumulation: none or 2 microbatches of plain training; a pipeline always has microbatches (4 here).
PLAIN = ["parallel.data=2", "parallel.fsdp=2", "parallel.tensor=2"]
RUNS = {"plain": PLAIN, "plain-accumulated": PLAIN + ["train.micro_batch_size=2"],
        "pipelined": ["parallel.stage=2", "parallel.fsdp=2", "parallel.data=2", "parallel.virtual_stages=2",
                      "train.num_microbatches=4"]}


@pytest.mark.parametrize("run", list(RUNS))
@pytest.mark.parametrize("precision", ["bf16", "fp8", "fp8_te"])
@pytest.mark.parametrize("param_dtype", DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_precision_trains_or_is_refused(dtype, param_dtype, precision, run, tmp_path):
    overrides = [f"model.dtype={dtype}", f"model.param_dtype={param_dtype}", f"model.precision={precision}",
                 "model.num_layers=4", *RUNS[run]]
    refusal = attempt(overrides, tmp_path)
    if precision == "fp8_te":  # Transformer Engine is not installed on the test machines
        assert refusal is not None and "needs Transformer Engine" in refusal
    elif dtype == "float16":  # XLA's CPU dots cannot accumulate float16 in float32
        assert refusal is not None and "model.dtype=float16" in refusal
    else:
        assert refusal is None
