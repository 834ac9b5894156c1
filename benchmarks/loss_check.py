"""Loss after N steps and held-out loss for one precision and seed: the numerics check behind fp8 vs bf16.

    python benchmarks/loss_check.py --config configs/llama-1b.yaml --precision fp8 --seed 0 [--steps 200]

Trains `--steps` steps of a schedule set for twice as many (so the learning rate is still high at the end, where
differences show), then evaluates `train.eval_batches=8` held-out batches, and prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mlm_jax import Trainer, load_config  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/loss_check.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="YAML file (configs/*.yaml)")
    p.add_argument("--precision", default="bf16", help="model.precision")
    p.add_argument("--seed", type=int, default=0, help="train.seed (initialisation and data order)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = p.parse_args(argv)
    out = f"/tmp/mlm_jax-loss-check-{args.precision}-{args.seed}"
    cfg = load_config(args.config, [f"model.precision={args.precision}", f"train.steps={2 * args.steps}",
                                    "optim.warmup_steps=20", "train.eval_every=0", "train.log_every=1",
                                    "log.progress=never", f"train.seed={args.seed}", f"train.output_dir={out}",
                                    "checkpoint.resume=none", "train.eval_batches=8", *args.overrides])
    trainer = Trainer(cfg)
    losses = [r["loss"] for r in trainer.fit(args.steps) if "loss" in r]
    print(json.dumps({"config": cfg.name, "precision": args.precision, "seed": args.seed, "steps": args.steps,
                      "loss": losses[-1], "mean_last_20": float(np.mean(losses[-20:])),
                      "eval_loss": trainer.evaluate()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
