"""The evaluation's one error type, below every module of `mlm_jax.eval` that raises it."""


class EvalError(ValueError):
    """An evaluation that cannot run as asked (unknown task, lm-eval missing); the message is one line."""
