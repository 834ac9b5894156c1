"""Hugging Face safetensors folders <-> mlm_jax weights-only checkpoints, one tensor or one shard at a time.

Import reads tensor by tensor into preallocated stacked arrays, and export writes one bounded shard at a time, so
either way the peak is about one copy of the model (plus one shard).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from safetensors import safe_open
from safetensors.numpy import save_file

from mlm_jax.config import Config, ModelConfig
from mlm_jax.validation.config import check_config
from mlm_jax.checkpoint import weights as store
from mlm_jax.convert import ConvertError, families
from mlm_jax.convert.format import (CARRIED, IGNORED_SUFFIX, Entry, hf_shape, hf_tensors, read_config, tensor_files,
                                    to_ours, to_theirs)
from mlm_jax.model.transformer import model_spec

# The tokenizer and what configures it (special tokens, chat template, generation defaults), kept as they are
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
EXPORT_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(jnp.bfloat16)}


class Source(NamedTuple):
    model: ModelConfig
    carried: dict  # CARRIED keys present in config.json
    files: dict[str, str]  # tensor name -> safetensors file
    architecture: str


def read_source(src: str) -> Source:
    """An HF folder: `config.json` plus `*.safetensors`, one file or shards listed in the index."""
    hf = read_config(src)
    model = families.model_config(hf)
    files = tensor_files(src)
    carried = {k: hf[k] for k in CARRIED if hf.get(k) is not None}
    return Source(model, carried, files, hf["architectures"][0])


def _require_empty(dst: str) -> None:
    if os.path.exists(dst) and (not os.path.isdir(dst) or os.listdir(dst)):
        raise ConvertError(f"{dst}: exists and is not an empty directory")


def from_hf(src: str, dst: str) -> Config:
    """Writes `dst/config.yaml` and the weights-only checkpoint `dst/checkpoints/0`; returns the config."""
    source = read_source(src)
    _require_empty(dst)
    cfg = Config(name=os.path.basename(os.path.normpath(dst)), model=source.model)
    check_config(cfg)
    m = cfg.model
    dtype = np.dtype(m.param_dtype)
    files = dict(source.files)
    params: dict = {}
    with contextlib.ExitStack() as stack:
        handles = {path: stack.enter_context(safe_open(path, framework="numpy")) for path in set(files.values())}

        def read(e: Entry, shape: tuple[int, ...], index: tuple[int, ...]) -> np.ndarray:
            name = e.hf_name(index)
            if name not in files:
                raise ConvertError(f"{src}: tensor {name} is missing")
            x = handles[files.pop(name)].get_tensor(name)
            if x.shape != hf_shape(e, shape):
                raise ConvertError(f"{src}: tensor {name} has shape {x.shape}, config.json implies "
                                   f"{hf_shape(e, shape)}")
            return to_ours(e, x, shape)

        for e, shape in families.for_model(m).layout(m, model_spec(m).shapes):
            value = np.empty(shape, dtype)
            for index in np.ndindex(shape[:e.stacked]):  # one HF tensor per (layer, expert) of a stacked parameter
                value[index] = read(e, shape[e.stacked:], index)
            node = params
            for key in e.path[:-1]:
                node = node.setdefault(key, {})
            node[e.path[-1]] = value
    if m.tie_embeddings:
        files.pop("lm_head.weight", None)  # some tied checkpoints store the head as well; it is the embedding
    family = families.for_model(m)
    leftover = [n for n in files if not n.endswith(IGNORED_SUFFIX)
                and not (hasattr(family, "ignored") and family.ignored(m, n))]
    if leftover:
        raise ConvertError(f"{src}: tensor {leftover[0]} has no mlm_jax counterpart"
                           f"{f' (and {len(leftover) - 1} more)' if len(leftover) > 1 else ''}")
    store.save_weights(os.path.join(dst, "checkpoints"), params, {"step": 0, "config": cfg.to_dict(),
                                                                   "hf": source.carried})
    with open(os.path.join(dst, "config.yaml"), "w") as f:
        f.write(f"# converted from {os.path.abspath(src)} ({source.architecture})\n")
        f.write(yaml.safe_dump({"name": cfg.name, "model": dataclasses.asdict(m)}, sort_keys=False))
    for name in TOKENIZER_FILES:  # generation and evaluation read the tokenizer from beside the checkpoint
        if os.path.isfile(os.path.join(src, name)):
            shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
    return cfg


def _shards(sizes: list[int], max_bytes: int) -> list[range]:
    """Consecutive tensors grouped greedily into shards of at most `max_bytes` (a larger tensor is alone)."""
    shards, start, total = [], 0, 0
    for i, size in enumerate(sizes):
        if i > start and total + size > max_bytes:
            shards.append(range(start, i))
            start, total = i, 0
        total += size
    return shards + [range(start, len(sizes))]


def to_hf(path: str, dst: str, dtype: str = "float32", max_shard_bytes: int = 2 * 10**9) -> dict:
    """Writes `config.json` and safetensors shards (with an index when more than one); returns the config."""
    c = store.open_checkpoint(path)
    out_dtype = EXPORT_DTYPES[dtype]
    m = c.model
    carried = {"max_position_embeddings": c.meta["config"]["train"]["seq_len"], **c.meta.get("hf", {})}
    config = families.for_model(m).hf_config(m, dtype, carried)
    _require_empty(dst)
    spec = model_spec(m)
    try:
        device = jax.devices("cpu")[0]
    except RuntimeError:  # no host platform configured
        device = jax.devices()[0]
    params = store.restore_weights(c, spec.shapes, device)
    tensors = hf_tensors(families.for_model(m).layout(m, spec.shapes))
    sizes = [math.prod(hf_shape(e, shape)) * out_dtype.itemsize for _, e, _, shape in tensors]
    shards = _shards(sizes, max_shard_bytes)
    os.makedirs(dst, exist_ok=True)
    weight_map = {}
    for k, shard in enumerate(shards):
        file = "model.safetensors" if len(shards) == 1 else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        out = {}
        for name, e, index, _ in (tensors[j] for j in shard):
            value = np.asarray(_get(params, e.path))[index]
            out[name] = np.ascontiguousarray(to_theirs(e, value), dtype=out_dtype)
            weight_map[name] = file
        save_file(out, os.path.join(dst, file), metadata={"format": "pt"})
    if len(shards) > 1:
        with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return config


def _get(tree: dict, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree
