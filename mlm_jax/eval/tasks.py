"""lm-eval's tasks and its evaluator: whether it is installed, which task names it knows, a run of
`simple_evaluate` over an mlm_jax model, and its results as flat metrics for metrics.jsonl."""
from __future__ import annotations

import difflib
import functools
import os

from mlm_jax.eval import EvalError

INSTALL = "pip install 'mlm_jax[eval]'"


def missing() -> str | None:
    """Why lm-eval cannot run here, or None."""
    try:
        import lm_eval  # noqa: F401
    except ImportError as e:
        return f"lm-eval does not import ({e}): {INSTALL}"
    return None


@functools.cache
def task_manager(include_path: str | None = None):
    """lm-eval's index of its own tasks and those under `include_path`, built once per process (it reads
    thousands of YAML files)."""
    from lm_eval.tasks import TaskManager
    return TaskManager(include_path=include_path)


def unknown_task(names, include_path: str | None = None) -> str | None:
    """Says which of `names` is neither a task, group or tag that lm-eval knows (with those of the directory
    `include_path`) nor a task YAML file, if one is; lm-eval must be installed."""
    known = task_manager(include_path).all_tasks
    for name in names:
        if name not in known and not (name.endswith((".yaml", ".yml")) and os.path.isfile(name)):
            close = difflib.get_close_matches(name, known, n=3)
            hint = f"did you mean {', '.join(close)}?" if close else "python -m lm_eval ls tasks lists them"
            return f"{name!r} is not a task lm-eval knows ({hint})"
    return None


def check(names, include_path: str | None = None) -> None:
    """Raises `EvalError` unless lm-eval is installed, `include_path` is a directory and it knows `names`."""
    if reason := missing():
        raise EvalError(reason)
    if include_path is not None and not os.path.isdir(include_path):
        raise EvalError(f"include path {include_path}: not a directory")
    if reason := unknown_task(names, include_path):
        raise EvalError(reason)


def evaluate(model, pretrained, tasks, *, include_path: str | None = None, limit: int | None = None,
             batch_size: int = 8, log_samples: bool = False, progress: bool = True,
             bootstrap_iters: int = 100000) -> dict:
    """lm-eval's `simple_evaluate` of `model` (with the tokenizer, EOS and context of `pretrained`, a
    `convert.pretrained.Pretrained`) on `tasks`: its results dict. `limit` caps the documents per task;
    `bootstrap_iters=0` skips the standard errors that need resampling."""
    check(tasks, include_path)
    from lm_eval import simple_evaluate
    from mlm_jax.eval.lm import MlmLM
    lm = MlmLM(model, pretrained, batch_size=batch_size, progress=progress)
    return simple_evaluate(model=lm, tasks=list(tasks), limit=limit, task_manager=task_manager(include_path),
                           log_samples=log_samples, bootstrap_iters=bootstrap_iters)


def evaluate_training(model, cfg) -> dict[str, float]:
    """`cfg.eval.tasks` on a model in training (`cfg`, the run's `Config`), with the run's tokenizer (whose end of
    document ends generations) and `train.seq_len` as the context, without standard errors: flat metrics."""
    from mlm_jax.convert.pretrained import Pretrained
    from mlm_jax.data.tokenizer import load_tokenizer
    tok = load_tokenizer(cfg.data.tokenizer)
    e = cfg.eval
    results = evaluate(model, Pretrained(tok, (tok.eod_id,), cfg.train.seq_len), e.tasks, include_path=e.include_path,
                       limit=e.limit, batch_size=e.batch_size, progress=False, bootstrap_iters=0)
    return flat_metrics(results)


def flat_metrics(results: dict) -> dict[str, float]:
    """`eval/<task>/<metric>` for each number lm-eval reports as `metric,filter` in `results["results"]`; a filter
    other than `none` is kept after a slash (`eval/gsm8k/exact_match/strict-match`)."""
    flat = {}
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            name, comma, filtered = key.partition(",")
            if comma and isinstance(value, (int, float)) and not isinstance(value, bool):
                flat[f"eval/{task}/{name}" + (f"/{filtered}" if filtered != "none" else "")] = float(value)
    return flat
