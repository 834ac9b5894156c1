"""The Llama family (Llama 2 and 3, Mistral, Qwen2, Qwen3) in Hugging Face terms: config keys, tensor names and layouts.

Pure Python and numpy, so a bad source folder is reported before jax loads. Shapes: D model, N query heads,
K kv heads, H head dim, F ffn, V vocabulary, L layers. HF stores a Linear weight as (out, in); our kernels keep
heads as their own dims (q: D,N,H; o: N,H,D). Both use rotate-half RoPE, so q/k need no permutation.
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

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
OTHER_ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM", "DeepseekV3ForCausalLM")
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


ENTRIES = (
    Entry(("embed", "embedding"), "model.embed_tokens.weight"),
    per_layer("attn_norm/scale", "input_layernorm.weight"),
    per_layer("attn/q/kernel", "self_attn.q_proj.weight", "linear"),
    per_layer("attn/k/kernel", "self_attn.k_proj.weight", "linear"),
    per_layer("attn/v/kernel", "self_attn.v_proj.weight", "linear"),
    per_layer("attn/q/bias", "self_attn.q_proj.bias", "flat"),
    per_layer("attn/k/bias", "self_attn.k_proj.bias", "flat"),
    per_layer("attn/v/bias", "self_attn.v_proj.bias", "flat"),
    per_layer("attn/o/kernel", "self_attn.o_proj.weight", "linear", 2),
    per_layer("attn/q_norm/scale", "self_attn.q_norm.weight"),
    per_layer("attn/k_norm/scale", "self_attn.k_norm.weight"),
    per_layer("mlp_norm/scale", "post_attention_layernorm.weight"),
    per_layer("mlp/gate/kernel", "mlp.gate_proj.weight", "linear"),
    per_layer("mlp/up/kernel", "mlp.up_proj.weight", "linear"),
    per_layer("mlp/down/kernel", "mlp.down_proj.weight", "linear"),
    Entry(("final_norm", "scale"), "model.norm.weight"),
    Entry(("head", "kernel"), "lm_head.weight", "linear"),
)


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


def to_hf(e: Entry, x: np.ndarray) -> np.ndarray:
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


def layout(m: ModelConfig, shapes: dict, entries: tuple[Entry, ...] = ENTRIES,
           family: str = "Llama") -> list[tuple[Entry, tuple[int, ...]]]:
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


def model_config(hf: dict) -> ModelConfig:
    """Our model section for an HF `config.json`; anything we would compute differently is refused."""
    arch = (hf.get("architectures") or [None])[0]
    if arch in OTHER_ARCHITECTURES:  # built on this module
        from mlm_jax.convert import deepseek_v3, gemma3, mixtral, qwen3_moe
        return {"MixtralForCausalLM": mixtral, "Qwen3MoeForCausalLM": qwen3_moe, "Gemma3ForCausalLM": gemma3,
                "DeepseekV3ForCausalLM": deepseek_v3}[arch].model_config(hf)
    if arch not in ARCHITECTURES:
        raise ConvertError(f"architecture {arch!r} is not supported "
                           f"(expected one of {', '.join(ARCHITECTURES + OTHER_ARCHITECTURES)})")
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if hf.get(k) is None]
    if missing:
        raise ConvertError(f"config.json lacks {', '.join(missing)}")
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ConvertError(f"hidden_act={hf['hidden_act']!r} is not supported (only silu, i.e. SwiGLU)")
    rotary = rope(hf)
    if rotary["partial_rotary_factor"] != 1:
        raise ConvertError(f"partial_rotary_factor={rotary['partial_rotary_factor']}: {arch} rotates whole heads")
    window, layer_types = _sliding_window(hf, arch)
    if arch != "Qwen2ForCausalLM" and hf.get("attention_bias"):  # Qwen3's also adds one to o_proj
        raise ConvertError("attention_bias=true is not supported (it adds an o_proj bias, which mlm_jax lacks)")
    if hf.get("mlp_bias"):
        raise ConvertError("mlp_bias=true is not supported")
    heads, dim = hf["num_attention_heads"], hf["hidden_size"]
    head_dim = hf.get("head_dim") or dim // heads
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=dim, num_layers=hf["num_hidden_layers"], num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads, head_dim=None if head_dim * heads == dim else head_dim,
        ffn_size=hf["intermediate_size"], norm="rmsnorm", norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        activation="swiglu", tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=arch == "Qwen2ForCausalLM", qk_norm=arch == "Qwen3ForCausalLM", sliding_window=window,
        layer_types=layer_types, **rotary)


def _sliding_window(hf: dict, arch: str) -> tuple[int | None, list | None]:
    """(window, per-layer types or None for every layer) of an HF config: Mistral windows every layer, Qwen2 and
    Qwen3 (with `use_sliding_window`) the layers `layer_types` marks, by default those from `max_window_layers`."""
    window = hf.get("sliding_window")
    if arch == "MistralForCausalLM" or window is None:
        return window, None
    if arch not in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") or not hf.get("use_sliding_window"):
        return None, None
    n = hf["num_hidden_layers"]
    types_ = hf.get("layer_types") or ["sliding_attention" if i >= hf.get("max_window_layers", n) else
                                       "full_attention" for i in range(n)]
    if len(types_) != n or not set(types_) <= {"sliding_attention", "full_attention"}:
        raise ConvertError(f"layer_types={types_}: expected num_hidden_layers={n} entries of sliding_attention or "
                           f"full_attention")
    if "sliding_attention" not in types_:
        return None, None
    return window, None if set(types_) == {"sliding_attention"} else list(types_)


def hf_sliding_window(m: ModelConfig, arch: str) -> dict:
    """Our sliding window as `config.json` keys of `arch` (the way back of `_sliding_window`)."""
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        if m.sliding_window is None:
            return {"use_sliding_window": False}
        types_ = ["sliding_attention" if m.is_local(i) else "full_attention" for i in range(m.num_layers)]
        return {"use_sliding_window": True, "sliding_window": m.sliding_window, "layer_types": types_,
                "max_window_layers": types_.index("sliding_attention")}
    if m.layer_types is not None and m.sliding_window is not None:
        raise ConvertError(f"model.layer_types mixing sliding and full layers cannot be exported as {arch} (it "
                           f"windows every layer or none); Qwen2 and Qwen3 can")
    return {"sliding_window": m.sliding_window} if m.sliding_window is not None else {}


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


def hf_config(m: ModelConfig, dtype: str, carried: dict) -> dict:
    """`config.json` for `m`: Qwen3ForCausalLM with QK-norm, Qwen2ForCausalLM with q/k/v biases, else
    LlamaForCausalLM."""
    for unsupported, what in ((m.norm != "rmsnorm", f"model.norm={m.norm}"),
                              (m.activation != "swiglu", f"model.activation={m.activation}"),
                              (m.qk_norm and m.qkv_bias, "model.qk_norm=true with model.qkv_bias=true"),
                              (m.norm_scale_offset != 0, f"model.norm_scale_offset={m.norm_scale_offset}"),
                              (m.scale_embeddings, "model.scale_embeddings=true"),
                              (m.attention_scale is not None, f"model.attention_scale={m.attention_scale}"),
                              (m.final_logit_softcap is not None, f"model.final_logit_softcap={m.final_logit_softcap}"),
                              (m.local_rope_theta is not None, f"model.local_rope_theta={m.local_rope_theta}"),
                              (m.partial_rotary_factor != 1, f"model.partial_rotary_factor={m.partial_rotary_factor}")):
        if unsupported:
            raise ConvertError(f"{what} cannot be exported (Llama, Mistral, Qwen2 and Qwen3 use RMSNorm, SwiGLU, "
                               f"whole-head RoPE and either q/k/v biases (Qwen2) or QK-norm (Qwen3))")
    arch = "Qwen3ForCausalLM" if m.qk_norm else "Qwen2ForCausalLM" if m.qkv_bias else "LlamaForCausalLM"
    if arch == "LlamaForCausalLM" and m.sliding_window is not None:  # Mistral is Llama with a window
        arch = "MistralForCausalLM"
    config = {
        "architectures": [arch], "model_type": arch.removesuffix("ForCausalLM").lower(),
        "vocab_size": m.vocab_size, "hidden_size": m.hidden_size, "intermediate_size": m.ffn_size,
        "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.kv_heads, "head_dim": m.dim_per_head, "hidden_act": "silu",
        "rms_norm_eps": m.norm_eps, **hf_rope(m),
        "tie_word_embeddings": m.tie_embeddings, "torch_dtype": dtype,
        **hf_sliding_window(m, arch), **({"mlp_bias": False} if arch == "LlamaForCausalLM" else {}),
        **({"attention_bias": False} if arch in ("LlamaForCausalLM", "Qwen3ForCausalLM") else {}),
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
