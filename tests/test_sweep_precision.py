"""Every model.dtype x model.param_dtype x model.precision, with and without gradient accumulation, on a plain and
on a pipelined layout, either trains 2 steps or is refused in one line before anything is traced; none ends in a
traceback or an abort. The expected outcome of each case is stated, not observed."""
import pytest

from layouts import train_or_refusal

BASE = ["train.log_every=1", "train.eval_every=0", "train.global_batch_size=16", "train.seq_len=16",
        "log.progress=never", "data.max_bytes=2000000", "model.vocab_size=264", "model.hidden_size=64",
        "model.num_heads=8", "model.ffn_size=64", "optim.warmup_steps=0"]
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
    refusal = train_or_refusal(BASE + overrides, tmp_path)
    if param_dtype == "float16":  # master weights: AdamW's second moments would underflow
        assert refusal is not None and "model.param_dtype='float16'" in refusal
    elif precision == "fp8_te":  # Transformer Engine is not installed on the test machines
        assert refusal is not None and "needs Transformer Engine" in refusal
    elif dtype == "float16":  # XLA's CPU dots cannot accumulate float16 in float32
        assert refusal is not None and "model.dtype=float16" in refusal
    else:
        assert refusal is None
