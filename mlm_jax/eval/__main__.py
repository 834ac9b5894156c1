"""`python -m mlm_jax.eval PATH --tasks T1,T2 [--tokenizer FILE] [--include-path DIR] [--limit N] [--batch-size B]
[--dtype D] [--output FILE]`: lm-eval's results table for a converted model or a run's checkpoint."""
from __future__ import annotations

import argparse
import json
import os
import sys

from mlm_jax.checkpoint.weights import ConvertError
from mlm_jax.config import DTYPES, ConfigError
from mlm_jax.eval.errors import EvalError
from mlm_jax.eval.tasks import evaluate, missing, unknown_task
from mlm_jax.infer.pretrained import load_pretrained, load_tokenizer


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise EvalError(message)


def _positive(text: str) -> int:
    if not text.strip().isdigit() or int(text) == 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive whole number")
    return int(text)


def _task_list(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r}: expected task names separated by commas")
    return names


def main(argv=None) -> int:
    parser = _Parser(prog="python -m mlm_jax.eval",
                     description="Evaluate a converted model or a run's checkpoint with lm-evaluation-harness.")
    parser.add_argument("path", help="a converted dir, a run's output dir or a checkpoints dir")
    parser.add_argument("--tasks", type=_task_list, required=True, help="lm-eval task names, comma-separated")
    parser.add_argument("--tokenizer", help="a tokenizer.json, or byte (default: the checkpoint's)")
    parser.add_argument("--include-path", help="a directory of further task YAMLs")
    parser.add_argument("--limit", type=_positive, help="at most this many documents per task")
    parser.add_argument("--batch-size", type=_positive, default=8, help="sequences per forward pass (default 8)")
    parser.add_argument("--dtype", choices=DTYPES, help="compute dtype (default: the checkpoint's)")
    parser.add_argument("--output", help="write lm-eval's results (with every sample) to this JSON file")
    try:
        args = parser.parse_args(argv)
        pretrained = load_tokenizer(args.path, args.tokenizer)
        if reason := missing():
            raise EvalError(reason)
        if args.include_path is not None and not os.path.isdir(args.include_path):
            raise EvalError(f"--include-path {args.include_path}: not a directory")
        if reason := unknown_task(args.tasks, args.include_path):
            raise EvalError(f"--tasks {','.join(args.tasks)}: {reason}")
        model = load_pretrained(args.path, dtype=args.dtype)
        results = evaluate(model, pretrained, args.tasks, include_path=args.include_path, limit=args.limit,
                           batch_size=args.batch_size, log_samples=args.output is not None)
        from lm_eval.utils import handle_non_serializable, make_table
        if args.output is not None:
            try:
                os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
                with open(args.output, "w") as f:
                    json.dump(results, f, indent=2, default=handle_non_serializable)
            except OSError as e:
                raise EvalError(f"--output {args.output}: cannot write ({e.strerror})") from None
        print(make_table(results))
        if results.get("groups"):
            print(make_table(results, "groups"))
    except (ConfigError, ConvertError, EvalError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
