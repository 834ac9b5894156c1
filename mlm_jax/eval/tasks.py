"""lm-eval's tasks and its evaluator: whether it is installed, which task names it knows, a run of
`simple_evaluate` over an mlm_jax model, and its results as flat metrics for metrics.jsonl."""
from __future__ import annotations

import os

from mlm_jax.data.tokenizer import load_tokenizer
from mlm_jax.eval.errors import EvalError
from mlm_jax.infer.pretrained import Pretrained
from mlm_jax.validation.tasks import missing, task_manager, unknown_task


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
    `infer.pretrained.Pretrained`) on `tasks`: its results dict. `limit` caps the documents per task;
    `bootstrap_iters=0` skips the standard errors that need resampling."""
    check(tasks, include_path)
    from lm_eval import simple_evaluate

    from mlm_jax.eval.lm import MlmLM  # lm-eval's `LM` subclass: imports lm-eval, an optional backend
    lm = MlmLM(model, pretrained, batch_size=batch_size, progress=progress)
    return simple_evaluate(model=lm, tasks=list(tasks), limit=limit, task_manager=task_manager(include_path),
                           log_samples=log_samples, bootstrap_iters=bootstrap_iters)


def evaluate_training(model, cfg) -> dict[str, float]:
    """`cfg.eval.tasks` on a model in training (`cfg`, the run's `Config`), with the run's tokenizer (whose end of
    document ends generations) and `train.seq_len` as the context, without standard errors: flat metrics."""
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
