"""`python -m mlm_jax.train [--config PATH] [--print-config] [multi-process flags] [section.key=value ...]`"""
from __future__ import annotations

import argparse
import sys
import traceback

from mlm_jax.checkpoint.state import CheckpointError
from mlm_jax.config import ConfigError, to_yaml
from mlm_jax.parallel import distributed
from mlm_jax.train.loop import Trainer, TrainingStopped
from mlm_jax.validation.config import load_config


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ConfigError(message)


def main(argv=None) -> int:
    parser = _Parser(prog="python -m mlm_jax.train", description="Train a decoder-only transformer.")
    parser.add_argument("--config", help="YAML file (configs/*.yaml); defaults to the tiny CPU model")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    multi = parser.add_argument_group("multi-process (not needed under srun or mpirun, which jax detects)")
    multi.add_argument("--coordinator", metavar="HOST:PORT", help="address of process 0's coordination service")
    multi.add_argument("--num-processes", type=int, metavar="N")
    multi.add_argument("--process-id", type=int, metavar="I", help="0..N-1; process 0 writes logs and metrics")
    multi.add_argument("--local-device-ids", metavar="IDS", help="local GPUs of this process, e.g. 0,1,2,3")
    multi.add_argument("--heartbeat-timeout", type=int, metavar="S",
                       help="seconds after which a silent process counts as dead and all stop (default 30)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    joined, code = False, 0
    try:
        args = parser.parse_intermixed_args(argv)  # flags may also follow the overrides
        cfg = load_config(args.config, args.overrides)
        if args.print_config:
            print(to_yaml(cfg), end="")
            return 0
        joined = distributed.initialize(args.coordinator, args.num_processes, args.process_id,
                                        args.local_device_ids, args.heartbeat_timeout)
        try:
            Trainer(cfg).fit()
        except (CheckpointError, TrainingStopped) as e:
            print(f"error: {e}", file=sys.stderr)
            code = 1
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        code = 2
    except BaseException:  # unexpected: in a multi-process run, the traceback and then out at once (see leave)
        if not joined:
            raise
        traceback.print_exc()
        code = 1
    if joined and code:
        distributed.leave(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
