"""The Llama family (Llama, Mistral, Qwen2) in Hugging Face terms: config keys, tensor names and layouts.

Pure Python and numpy, so a bad source folder is reported before jax loads. Shapes: D model, N query heads,
K kv heads, H head dim, F ffn, V vocabulary, L layers. HF stores a Linear weight as (out, in); our kernels keep
heads as their own dims (q: D,N,H; o: N,H,D). Both use rotate-half RoPE, so q/k need no permutation.
"""
from __future__ import annotations

import glob
import json
import math
import os
from typing import NamedTuple

import numpy as np
from safetensors import safe_open

from mlm_jax.config import ModelConfig
from mlm_jax.convert import ConvertError

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
CARRIED = ("bos_token_id", "eos_token_id", "max_position_embeddings")  # kept in the checkpoint for the way back
IGNORED_SUFFIX = "rotary_emb.inv_freq"  # a buffer some old checkpoints saved; recomputed by every loader


class Entry(NamedTuple):
    path: tuple[str, ...]  # our parameter; `blocks/...` ones are stacked along a leading layers dim
    name: str  # HF tensor name; per-layer names hold `{i}`, per-expert ones `{j}` too
    kind: str = "same"  # same: one layout; flat: HF flattens our dims (biases); linear: HF's (out, in) weight
    in_dims: int = 1  # linear: how many leading dims of our kernel are its input

    @property
    def layered(self) -> bool:
        return "{i}" in self.name

    @property
    def stacked(self) -> int:
        """How many leading dims of our parameter HF splits into separate tensors: layers, then experts."""
        return ("{i}" in self.name) + ("{j}" in self.name)

    def hf_name(self, index: tuple[int, ...] = ()) -> str:
        """The HF tensor at `index` (layer, expert) of our stacked parameter."""
        return self.name.format(**dict(zip("ij", index)))


def _layer(path: str, name: str, *rest) -> Entry:
    return Entry(("blocks", *path.split("/")), f"model.layers.{{i}}.{name}", *rest)


ENTRIES = (
    Entry(("embed", "embedding"), "model.embed_tokens.weight"),
    _layer("attn_norm/scale", "input_layernorm.weight"),
    _layer("attn/q/kernel", "self_attn.q_proj.weight", "linear"),
    _layer("attn/k/kernel", "self_attn.k_proj.weight", "linear"),
    _layer("attn/v/kernel", "self_attn.v_proj.weight", "linear"),
    _layer("attn/q/bias", "self_attn.q_proj.bias", "flat"),
    _layer("attn/k/bias", "self_attn.k_proj.bias", "flat"),
    _layer("attn/v/bias", "self_attn.v_proj.bias", "flat"),
    _layer("attn/o/kernel", "self_attn.o_proj.weight", "linear", 2),
    _layer("mlp_norm/scale", "post_attention_layernorm.weight"),
    _layer("mlp/gate/kernel", "mlp.gate_proj.weight", "linear"),
    _layer("mlp/up/kernel", "mlp.up_proj.weight", "linear"),
    _layer("mlp/down/kernel", "mlp.down_proj.weight", "linear"),
    Entry(("final_norm", "scale"), "model.norm.weight"),
    Entry(("head", "kernel"), "lm_head.weight", "linear"),
)


def hf_shape(e: Entry, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The HF tensor's shape for our (per-layer) parameter shape."""
    if e.kind == "linear":
        return math.prod(shape[e.in_dims:]), math.prod(shape[:e.in_dims])
    return (math.prod(shape),) if e.kind == "flat" else tuple(shape)


def to_ours(e: Entry, x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    return x.T.reshape(shape) if e.kind == "linear" else x.reshape(shape)


def to_hf(e: Entry, x: np.ndarray) -> np.ndarray:
    if e.kind == "linear":
        return x.reshape(math.prod(x.shape[:e.in_dims]), -1).T
    return x.reshape(-1) if e.kind == "flat" else x


def layout(shapes: dict, entries: tuple[Entry, ...] = ENTRIES,
           family: str = "Llama") -> list[tuple[Entry, tuple[int, ...]]]:
    """Our parameters (a nested dict of shaped leaves) in HF order, with their full shapes."""
    flat = dict(_leaves(shapes))
    out = [(e, flat.pop(e.path)) for e in entries if e.path in flat]
    if flat:
        raise ConvertError(f"parameter {'/'.join(next(iter(flat)))} has no Hugging Face {family} counterpart")
    return out


def hf_tensors(entries: list[tuple[Entry, tuple[int, ...]]]) -> list[tuple[str, Entry, tuple[int, ...], tuple]]:
    """(name, entry, index, shape) of every HF tensor in file order: embedding, layer by layer (expert by expert
    within an entry), head. `index` picks the tensor out of our stacked parameter: (), (layer,) or (layer, expert)."""
    layered = [(e, shape) for e, shape in entries if e.layered]
    out = []
    for e, shape in entries:
        if not e.layered:
            out.append((e.name, e, (), shape))
        elif e is layered[0][0]:
            out += [(f.hf_name((i, *j)), f, (i, *j), s[f.stacked:])
                    for i in range(shape[0]) for f, s in layered for j in np.ndindex(s[1:f.stacked])]
    return out


def _leaves(node: dict, prefix: tuple[str, ...] = ()):
    for k, v in node.items():
        if isinstance(v, dict):
            yield from _leaves(v, (*prefix, k))
        else:
            yield (*prefix, k), tuple(v.shape)


def model_config(hf: dict) -> ModelConfig:
    """Our model section for an HF `config.json`; anything we would compute differently is refused."""
    arch = (hf.get("architectures") or [None])[0]
    if arch == "MixtralForCausalLM":  # Mistral's attention with a mixture-of-experts FFN
        from mlm_jax.convert import mixtral  # it builds on this module
        return mixtral.model_config(hf)
    if arch not in ARCHITECTURES:
        raise ConvertError(f"architecture {arch!r} is not supported "
                           f"(expected one of {', '.join(ARCHITECTURES)}, MixtralForCausalLM)")
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if hf.get(k) is None]
    if missing:
        raise ConvertError(f"config.json lacks {', '.join(missing)}")
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ConvertError(f"hidden_act={hf['hidden_act']!r} is not supported (only silu, i.e. SwiGLU)")
    theta = _rope_theta(hf)
    window, positions = hf.get("sliding_window"), hf.get("max_position_embeddings")
    if arch == "MistralForCausalLM" and window is not None and (positions is None or window < positions):
        raise ConvertError(f"sliding_window={window} is in use (max_position_embeddings={positions}); "
                           f"mlm_jax attends to the whole context")
    if arch == "Qwen2ForCausalLM" and hf.get("use_sliding_window"):
        raise ConvertError("use_sliding_window=true is not supported; mlm_jax attends to the whole context")
    if arch != "Qwen2ForCausalLM" and hf.get("attention_bias"):
        raise ConvertError("attention_bias=true is not supported (it adds an o_proj bias, which mlm_jax lacks)")
    if hf.get("mlp_bias"):
        raise ConvertError("mlp_bias=true is not supported")
    heads, dim = hf["num_attention_heads"], hf["hidden_size"]
    head_dim = hf.get("head_dim") or dim // heads
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=dim, num_layers=hf["num_hidden_layers"], num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads, head_dim=None if head_dim * heads == dim else head_dim,
        ffn_size=hf["intermediate_size"], norm="rmsnorm", norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        activation="swiglu", rope_theta=theta, tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=arch == "Qwen2ForCausalLM")


def _rope_theta(hf: dict) -> float:
    """transformers 4 writes `rope_theta` and `rope_scaling`; 5 writes both into `rope_parameters`."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind != "default":
        raise ConvertError(f"rope_scaling {kind!r} is not supported (plain RoPE only)")
    return float(hf.get("rope_theta") or params.get("rope_theta") or 10000.0)


def hf_config(m: ModelConfig, dtype: str, carried: dict) -> dict:
    """`config.json` for `m`: LlamaForCausalLM, or Qwen2ForCausalLM when q/k/v have biases."""
    for unsupported, what in ((m.norm != "rmsnorm", f"model.norm={m.norm}"),
                              (m.activation != "swiglu", f"model.activation={m.activation}"),
                              (m.qk_norm, "model.qk_norm=true")):
        if unsupported:
            raise ConvertError(f"{what} cannot be exported (Llama/Qwen2 use RMSNorm, SwiGLU, no QK-norm)")
    qwen = m.qkv_bias
    config = {
        "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
        "model_type": "qwen2" if qwen else "llama",
        "vocab_size": m.vocab_size, "hidden_size": m.hidden_size, "intermediate_size": m.ffn_size,
        "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.kv_heads, "head_dim": m.dim_per_head, "hidden_act": "silu",
        "rms_norm_eps": m.norm_eps, "rope_theta": m.rope_theta, "rope_scaling": None,
        "tie_word_embeddings": m.tie_embeddings, "torch_dtype": dtype,
        **({"use_sliding_window": False} if qwen else {"attention_bias": False, "mlp_bias": False}),
    }
    return {**config, **carried}


class Source(NamedTuple):
    model: ModelConfig
    carried: dict  # CARRIED keys present in config.json
    files: dict[str, str]  # tensor name -> safetensors file
    architecture: str


def read_source(src: str) -> Source:
    """An HF folder: `config.json` plus `*.safetensors`, one file or shards listed in the index."""
    config_path = os.path.join(src, "config.json")
    if not os.path.isdir(src):
        raise ConvertError(f"{src}: no such directory")
    try:
        with open(config_path) as f:
            hf = json.load(f)
    except FileNotFoundError:
        raise ConvertError(f"{config_path}: no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ConvertError(f"{config_path}: not valid JSON") from None
    model = model_config(hf)
    index_path = os.path.join(src, "model.safetensors.index.json")
    if os.path.exists(index_path):
        with open(index_path) as f:
            files = {name: os.path.join(src, file) for name, file in json.load(f)["weight_map"].items()}
        for path in sorted(set(files.values())):
            if not os.path.exists(path):
                raise ConvertError(f"{path}: no such file (listed in {index_path})")
    else:
        paths = sorted(glob.glob(os.path.join(src, "*.safetensors")))
        if not paths:
            raise ConvertError(f"{src}: no *.safetensors files (re-save the model with safe_serialization=True)")
        files = {}
        for path in paths:
            with safe_open(path, framework="numpy") as f:
                files.update(dict.fromkeys(f.keys(), path))
    carried = {k: hf[k] for k in CARRIED if hf.get(k) is not None}
    return Source(model, carried, files, hf["architectures"][0])
