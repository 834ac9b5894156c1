"""`python -m mlm_jax.train [--config PATH] [--print-config] [section.key=value ...]`"""
from __future__ import annotations

import argparse
import sys

from mlm_jax.config import ConfigError, load_config, to_yaml


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ConfigError(message)


def main(argv=None) -> int:
    parser = _Parser(prog="python -m mlm_jax.train", description="Train a decoder-only transformer.")
    parser.add_argument("--config", help="YAML file (configs/*.yaml); defaults to the tiny CPU model")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    try:
        args = parser.parse_args(argv)
        cfg = load_config(args.config, args.overrides)
        if args.print_config:
            print(to_yaml(cfg), end="")
            return 0
        from mlm_jax.train.checkpoint import CheckpointError  # jax is imported only when there is work to do
        from mlm_jax.train.loop import Trainer, TrainingStopped
        try:
            Trainer(cfg).fit()
        except (CheckpointError, TrainingStopped) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
