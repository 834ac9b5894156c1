"""Evaluation through lm-evaluation-harness: `python -m mlm_jax.eval PATH --tasks ...`, `evaluate(model, ...)`, and
`MlmLM`, the harness's `LM` over an mlm_jax model (in `lm.py`, loaded on first use: it imports lm-eval, an optional
backend, so that this package imports without it and the CLI can say in one line that it is missing)."""
from mlm_jax.eval.errors import EvalError
from mlm_jax.eval.tasks import evaluate, flat_metrics

__all__ = ["EvalError", "MlmLM", "evaluate", "flat_metrics"]


def __getattr__(name):
    if name == "MlmLM":
        from mlm_jax.eval.lm import MlmLM
        return MlmLM
    raise AttributeError(name)
