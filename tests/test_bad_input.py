"""Bad input through the CLI's entry point: one `error:` line naming the key, the value and what is allowed, exit
code 2, no traceback, and nothing written: a run directory with its checkpoints and metrics stays byte-identical.

The CLI's `main(argv)` runs in this process (the same code path as `python -m mlm_jax.train`, minus interpreter
start-up, so sixty cases cost seconds); `test_cli_errors.py` runs the real subprocess for a sample of them.
"""
import hashlib
import os

import jax
import pytest

from mlm_jax import Trainer, load_config
from mlm_jax.train.__main__ import main

RUN = ["train.steps=2", "checkpoint.every=1", "train.log_every=1", "train.eval_every=0", "train.global_batch_size=8",
       "train.seq_len=32", "log.progress=never", "data.max_bytes=2000000"]
MOE = ["model.moe.num_experts=4", "model.ffn_size=128"]


def case(case_id, args, *expected):
    return pytest.param(args, expected, id=case_id)


CASES = [
    # optimizer
    case("lr-negative", ["optim.lr=-1"], "optim.lr=-1.0", "must be positive"),
    case("lr-zero", ["optim.lr=0"], "optim.lr=0.0", "must be positive"),
    case("min-lr-negative", ["optim.min_lr=-1e-4"], "optim.min_lr=-0.0001", "must be >= 0"),
    case("beta1-above-one", ["optim.beta1=2"], "optim.beta1=2.0", "in [0, 1)"),
    case("beta2-one", ["optim.beta2=1"], "optim.beta2=1.0", "in [0, 1)"),
    case("eps-zero", ["optim.eps=0"], "optim.eps=0.0", "must be positive"),
    case("weight-decay-negative", ["optim.weight_decay=-0.1"], "optim.weight_decay=-0.1", "must be >= 0"),
    case("decay-fraction", ["optim.decay_fraction=1.5"], "optim.decay_fraction=1.5", "in [0, 1]"),
    case("warmup-negative", ["optim.warmup_steps=-1"], "optim.warmup_steps=-1", "must be >= 0"),
    case("clip-zero", ["optim.clip_grad=0"], "optim.clip_grad=0.0", "must be positive or null"),
    case("schedule", ["optim.schedule=linear"], "optim.schedule='linear'", "cosine, wsd, constant"),
    # model
    case("rope-theta-zero", ["model.rope_theta=0"], "model.rope_theta=0.0", "must be positive"),
    case("norm-eps-negative", ["model.norm_eps=-1"], "model.norm_eps=-1.0", "must be positive"),
    case("init-std-zero", ["model.init_std=0"], "model.init_std=0.0", "must be positive"),
    case("vocab-zero", ["model.vocab_size=0"], "model.vocab_size=0", "must be positive"),
    case("layers-negative", ["model.num_layers=-2"], "model.num_layers=-2", "must be positive"),
    case("hidden-by-heads", ["model.hidden_size=130"], "model.hidden_size=130", "model.num_heads=4"),
    case("kv-heads-not-dividing", ["model.num_kv_heads=3"], "model.num_kv_heads=3", "must divide model.num_heads=4"),
    case("odd-head-dim", ["model.head_dim=33"], "model.head_dim=33", "even head dimension"),
    case("odd-rotary-dims", ["model.partial_rotary_factor=0.3"], "model.head_dim=32", "rotates 9 dims"),
    case("rotary-fraction-above-one", ["model.partial_rotary_factor=1.5"], "model.partial_rotary_factor=1.5",
         "in (0, 1]"),
    case("rope-type", ["model.rope_scaling.rope_type=ntk"], "model.rope_scaling.rope_type='ntk'",
         "default, linear, llama3, yarn"),
    case("llama3-rope-incomplete", ["model.rope_scaling.rope_type=llama3", "model.rope_scaling.factor=8"],
         "model.rope_scaling.rope_type=llama3", "needs model.rope_scaling.low_freq_factor"),
    case("norm", ["model.norm=batchnorm"], "model.norm='batchnorm'", "rmsnorm, layernorm"),
    case("activation", ["model.activation=relu"], "model.activation='relu'", "swiglu, gelu"),
    case("dtype", ["model.dtype=int8"], "model.dtype='int8'", "float32, bfloat16, float16"),
    case("param-dtype", ["model.param_dtype=float16"], "model.param_dtype='float16'", "float32, bfloat16"),
    case("remat", ["model.remat=some"], "model.remat='some'", "none, dots, full"),
    case("precision", ["model.precision=int4"], "model.precision='int4'", "bf16, fp8, fp8_delayed, fp8_te"),
    case("cudnn-without-gpu", ["model.attention_impl=cudnn"], "model.attention_impl=cudnn", "needs an NVIDIA GPU",
         "auto or xla"),
    case("te-attention-missing", ["model.attention_impl=te"], "model.attention_impl=te", "Transformer Engine"),
    case("te-fp8-missing", ["model.precision=fp8_te"], "model.precision=fp8_te", "Transformer Engine"),
    case("float16-on-cpu", ["model.dtype=float16"], "model.dtype=float16", "bfloat16 or float32 on CPUs"),
    # mixture of experts
    case("mgpu-float32", [*MOE, "model.moe.impl=mgpu", "model.dtype=float32"], "model.moe.impl=mgpu",
         "Hopper GPU", "auto or ragged"),
    case("mgpu-on-cpu", [*MOE, "model.moe.impl=mgpu"], "model.moe.impl=mgpu", "cpu devices"),
    case("moe-impl", [*MOE, "model.moe.impl=triton"], "model.moe.impl='triton'", "auto, ragged, mgpu"),
    case("expert-ffn-by-tensor", [*MOE, "model.moe.expert_ffn_size=36", "parallel.tensor=8", "model.num_heads=8"],
         "model.moe.expert_ffn_size=36", "parallel.tensor=8"),
    case("experts-by-expert-degree", ["model.moe.num_experts=6", "parallel.expert=4", "parallel.data=2"],
         "model.moe.num_experts=6", "parallel.expert=4"),
    case("top-k-above-experts", [*MOE, "model.moe.top_k=5"], "model.moe.top_k=5", "model.moe.num_experts=4"),
    case("capacity-zero", [*MOE, "model.moe.capacity_factor=0"], "model.moe.capacity_factor=0.0",
         "must be positive or null"),
    case("capacity-with-context", [*MOE, "model.moe.capacity_factor=0.5", "parallel.context=2", "parallel.data=4"],
         "model.moe.capacity_factor=0.5", "parallel.context=2", "capacity_factor: null"),
    case("capacity-groups-straddle", [*MOE, "model.moe.capacity_factor=0.5", "model.moe.capacity_group_rows=2"],
         "model.moe.capacity_group_rows=2", "1 batch row(s) each device"),
    case("bias-update-softmax", [*MOE, "model.moe.router_bias_update=0.1"], "model.moe.router_bias_update=0.1",
         "model.moe.router=sigmoid"),
    case("aux-coef-negative", [*MOE, "model.moe.aux_loss_coef=-1"], "model.moe.aux_loss_coef=-1.0", "must be >= 0"),
    case("no-moe-layer", [*MOE, "model.moe.first_dense_layers=4"], "model.moe.first_dense_layers=4",
         "model.num_layers=4"),
    case("router", [*MOE, "model.moe.router=relu"], "model.moe.router='relu'", "softmax, sigmoid"),
    # training
    case("steps-zero", ["train.steps=0"], "train.steps=0", "must be positive"),
    case("seed-negative", ["train.seed=-1"], "train.seed=-1", "must be >= 0"),
    case("log-every-zero", ["train.log_every=0"], "train.log_every=0", "must be positive"),
    case("eval-every-negative", ["train.eval_every=-5"], "train.eval_every=-5", "must be >= 0"),
    case("global-batch-by-dp", ["train.global_batch_size=12"], "train.global_batch_size=12", "data-parallel degree 8"),
    case("micro-batch", ["train.micro_batch_size=3"], "train.micro_batch_size=3", "data-parallel degree 8"),
    case("nan-policy", ["train.nan_policy=ignore"], "train.nan_policy='ignore'", "skip, stop"),
    case("steps-type", ["train.steps=abc"], "train.steps='abc'", "expected int"),
    # layout
    case("tensor-not-dividing-devices", ["parallel.tensor=3"], "parallel.data=-1", "multiply to 3",
         "does not divide the 8 devices"),
    case("degrees-not-device-count", ["parallel.data=3"], "parallel.data=3", "8 devices"),
    case("layers-by-stage", ["parallel.stage=8", "parallel.data=1"], "model.num_layers=4", "parallel.stage=8"),
    case("fp8-delayed-pipeline", ["model.precision=fp8_delayed", "parallel.stage=2", "parallel.data=4"],
         "model.precision=fp8_delayed", "parallel.stage=2"),
    case("virtual-without-stages", ["parallel.virtual_stages=2"], "parallel.virtual_stages=2",
         "parallel.stage > 1"),
    case("microbatches-below-stages", ["parallel.stage=4", "parallel.data=2", "train.num_microbatches=2"],
         "cannot fill parallel.stage=4", "train.num_microbatches >= 4"),
    case("seq-len-by-context", ["parallel.context=8", "parallel.data=1", "train.seq_len=100"], "train.seq_len=100",
         "2 x parallel.context=8"),
    case("loss-chunks", ["train.loss_chunks=3"], "train.loss_chunks=3", "train.seq_len=32"),
    case("matmul-impl", ["train.matmul_impl=triton"], "train.matmul_impl='triton'", "auto, xla, cublas"),
    case("cublas-on-cpu", ["train.matmul_impl=cublas"], "train.matmul_impl=cublas", "use train.matmul_impl=auto"),
    case("loss-chunks-by-context", ["parallel.context=4", "parallel.data=2", "train.loss_chunks=16"],
         "train.loss_chunks=16 x parallel.context=4", "train.seq_len=32"),
    case("context-strategy", ["parallel.context_strategy=zigzag"], "parallel.context_strategy='zigzag'",
         "allgather, ring"),
    case("pipeline-schedule", ["parallel.pipeline_schedule=zb"], "parallel.pipeline_schedule='zb'", "1f1b, zb1, gpipe"),
    case("rules-preset", ["parallel.rules=foo"], "parallel.rules='foo'", "default, tp_sp"),
    case("dcn-zero", ["parallel.dcn_data=0"], "parallel.dcn_data=0", "must be positive"),
    case("dcn-without-hosts", ["parallel.dcn_data=2", "parallel.data=4"], "parallel.dcn_data=2",
         "span 1 process(es)"),
    case("degree-zero", ["parallel.fsdp=0"], "parallel.fsdp=0", "positive degree or -1"),
    # data, checkpoints, logging
    case("validation-fraction", ["data.validation_fraction=0"], "data.validation_fraction=0.0", "in (0, 1)"),
    case("weights-without-paths", ["data.weights=[1]"], "data.weights=[1]", "data.paths"),
    case("max-bytes-zero", ["data.max_bytes=0"], "data.max_bytes=0", "must be positive or null"),
    case("keep-zero", ["checkpoint.keep=0"], "checkpoint.keep=0", "must be positive"),
    case("every-negative", ["checkpoint.every=-1"], "checkpoint.every=-1", "must be >= 0"),
    case("progress", ["log.progress=sometimes"], "log.progress='sometimes'", "auto, always, never"),
    case("profile-steps", ["log.profile_steps=[3,2]"], "log.profile_steps=[3, 2]", "1 <= first <= last"),
    case("unknown-key", ["optim.learning_rate=1e-3"], "'optim.learning_rate'", "did you mean"),
]


def tree_digest(root) -> dict[str, str]:
    """Every file under `root` (relative path -> sha256), and every directory (-> 'dir')."""
    out = {}
    for base, dirs, files in os.walk(root):
        for d in dirs:
            out[os.path.relpath(os.path.join(base, d), root)] = "dir"
        for f in files:
            with open(os.path.join(base, f), "rb") as fh:
                out[os.path.relpath(os.path.join(base, f), root)] = hashlib.sha256(fh.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A finished run (two checkpoints, metrics, config) that every bad input below points at."""
    out = tmp_path_factory.mktemp("run")
    Trainer(load_config(None, RUN + [f"train.output_dir={out}"]), devices=jax.devices()).fit()
    assert {"config.yaml", "metrics.jsonl", "checkpoints/1", "checkpoints/2"} <= set(tree_digest(out))
    return out


def test_the_suite_has_at_least_40_distinct_cases():
    assert len({tuple(p.values[0]) for p in CASES}) == len(CASES) >= 40


@pytest.mark.parametrize("args, expected", CASES)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(args, expected, run_dir, tmp_path, capsys):
    before = tree_digest(run_dir)
    fresh = tmp_path / "fresh"
    for out in (run_dir, fresh):
        code = main(RUN + [f"train.output_dir={out}", *args])
        captured = capsys.readouterr()
        assert code == 2, captured
        err = captured.err
        assert captured.out == "" and err.startswith("error: ") and err.count("\n") == 1, err
        assert "Traceback" not in err
        for part in expected:
            assert part in err, err
    assert tree_digest(run_dir) == before
    assert not fresh.exists()
