"""lm-evaluation-harness as the checks see it: whether it is installed, and which task names it knows.

lm-eval is an optional backend, imported only when asked about (`pip install 'mlm_jax[eval]'`).
"""
from __future__ import annotations

import difflib
import functools
import os

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
