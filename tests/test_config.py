"""Config loading, overrides and validation, and degree resolution against a device count (no compilation)."""
import dataclasses
import pathlib

import jax
import pytest

from mlm_jax import Trainer, load_config
from mlm_jax.config import Config, ConfigError, to_yaml
from mlm_jax.ops import grouped_matmul
from mlm_jax.validation.plan import TRITON_GEMM, _check_backend, check_degrees, matmuls, plan

CONFIGS = sorted((pathlib.Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


def write(tmp_path, text, name="run.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


# -- files and defaults ----------------------------------------------------------------------------------------------
def test_defaults_equal_tiny_yaml_apart_from_name():
    tiny = next(p for p in CONFIGS if p.name == "tiny.yaml")
    assert dataclasses.replace(load_config(tiny), name=Config().name) == Config()


def test_config_files_exist():
    assert len(CONFIGS) >= 2


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_file_loads_and_is_named_after_its_file(path):
    assert load_config(path).name == path.stem


def test_empty_yaml_file_gives_defaults(tmp_path):
    assert load_config(write(tmp_path, "")) == dataclasses.replace(Config(), name="run")


# -- overrides ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("override, key, expected", [
    ("train.steps=7", "train.steps", 7),
    ("optim.lr=0.01", "optim.lr", 0.01),
    ("optim.lr=1e-3", "optim.lr", 1e-3),  # YAML 1.1 reads this as a string
    ("optim.lr=2", "optim.lr", 2.0),
    ("model.qk_norm=true", "model.qk_norm", True),
    ("model.tie_embeddings=false", "model.tie_embeddings", False),
    ("parallel.rules=[[embed, [fsdp, data]]]", "parallel.rules", [["embed", ["fsdp", "data"]]]),
    ("parallel.rules=tp_sp", "parallel.rules", "tp_sp"),
    ("optim.clip_grad=null", "optim.clip_grad", None),
    ("train.micro_batch_size=2", "train.micro_batch_size", 2),
    ("train.output_dir=runs/x", "train.output_dir", "runs/x"),
    ("model.norm=layernorm", "model.norm", "layernorm"),
])
def test_override_parses_value(override, key, expected):
    section, name = key.split(".")
    value = getattr(getattr(load_config(overrides=[override]), section), name)
    assert value == expected and type(value) is type(expected)


def test_override_wins_over_yaml_which_wins_over_defaults(tmp_path):
    path = write(tmp_path, "train:\n  steps: 50\n  seed: 3\n")
    cfg = load_config(path, ["train.steps=7"])
    assert (cfg.train.steps, cfg.train.seed, cfg.train.seq_len) == (7, 3, Config().train.seq_len)


def test_later_override_wins():
    assert load_config(overrides=["train.steps=5", "train.steps=9"]).train.steps == 9


def test_yaml_float_without_dot_parses(tmp_path):
    assert load_config(write(tmp_path, "optim:\n  lr: 1e-3\n")).optim.lr == 1e-3


# -- rejected input ----------------------------------------------------------------------------------------------------
def test_unknown_key_suggests_the_closest():
    with pytest.raises(ConfigError, match=r"'model\.hiden_size' \(did you mean model\.hidden_size\?\)"):
        load_config(overrides=["model.hiden_size=64"])


def test_unknown_key_in_yaml_suggests_the_closest(tmp_path):
    with pytest.raises(ConfigError, match=r"did you mean train\.seq_len\?"):
        load_config(write(tmp_path, "train:\n  seq_lenn: 64\n"))


def test_unknown_section_rejected_in_override_and_yaml(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown config key 'modle\.hidden_size'"):
        load_config(overrides=["modle.hidden_size=64"])
    with pytest.raises(ConfigError, match=r"unknown config key 'trainer' \(did you mean train\?\)"):
        load_config(write(tmp_path, "trainer:\n  steps: 3\n"))


def test_unrelated_unknown_key_has_no_suggestion():
    with pytest.raises(ConfigError) as e:
        load_config(overrides=["model.zzzzzz=1"])
    assert "did you mean" not in str(e.value)


@pytest.mark.parametrize("override, message", [
    ("train.steps=abc", r"train\.steps='abc': expected int"),
    ("train.steps=1.5", r"train\.steps=1\.5: expected int"),
    ("model.qk_norm=3", r"model\.qk_norm=3: expected bool"),
    ("model.hidden_size=true", r"model\.hidden_size=True: expected int"),
    ("model.hidden_size=null", r"model\.hidden_size=None: expected int"),
    ("optim.lr=fast", r"optim\.lr='fast': expected float"),
    ("model.norm=3", r"model\.norm=3: expected str"),
])
def test_wrong_type_rejected(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=[override])


def test_override_without_equals_rejected():
    with pytest.raises(ConfigError, match=r"'train\.steps': expected section\.key=value"):
        load_config(overrides=["train.steps"])


@pytest.mark.parametrize("override, message", [
    ("model.norm=batchnorm", r"model\.norm='batchnorm': expected one of rmsnorm, layernorm"),
    ("optim.schedule=linear", r"optim\.schedule='linear': expected one of cosine, wsd, constant"),
    ("model.dtype=int8", r"model\.dtype='int8': expected one of float32, bfloat16, float16"),
    ("model.precision=int4", r"model\.precision='int4': expected one of bf16, fp8, fp8_delayed, fp8_te"),
])
def test_value_outside_choices_rejected(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=[override])


@pytest.mark.parametrize("override, message", [
    ("train.steps=0", r"train\.steps=0: must be positive"),
    ("model.num_kv_heads=-2", r"model\.num_kv_heads=-2: must be positive"),
    ("parallel.tensor=0", r"parallel\.tensor=0: expected a positive degree or -1"),
    ("parallel.data=-2", r"parallel\.data=-2: expected a positive degree or -1"),
    ("model.hidden_size=130", r"model\.hidden_size=130 is not divisible by model\.num_heads=4"),
    ("model.num_kv_heads=3", r"model\.num_kv_heads=3 must divide model\.num_heads=4"),
    ("model.head_dim=33", r"model\.head_dim=33: rotary"),
    ("data.validation_fraction=1", r"data\.validation_fraction=1\.0: expected a number in \(0, 1\)"),
    ("optim.clip_grad=0", r"optim\.clip_grad=0\.0: must be positive or null"),
    ("optim.moments_dtype=float16", r"optim\.moments_dtype='float16': expected one of float32, bfloat16"),
    ("log.profile_steps=[3,2]", r"log\.profile_steps=\[3, 2\]: expected \[first, last\] steps with 1 <= first <= last"),
    ("log.profile_steps=[0,2]", r"log\.profile_steps=\[0, 2\]: expected \[first, last\]"),
    ("log.profile_steps=5", r"log\.profile_steps=5: expected list or null"),
    ("parallel.dcn_data=0", r"parallel\.dcn_data=0: must be positive"),
    ("train.eval_every=-1", r"train\.eval_every=-1: must be >= 0"),
])
def test_invalid_value_rejected(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=[override])


def test_more_than_one_minus_one_degree_rejected():
    with pytest.raises(ConfigError, match=r"more than one degree is -1 \(parallel\.data, parallel\.fsdp\)"):
        load_config(overrides=["parallel.fsdp=-1"])


def test_print_config_round_trips(tmp_path):
    cfg = load_config(overrides=["model.num_kv_heads=2", "optim.lr=1e-4", "parallel.rules=[[embed, data]]",
                                 "train.micro_batch_size=1", "optim.clip_grad=null", "model.norm_eps=1e-5"])
    again = load_config(write(tmp_path, to_yaml(cfg), "printed.yaml"))
    assert again == cfg


# -- degree resolution -------------------------------------------------------------------------------------------------
def degrees_of(*overrides, devices=8):
    return check_degrees(load_config(overrides=overrides), devices)[0]


def test_minus_one_takes_the_remaining_devices():
    assert degrees_of() == {"data": 8, "stage": 1, "fsdp": 1, "context": 1, "expert": 1, "tensor": 1}
    assert degrees_of("parallel.tensor=2", "parallel.context=2") == {
        "data": 2, "stage": 1, "fsdp": 1, "context": 2, "expert": 1, "tensor": 2}
    assert degrees_of("parallel.data=2", "parallel.fsdp=-1", "parallel.tensor=2")["fsdp"] == 2


def test_explicit_degrees_matching_the_device_count_resolve():
    assert degrees_of("parallel.data=1", "parallel.fsdp=4", devices=4)["fsdp"] == 4


@pytest.mark.parametrize("overrides, message", [
    (["parallel.tensor=3"], r"parallel\.data=-1: the other degrees multiply to 3, which does not divide the 8 devices"),
    (["parallel.data=3"], r"\(parallel\.data=3\) multiply to 3, but 8 devices"),
    (["parallel.data=2", "parallel.tensor=2"], r"\(parallel\.data=2 x parallel\.tensor=2\) multiply to 4, but 8 devices"),
    (["parallel.tensor=8"], r"model\.num_heads=4 is not divisible by parallel\.tensor=8"),
    (["model.num_heads=12", "model.head_dim=16", "model.num_kv_heads=3", "parallel.tensor=4", "parallel.data=2"],
     r"model\.num_kv_heads=3 and parallel\.tensor=4: one must divide the other"),
    (["parallel.context=8", "parallel.data=1", "train.seq_len=100"],
     r"train\.seq_len=100 is not divisible by 2 x parallel\.context=8"),
    (["parallel.stage=8", "parallel.data=1"], r"model\.num_layers=4 is not divisible by parallel\.stage=8"),
    (["parallel.stage=4", "parallel.data=2", "train.num_microbatches=2"], r"cannot fill parallel\.stage=4"),
    (["train.global_batch_size=12"], r"train\.global_batch_size=12 is not divisible by data-parallel degree 8"),
    (["train.micro_batch_size=3"],
     r"train\.global_batch_size=16 is not divisible by train\.micro_batch_size=3 x data-parallel degree 8"),
    (["train.global_batch_size=4"], r"train\.global_batch_size=4 is not divisible by data-parallel degree 8"),
], ids=["minus-one-not-dividing", "product-short", "product-short-two-axes", "heads-by-tensor",
        "kv-heads-by-tensor", "seq-len-by-context", "layers-by-stage", "microbatches-below-stages",
        "global-batch-by-dp", "micro-batch", "global-batch-below-dp"])
def test_degree_error_names_key_and_value(overrides, message):
    with pytest.raises(ConfigError, match=message):
        degrees_of(*overrides)


@pytest.mark.parametrize("override", ["optim.lr=nan", "optim.clip_grad=.inf"])
def test_non_finite_floats_rejected(override):
    with pytest.raises(ConfigError, match="expected float"):
        load_config(overrides=[override])


def test_empty_section_keeps_defaults(tmp_path):
    assert load_config(write(tmp_path, "model:\n", "empty.yaml")).model == load_config().model


# -- nested sections (model.moe) -----------------------------------------------------------------------------------
def test_nested_moe_keys_from_overrides_and_yaml(tmp_path):
    cfg = load_config(write(tmp_path, "model:\n  moe:\n    num_experts: 4\n    top_k: 1\n"), ["model.moe.top_k=2"])
    assert (cfg.model.moe.num_experts, cfg.model.moe.top_k) == (4, 2)
    assert load_config(write(tmp_path, to_yaml(cfg), "again.yaml")).model == cfg.model


@pytest.mark.parametrize("override, message", [
    ("model.moe.num_expert=4", r"unknown config key 'model\.moe\.num_expert' \(did you mean model\.moe\.num_experts\?\)"),
    ("model.moe=4", r"model\.moe: expected a mapping of keys, got 4"),
    ("model.moe.router=relu", r"model\.moe\.router='relu': expected one of softmax, sigmoid"),
    ("model.top_k.x=1", r"unknown config key 'model\.top_k\.x'"),
])
def test_bad_nested_keys_are_one_line_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["model.moe.num_experts=4", override])


# -- what runs -----------------------------------------------------------------------------------------------------
def test_plan_names_the_kernels_chosen_and_why_auto_fell_back():
    dense = plan(load_config(overrides=["parallel.tensor=2"]), jax.devices())
    assert dense.degrees["tensor"] == 2 and dense.accum_steps == 1 and dense.experts is None
    assert dense.attention == "xla (cudnn: cuDNN attention needs an NVIDIA GPU, and this run has cpu devices)"
    moe = plan(load_config(overrides=["model.moe.num_experts=4", "parallel.context=2", "parallel.data=4"]),
               jax.devices())
    assert moe.attention.endswith("context-parallel allgather over 2 ranks")
    assert moe.experts == "dropless, jax.lax.ragged_dot (mgpu: needs a Hopper GPU, and this run has cpu devices)"
    ragged = plan(load_config(overrides=["model.moe.num_experts=4", "model.moe.impl=ragged"]), jax.devices())
    assert ragged.experts == "dropless, jax.lax.ragged_dot"
    capacity = plan(load_config(overrides=["model.moe.num_experts=4", "model.moe.capacity_factor=1.0"]),
                    jax.devices())
    assert capacity.experts.startswith("capacity")


def test_matmul_impl_turns_tritons_gemms_off_on_gpus_where_the_step_accumulates_microbatches(tmp_path):
    off = {TRITON_GEMM: False}
    assert matmuls("auto", "gpu", 4, False, "")[0] == off and matmuls("auto", "gpu", 1, False, "")[0] == {}
    assert matmuls("auto", "gpu", 8, True, "")[0] == {}  # the pipeline executor keeps XLA's choice
    assert matmuls("cublas", "gpu", 1, True, "")[0] == off and matmuls("xla", "gpu", 8, False, "")[0] == {}
    # the user's XLA_FLAGS decide over auto, not over an explicit choice
    assert matmuls("auto", "gpu", 4, False, f"--{TRITON_GEMM}=true") == ({}, f"as XLA_FLAGS sets --{TRITON_GEMM}")
    assert matmuls("cublas", "gpu", 4, False, f"--{TRITON_GEMM}=true")[0] == off
    assert matmuls("auto", "cpu", 4, False, "") == ({}, None) and matmuls("xla", "cpu", 1, False, "") == ({}, None)
    with pytest.raises(ConfigError, match="train.matmul_impl=cublas: cuBLAS needs GPUs, the devices here are cpu"):
        plan(load_config(overrides=["train.matmul_impl=cublas"]), jax.devices())
    assert Trainer(load_config(overrides=["train.num_microbatches=2", f"train.output_dir={tmp_path}"]),
                   devices=jax.devices()).matmuls is None


def test_hopper_experts_compiled_without_a_gpu_take_the_compile_only_weight_gradient():
    """A planner without GPUs compiles the Mosaic grouped matmul for described Hoppers, all but its weight gradient,
    whose kernel needs a GPU in the process (`ops.grouped_matmul`'s `mgpu-compile`)."""
    cfg = load_config(overrides=["model.moe.num_experts=4", "model.dtype=bfloat16", "model.hidden_size=128",
                                 "model.moe.expert_ffn_size=256"])
    degrees = {"data": 1, "fsdp": 1, "stage": 1, "context": 1, "expert": 1, "tensor": 1}
    here = _check_backend(cfg, degrees, "gpu", "NVIDIA H100", "9.0")[0]
    described = _check_backend(cfg, degrees, "gpu", "NVIDIA H100", "9.0", gpu_here=False)[0]
    assert (here.experts, described.experts) == ("mgpu", "mgpu-compile")
    x_RK, dy_RN = jax.random.normal(jax.random.key(0), (6, 3)), jax.random.normal(jax.random.key(1), (6, 5))
    w_GKN = grouped_matmul._dense_wgrad(x_RK, dy_RN, jax.numpy.array([2, 4, 0, 0]))
    assert w_GKN.shape == (4, 3, 5) and jax.numpy.allclose(w_GKN[2], x_RK.T @ dy_RN, rtol=1e-6)


def test_wide_heads_on_described_gpus_are_refused_in_one_line():
    """Without a GPU in the process, jax's cuDNN attention allows heads of at most 128 (it reads the limit from the
    process's own device): a plan of a wider-headed model says so instead of failing in the trace."""
    degrees = {"data": 1, "fsdp": 1, "stage": 1, "context": 1, "expert": 1, "tensor": 1}
    for overrides in (["model.head_dim=256"], ["model.mla.kv_lora_rank=64"]):
        cfg = load_config(overrides=["model.dtype=bfloat16", *overrides])
        assert _check_backend(cfg, degrees, "gpu", "NVIDIA H100", "9.0")[0].attention == "cudnn"
        with pytest.raises(ConfigError, match="head dim (256|192) .* model.attention_impl=xla"):
            _check_backend(cfg, degrees, "gpu", "NVIDIA H100", "9.0", gpu_here=False)
    narrow = load_config(overrides=["model.dtype=bfloat16"])
    assert _check_backend(narrow, degrees, "gpu", "NVIDIA H100", "9.0", gpu_here=False)[0].attention == "cudnn"
