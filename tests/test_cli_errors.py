"""The CLI: every bad input is one `error: ...` line on stderr, exit code 2, and no output directory. One case of
each place an error can arise (the argument parser, an override, the YAML file, a key, a value, the devices, the
model) runs the real subprocess; the others run its entry point, `main(argv)`, in this process
(`test_bad_input.py` has many more cases, in-process)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlm_jax.train.__main__ import main

REPO = Path(__file__).resolve().parents[1]

BROKEN_YAML = {"malformed.yaml": "model: [unclosed\n", "list.yaml": "- model\n- train\n"}


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "mlm_jax.train", *args], cwd=REPO, env=dict(os.environ),
                          capture_output=True, text=True, timeout=120)


# The cases that run the real subprocess: one of each place an error arises.
SUBPROCESS = {"unknown-flag", "argument-without-equals", "malformed-yaml", "unknown-key", "wrong-type",
              "degrees-not-device-count", "heads-by-tensor"}


def case(case_id, args, expected):
    return pytest.param(args, expected, case_id in SUBPROCESS, id=case_id)


CASES = [
    # id, arguments, substrings of the error line; `{tmp}` is the tmp_path holding BROKEN_YAML and binary.yaml.
    case("unknown-key", ["model.hiden_size=64"], ["'model.hiden_size'", "did you mean model.hidden_size"]),
    case("wrong-type", ["train.steps=abc"], ["train.steps=", "'abc'", "expected int"]),
    case("argument-without-equals", ["train.steps"], ["'train.steps'", "section.key=value"]),
    case("missing-yaml", ["--config", "/nonexistent.yaml"], ["--config /nonexistent.yaml", "no such file"]),
    case("malformed-yaml", ["--config", "{tmp}/malformed.yaml"], ["--config {tmp}/malformed.yaml", "malformed YAML"]),
    case("yaml-top-level-list", ["--config", "{tmp}/list.yaml"], ["--config {tmp}/list.yaml", "got list"]),
    case("choice", ["model.norm=batchnorm"], ["model.norm=", "'batchnorm'", "rmsnorm, layernorm"]),
    case("heads-by-tensor", ["parallel.tensor=8"], ["model.num_heads=4", "parallel.tensor=8"]),
    case("kv-heads-by-tensor", ["model.num_heads=12", "model.head_dim=16", "model.num_kv_heads=3",
                                "parallel.tensor=4", "parallel.data=2"],
         ["model.num_kv_heads=3", "parallel.tensor=4", "one must divide the other"]),
    case("degrees-not-device-count", ["parallel.data=3"], ["parallel.data=3", "8 devices"]),
    case("two-minus-one-degrees", ["parallel.fsdp=-1"], ["-1", "parallel.data", "parallel.fsdp"]),
    case("seq-len-by-context", ["parallel.context=8", "parallel.data=1", "train.seq_len=100"],
         ["train.seq_len=100", "parallel.context=8"]),
    case("global-batch-by-dp", ["train.global_batch_size=12"],
         ["train.global_batch_size=12", "data-parallel degree 8"]),
    case("micro-batch", ["train.micro_batch_size=3"],
         ["train.global_batch_size=16", "train.micro_batch_size=3", "data-parallel degree 8"]),
    case("layers-by-stage", ["parallel.stage=8", "parallel.data=1", "model.num_layers=4"],
         ["model.num_layers=4", "parallel.stage=8"]),
    case("unknown-flag", ["--bogus"], ["--bogus"]),
    case("global-batch-below-dp", ["train.global_batch_size=4"], ["train.global_batch_size=4"]),
    case("non-utf8-yaml", ["--config", "{tmp}/binary.yaml"], ["--config {tmp}/binary.yaml", "UTF-8"]),
    case("experts-by-expert-degree", ["model.moe.num_experts=6", "parallel.expert=4", "parallel.data=2"],
         ["model.moe.num_experts=6", "parallel.expert=4"]),
    case("top-k-above-experts", ["model.moe.num_experts=4", "model.moe.top_k=5"],
         ["model.moe.top_k=5", "model.moe.num_experts=4"]),
    case("seq-len-by-2-context", ["parallel.context=4", "parallel.data=2", "train.seq_len=36"],
         ["train.seq_len=36", "2 x parallel.context=4"]),
    case("attention-context-cannot-serve", ["parallel.context=2", "parallel.data=4", "model.attention_impl=te"],
         ["model.attention_impl=te", "parallel.context"]),
]


@pytest.mark.parametrize("args, expected, in_subprocess", CASES)
def test_bad_input_is_one_error_line_and_exit_code_2(tmp_path, capsys, args, expected, in_subprocess):
    for name, text in BROKEN_YAML.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "binary.yaml").write_bytes(b"\xff\xfe\x00model: {}\n")
    out = tmp_path / "out"
    argv = [*(a.replace("{tmp}", str(tmp_path)) for a in args), f"train.output_dir={out}"]
    if in_subprocess:
        result = run_cli(*argv)
        code, stdout, err = result.returncode, result.stdout, result.stderr
    else:
        code = main(argv)
        stdout, err = capsys.readouterr()
    assert not out.exists()  # refused before anything is written
    assert "Traceback" not in err, err
    assert err.startswith("error: ") and err.strip().count("\n") == 0, err
    assert code == 2
    assert stdout == ""
    for part in expected:
        assert part.replace("{tmp}", str(tmp_path)) in err, err


def test_print_config_prints_the_resolved_yaml():
    result = run_cli("--print-config", "model.num_layers=2")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert "hidden_size: 128" in result.stdout and "num_layers: 2" in result.stdout
