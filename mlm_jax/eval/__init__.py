"""Evaluation through lm-evaluation-harness: `python -m mlm_jax.eval PATH --tasks ...`, `evaluate(model, ...)`, and
`MlmLM`, the harness's `LM` over an mlm_jax model (in `lm.py`, so that this package imports without lm-eval and
the CLI can say in one line that it is missing)."""

__all__ = ["EvalError", "MlmLM", "evaluate", "flat_metrics"]


class EvalError(ValueError):
    """An evaluation that cannot run as asked (unknown task, lm-eval missing); the message is one line."""


def __getattr__(name):
    if name == "MlmLM":
        from mlm_jax.eval.lm import MlmLM
        return MlmLM
    if name in ("evaluate", "flat_metrics"):
        from mlm_jax.eval import tasks
        return getattr(tasks, name)
    raise AttributeError(name)
