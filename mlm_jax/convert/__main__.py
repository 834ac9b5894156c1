"""`python -m mlm_jax.convert from-hf SRC DST` and `python -m mlm_jax.convert to-hf CKPT DST [--dtype ...]`"""
from __future__ import annotations

import argparse
import os
import re
import sys

from mlm_jax.config import ConfigError
from mlm_jax.convert import ConvertError
from mlm_jax.convert.hf import from_hf, read_source, to_hf

UNITS = {"": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9}


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ConvertError(message)


def _size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]B)?\s*", text, re.IGNORECASE)
    if not match or float(match[1]) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a size such as 2GB, 500MB or a byte count")
    return int(float(match[1]) * UNITS[(match[2] or "").upper()])


def main(argv=None) -> int:
    parser = _Parser(prog="python -m mlm_jax.convert",
                     description="Convert Llama/Mistral/Qwen2/Mixtral weights between Hugging Face and mlm_jax.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    src = commands.add_parser("from-hf", help="HF folder (config.json + *.safetensors) -> config.yaml + checkpoint")
    src.add_argument("src")
    src.add_argument("dst")
    dst = commands.add_parser("to-hf", help="mlm_jax checkpoint -> HF folder that transformers loads")
    dst.add_argument("checkpoint", help="a checkpoints dir (newest step), one step in it, or a dir holding one")
    dst.add_argument("dst")
    dst.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    dst.add_argument("--max-shard-size", type=_size, default="2GB", help="per safetensors file (default 2GB)")
    try:
        args = parser.parse_args(argv)
        if args.command == "from-hf":
            read_source(args.src)  # a bad source fails here, before anything is written
            cfg = from_hf(args.src, args.dst)
            config, checkpoints = os.path.join(args.dst, "config.yaml"), os.path.join(args.dst, "checkpoints")
            print(f"wrote {args.dst}: config.yaml and checkpoints/0 ({cfg.model.num_layers} layers, vocabulary "
                  f"{cfg.model.vocab_size}); fine-tune with: python -m mlm_jax.train --config {config} "
                  f"checkpoint.init_from={checkpoints}")
        else:
            config = to_hf(args.checkpoint, args.dst, args.dtype, args.max_shard_size)
            print(f"wrote {args.dst}: config.json and {args.dtype} safetensors ({config['architectures'][0]})")
    except (ConvertError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
