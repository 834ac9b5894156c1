"""Evaluation through lm-evaluation-harness: the same log-likelihoods (1e-4), accuracies and generated texts as
lm-eval's own `hf` model on the Hugging Face folder of the same random model, on the tiny tasks of
tests/eval_tasks (multiple choice, rolling perplexity, generation); the CLI's table, JSON and one-line errors; and
`eval.tasks` inside training."""
import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")  # lm-eval's hf model

from eval_models import CONTEXT, TASKS, save_family, save_tokenizer  # noqa: E402

from mlm_jax import Trainer, load_config, load_pretrained  # noqa: E402
from mlm_jax.config import ConfigError  # noqa: E402
from mlm_jax.infer.pretrained import Pretrained, load_tokenizer  # noqa: E402
from mlm_jax.data.tokenizer import HFTokenizer  # noqa: E402
from mlm_jax.eval.__main__ import main  # noqa: E402
from mlm_jax.eval.lm import MlmLM  # noqa: E402
from mlm_jax.eval.tasks import evaluate, task_manager  # noqa: E402
from mlm_jax.eval.tokens import Codec  # noqa: E402
from mlm_jax.validation.plan import plan  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ALL_TASKS = ["tiny_choice", "tiny_rolling", "tiny_generate"]
ACCURACIES = ("acc,none", "acc_norm,none", "exact_match,none")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    return {family: save_family(root, family) for family in ("llama", "qwen3")}


def responses(samples: list[dict]) -> list:
    """Every request's answer of every document, in document order: (log-likelihood, is greedy), a rolling
    log-likelihood, or a generated text."""
    out = []
    for doc in sorted(samples, key=lambda s: s["doc_id"]):
        for resp in doc["resps"]:
            out += [tuple(r) if isinstance(r, (tuple, list)) else r for r in resp]
    return out


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_scores_and_generations_match_lm_eval_hf_model(models, family):
    hf, ours = models[family]
    manager = task_manager(str(TASKS))
    ref = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={hf},dtype=float32", tasks=ALL_TASKS,
                                  device="cpu", batch_size=4, task_manager=manager, bootstrap_iters=0)
    got = evaluate(load_pretrained(ours, dtype="float32"), load_tokenizer(ours), ALL_TASKS, include_path=str(TASKS),
                   batch_size=4, log_samples=True, progress=False, bootstrap_iters=0)
    for task in ALL_TASKS:
        expected, actual = responses(ref["samples"][task]), responses(got["samples"][task])
        assert len(expected) == len(actual) > 0
        for e, a in zip(expected, actual):
            if isinstance(e, str):
                assert a == e
            elif isinstance(e, tuple):
                assert abs(a[0] - e[0]) <= 1e-4 and a[1] == e[1]
            else:
                assert abs(a - e) <= 1e-4
        for metric in ACCURACIES:
            assert got["results"][task].get(metric) == ref["results"][task].get(metric)


@pytest.mark.parametrize("bos, config, marked", [
    pytest.param("<|begin_of_text|>", {}, True, id="bos-from-post-processor"),
    pytest.param("<|begin_of_text|>", {"add_bos_token": False, "add_eos_token": True}, True, id="config-add-flags"),
    pytest.param(None, {"add_bos_token": True}, True, id="no-bos"),
    pytest.param("<|begin_of_text|>", {}, False, id="named-tokens-not-marked-special"),
])
def test_token_ids_match_transformers_tokenizer(tmp_path, bos, config, marked):
    """Special tokens added and skipped as transformers does (its tokenizer.json's post-processor, whatever the
    config's `add_bos_token` says; the config's BOS and EOS skipped even where the tokenizer.json does not mark
    them special), and the prefix token lm-eval's hf model takes."""
    save_tokenizer(tmp_path, bos, "<|end_of_text|>", **config)
    if not marked:
        data = json.loads((tmp_path / "tokenizer.json").read_text())
        for token in data["added_tokens"]:
            token["special"] = False
        (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path)
    codec = Codec(Pretrained(HFTokenizer(tmp_path / "tokenizer.json"), (1,), CONTEXT))
    assert codec.prefix_id == (reference.bos_token_id if bos else reference.eos_token_id)
    assert codec.eot_id == reference.eos_token_id
    for text in ("The cat sat on the", " mat", "", "<|begin_of_text|>A story", "Hello\n<|end_of_text|>world"):
        for add in (True, False):
            ids = codec.encode(text, add)
            assert ids == reference.encode(text, add_special_tokens=add)
            for skip in (True, False):
                assert codec.decode(ids, skip) == reference.decode(ids, skip_special_tokens=skip)


def test_greedy_flags_and_left_truncation_match_hf(models):
    """Continuations that are the model's own argmax (is_greedy true), one token off (false), and contexts longer
    than the model's context, scored by token ids on both sides."""
    from lm_eval.models.huggingface import HFLM
    hf, ours = models["llama"]
    reference = HFLM(pretrained=str(hf), dtype="float32", device="cpu", batch_size=4)
    lm = MlmLM(load_pretrained(ours, dtype="float32"), load_tokenizer(ours), batch_size=4, progress=False)
    rng = np.random.default_rng(0)
    requests = []
    for length in (3, 20, CONTEXT - 2, CONTEXT + 30):
        ids = rng.integers(2, 300, length).tolist()
        window = max(0, length + 3 - (CONTEXT + 1))  # where the scored window of context + continuation starts
        for _ in range(3):  # the next three greedy tokens within that window, from the Hugging Face model
            with torch.no_grad():
                ids.append(int(reference.model(torch.tensor([ids[window:]])).logits[0, -1].argmax()))
        requests += [(None, ids[:length], ids[length:]), (None, ids[:length], ids[length:-1] + [ids[-1] ^ 1])]
    expected = reference._loglikelihood_tokens(requests, disable_tqdm=True)
    actual = lm._loglikelihood_tokens(requests)
    assert [g for _, g in actual] == [g for _, g in expected] == [True, False] * 4
    assert max(abs(a - e) for (a, _), (e, _) in zip(actual, expected)) <= 1e-4


def test_cli_prints_table_and_writes_results_json(models, tmp_path, capsys):
    out = tmp_path / "results" / "tiny.json"
    assert main([str(models["llama"][1]), "--tasks", "tiny_choice,tiny_generate", "--include-path", str(TASKS),
                 "--limit", "2", "--batch-size", "2", "--dtype", "float32", "--output", str(out)]) == 0
    table = capsys.readouterr().out
    assert "|tiny_choice" in table and "|tiny_generate" in table and "acc" in table and "exact_match" in table
    results = json.loads(out.read_text())
    assert results["config"]["limit"] == 2
    assert {s["doc_id"] for s in results["samples"]["tiny_choice"]} == {0, 1}
    assert 0 <= results["results"]["tiny_choice"]["acc,none"] <= 1


def case(case_id, args, expected):
    return pytest.param(args, expected, id=case_id)


BAD = [
    # id, arguments after the model path (`{tasks}`: the test tasks' directory), substrings of the error line
    case("unknown-flag", ["--tasks", "tiny_choice", "--bogus"], ["--bogus"]),
    case("zero-limit", ["--tasks", "tiny_choice", "--limit", "0"], ["--limit", "'0'", "positive whole number"]),
    case("fractional-limit", ["--tasks", "tiny_choice", "--limit", "1.5"], ["--limit", "'1.5'"]),
    case("zero-batch", ["--tasks", "tiny_choice", "--batch-size", "0"], ["--batch-size", "'0'"]),
    case("no-tasks", ["--tasks", ","], ["--tasks", "task names"]),
    case("bad-dtype", ["--tasks", "tiny_choice", "--dtype", "int8"], ["--dtype", "'int8'"]),
    case("include-path", ["--tasks", "tiny_choice", "--include-path", "/nonexistent"],
         ["--include-path /nonexistent", "not a directory"]),
    case("unknown-task", ["--tasks", "tiny_choise", "--include-path", "{tasks}"],
         ["--tasks tiny_choise", "'tiny_choise' is not a task", "did you mean tiny_choice"]),
]


@pytest.mark.parametrize("args, expected", BAD)
def test_cli_rejects_bad_input_with_one_line(models, capsys, args, expected):
    args = [a.replace("{tasks}", str(TASKS)) for a in args]
    assert main([str(models["llama"][1]), *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("error: ") and captured.err.count("\n") == 1
    assert all(s in captured.err for s in expected), captured.err


def test_cli_missing_checkpoint_exits_2_without_traceback(tmp_path):
    result = subprocess.run([sys.executable, "-m", "mlm_jax.eval", str(tmp_path / "nothing"), "--tasks", "hellaswag"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith(f"error: {tmp_path / 'nothing'}: no checkpoint there")
    assert result.stderr.count("\n") == 1


SMALL = ["train.steps=4", "train.log_every=2", "train.eval_every=0", "train.global_batch_size=8", "train.seq_len=32",
         "data.max_bytes=2000000", "log.progress=never", "model.num_layers=2", "model.hidden_size=64",
         "model.ffn_size=128"]


def test_training_writes_task_metrics_to_metrics_jsonl(tmp_path):
    cfg = load_config(None, SMALL + [f"train.output_dir={tmp_path}", "eval.tasks=[tiny_choice,tiny_generate]",
                                     "eval.every=2", "eval.limit=2", "eval.batch_size=2",
                                     f"eval.include_path={TASKS}"])
    trainer = Trainer(cfg)
    trainer.fit()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in lines if any(k.startswith("eval/") for k in r)]
    assert [r["step"] for r in evals] == [2, 4]
    for r in evals:
        assert set(r) == {"step", "eval/tiny_choice/acc", "eval/tiny_choice/acc_norm", "eval/tiny_generate/exact_match"}
        assert all(0 <= r[k] <= 1 for k in r if k != "step")


@pytest.mark.parametrize("overrides, expected", [
    (["eval.tasks=[tiny_choise]", f"eval.include_path={TASKS}"],
     ["eval.tasks=['tiny_choise']", "did you mean tiny_choice"]),
    (["eval.tasks=tiny_choice,tiny_generate"], ["eval.tasks=['tiny_choice,tiny_generate']", "[hellaswag,arc_easy]"]),
    (["eval.tasks=[tiny_choice]", "eval.include_path=/nonexistent"], ["eval.include_path=/nonexistent"]),
    (["eval.tasks=[tiny_choice]", "eval.limit=0"], ["eval.limit=0", "must be positive"]),
])
def test_config_rejects_bad_eval_section(overrides, expected):
    with pytest.raises(ConfigError) as e:
        plan(load_config(None, overrides), jax.devices())
    assert all(s in str(e.value) for s in expected), str(e.value)
