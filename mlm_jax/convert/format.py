"""The Hugging Face format every family shares, so a family module holds only its names and config keys: tensor
entries and their layouts, our layer stacks, HF file order, RoPE keys, reading a source folder.

Python and numpy. HF stores a Linear weight as (out, in); our kernels keep heads as their own dims (q: D,N,H;
o: N,H,D).
"""
from __future__ import annotations

import glob
import json
import math
import os
import typing
from typing import NamedTuple

import numpy as np
from safetensors import safe_open

from mlm_jax.config import ModelConfig, RopeScalingConfig
from mlm_jax.ops.fp8 import HISTORY
from mlm_jax.convert import ConvertError

CARRIED = ("bos_token_id", "eos_token_id", "max_position_embeddings")  # kept in the checkpoint for the way back
IGNORED_SUFFIX = "rotary_emb.inv_freq"  # a buffer some old checkpoints saved; recomputed by every loader


class Entry(NamedTuple):
    path: tuple[str, ...]  # our parameter; `blocks/...` ones are stacked along a leading layers dim
    name: str  # HF tensor name; per-layer names hold `{i}`, per-expert ones `{j}` too
    kind: str = "same"  # same: one layout; flat: HF flattens our dims (biases); linear: HF's (out, in) weight
    in_dims: int = 1  # linear: how many leading dims of our kernel are its input
    layers: tuple[int, ...] = ()  # the HF layer of each index of our stack (`layout` fills it in)
    rope_tail: int = 0  # the last dims of each output head are RoPE pairs HF interleaves (x0 x1 x2 x3 ...)

    @property
    def layered(self) -> bool:
        return "{i}" in self.name

    @property
    def stacked(self) -> int:
        """How many leading dims of our parameter HF splits into separate tensors: layers, then experts."""
        return ("{i}" in self.name) + ("{j}" in self.name)

    def hf_name(self, index: tuple[int, ...] = ()) -> str:
        """The HF tensor at `index` (index in our layer stack, expert) of our stacked parameter."""
        return self.name.format(**dict(zip("ij", (self.layers[index[0]], *index[1:]) if index else ())))


def per_layer(path: str, name: str, *rest) -> Entry:
    """The entry of a `blocks/...` parameter, one HF tensor per layer."""
    return Entry(("blocks", *path.split("/")), f"model.layers.{{i}}.{name}", *rest)


def hf_shape(e: Entry, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The HF tensor's shape for our (per-layer) parameter shape."""
    if e.kind == "linear":
        return math.prod(shape[e.in_dims:]), math.prod(shape[:e.in_dims])
    return (math.prod(shape),) if e.kind == "flat" else tuple(shape)


def _deinterleaved(n: int, tail: int) -> np.ndarray:
    """Indices taking a last dim of n whose final `tail` entries are interleaved pairs (x0 x1 x2 x3 ...) to the
    rotate-half layout (x0 x2 ... x1 x3 ...) our RoPE pairs as (i, i + tail/2)."""
    return np.concatenate([np.arange(n - tail), n - tail + np.arange(tail).reshape(-1, 2).T.reshape(-1)])


def to_ours(e: Entry, x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    x = x.T.reshape(shape) if e.kind == "linear" else x.reshape(shape)
    return x[..., _deinterleaved(shape[-1], e.rope_tail)] if e.rope_tail else x


def to_theirs(e: Entry, x: np.ndarray) -> np.ndarray:
    """The way back of `to_ours`: our (per-layer) parameter as the HF tensor."""
    if e.rope_tail:
        x = x[..., np.argsort(_deinterleaved(x.shape[-1], e.rope_tail))]
    if e.kind == "linear":
        return x.reshape(math.prod(x.shape[:e.in_dims]), -1).T
    return x.reshape(-1) if e.kind == "flat" else x


def stacks(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our layer stacks and the model layers each holds, in order: an MoE model's MoE layers in `blocks` and its
    dense ones in `dense_blocks` (`model.transformer`), a dense model's every layer in `blocks`."""
    moe = tuple(i for i in range(m.num_layers) if not m.moe.enabled or m.moe.is_moe_layer(i))
    return {"blocks": moe, "dense_blocks": tuple(i for i in range(m.num_layers) if i not in moe)}


def layout(m: ModelConfig, shapes: dict, entries: tuple[Entry, ...],
           family: str) -> list[tuple[Entry, tuple[int, ...]]]:
    """Our parameters (a nested dict of shaped leaves) in HF order, with their full shapes; a per-layer entry
    pairs with the parameter of each stack that has it. fp8 delayed-scaling histories are training state with no
    Hugging Face counterpart, left out."""
    flat = {path: shape for path, shape in _leaves(shapes) if path[-1] != HISTORY}
    out = []
    for e in entries:
        for stack, layers in (stacks(m).items() if e.layered else [(None, ())]):
            path = e.path if stack is None else (stack, *e.path[1:])
            if path in flat:
                out.append((e._replace(path=path, layers=layers), flat.pop(path)))
    if flat:
        raise ConvertError(f"parameter {'/'.join(next(iter(flat)))} has no Hugging Face {family} counterpart")
    return out


def hf_tensors(entries: list[tuple[Entry, tuple[int, ...]]]) -> list[tuple[str, Entry, tuple[int, ...], tuple]]:
    """(name, entry, index, shape) of every HF tensor in file order: embedding, layer by layer (entry by entry,
    expert by expert within an entry), final norm and head. `index` picks the tensor out of our stacked
    parameter: (), (stack index,) or (stack index, expert)."""
    before, layered, after = [], [], []
    for order, (e, shape) in enumerate(entries):
        if not e.layered:
            (after if layered else before).append((e.name, e, (), shape))
            continue
        for i in range(shape[0]):
            for j in np.ndindex(shape[1:e.stacked]):
                layered.append(((e.layers[i], order, j), (e.hf_name((i, *j)), e, (i, *j), shape[e.stacked:])))
    return before + [t for _, t in sorted(layered, key=lambda x: x[0])] + after


def _leaves(node: dict, prefix: tuple[str, ...] = ()):
    for k, v in node.items():
        if isinstance(v, dict):
            yield from _leaves(v, (*prefix, k))
        else:
            yield (*prefix, k), tuple(v.shape)


ROPE_KEYS = {"linear": ("factor",),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
             "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
                      "mscale_all_dim", "attention_factor", "truncate")}


def rope(hf: dict) -> dict:
    """`rope_theta`, `rope_scaling` and `partial_rotary_factor` as our model fields. transformers 4 writes
    `rope_theta` and `rope_scaling`; 5 writes both into `rope_parameters`."""
    params = hf.get("rope_parameters") or {}
    scaling = dict(hf.get("rope_scaling") or params)
    kind = scaling.pop("rope_type", scaling.pop("type", "default"))
    theta = float(hf.get("rope_theta") or scaling.pop("rope_theta", None) or 10000.0)
    scaling.pop("rope_theta", None)
    fraction = float(scaling.pop("partial_rotary_factor", None) or hf.get("partial_rotary_factor") or 1.0)
    if kind not in ("default", *ROPE_KEYS):
        raise ConvertError(f"rope_scaling {kind!r} is not supported (default, linear, llama3, yarn)")
    if kind in ("llama3", "yarn") and scaling.get("original_max_position_embeddings") is None:
        scaling["original_max_position_embeddings"] = hf.get("original_max_position_embeddings") or hf.get(
            "max_position_embeddings")
    if kind == "yarn" and scaling.get("factor") is None:  # DeepSeek-V3 style: the ratio of the two contexts
        scaling["factor"] = hf["max_position_embeddings"] / scaling["original_max_position_embeddings"]
    unknown = sorted(k for k, v in scaling.items() if k not in ROPE_KEYS.get(kind, ()) and v is not None)
    if unknown:
        raise ConvertError(f"rope_scaling field {unknown[0]!r} ({kind}) is not supported")
    hints = typing.get_type_hints(RopeScalingConfig)
    values = {k: float(v) if float in typing.get_args(hints[k]) + (hints[k],) else v for k, v in scaling.items()
              if v is not None and kind != "default"}
    return dict(rope_theta=theta, partial_rotary_factor=fraction,
                rope_scaling=RopeScalingConfig(rope_type=kind, **values))


def hf_rope(m: ModelConfig) -> dict:
    """Our RoPE fields as `config.json` keys (the way back of `rope`)."""
    r = m.rope_scaling
    scaling = None
    if r.rope_type != "default":
        scaling = {"rope_type": r.rope_type, **{k: getattr(r, k) for k in ROPE_KEYS[r.rope_type]
                                                 if getattr(r, k) is not None}}
    out = {"rope_theta": m.rope_theta, "rope_scaling": scaling}
    return {**out, "partial_rotary_factor": m.partial_rotary_factor} if m.partial_rotary_factor != 1 else out


def read_config(src: str) -> dict:
    """An HF folder's `config.json`."""
    config_path = os.path.join(src, "config.json")
    if not os.path.isdir(src):
        raise ConvertError(f"{src}: no such directory")
    try:
        with open(config_path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise ConvertError(f"{config_path}: no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ConvertError(f"{config_path}: not valid JSON") from None


def tensor_files(src: str) -> dict[str, str]:
    """Tensor name -> safetensors file of an HF folder: one file or shards listed in the index."""
    index_path = os.path.join(src, "model.safetensors.index.json")
    if os.path.exists(index_path):
        with open(index_path) as f:
            files = {name: os.path.join(src, file) for name, file in json.load(f)["weight_map"].items()}
        for path in sorted(set(files.values())):
            if not os.path.exists(path):
                raise ConvertError(f"{path}: no such file (listed in {index_path})")
        return files
    paths = sorted(glob.glob(os.path.join(src, "*.safetensors")))
    if not paths:
        raise ConvertError(f"{src}: no *.safetensors files (re-save the model with safe_serialization=True)")
    files = {}
    for path in paths:
        with safe_open(path, framework="numpy") as f:
            files.update(dict.fromkeys(f.keys(), path))
    return files
