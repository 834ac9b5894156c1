"""The rules a run's configuration must satisfy on its own (no devices), and `load_config`, which parses a config
and checks them: each field's choices and bounds (declared beside the field in `config.py`), the rules across
fields (heads, MoE layers, data blends, the rules table), and what may change when a run resumes.

Each rule raises `ConfigError` with one line naming the key, the value and what is allowed. No jax is imported here:
a config is checked (`--print-config`, notebooks) before jax loads. The rules that need the devices and the backend
are `validation.plan`'s.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import typing

from mlm_jax.config import Config, ConfigError, MoEConfig, RopeScalingConfig, parse_config
from mlm_jax.parallel.rules import make_rules

DEGREE_KEYS = ("data", "stage", "fsdp", "context", "expert", "tensor")  # parallel.<axis>, the mesh axes' degrees


def load_config(path: str | os.PathLike | None = None, overrides: typing.Iterable[str] = ()) -> Config:
    """Defaults, then the YAML file at `path`, then `section.key=value` overrides; checked (`check_config`)."""
    cfg = parse_config(path, overrides)
    check_config(cfg)
    return cfg


# -- fields ---------------------------------------------------------------------------------------------------------
def _fields(node, prefix: str):
    """(dotted key, value, field metadata, whether null is allowed) of every leaf field under a config dataclass."""
    hints = typing.get_type_hints(type(node))
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        key = f"{prefix}.{f.name}" if prefix else f.name
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _fields(value, key)
        else:
            yield key, value, f.metadata, type(None) in typing.get_args(hints[f.name])


def _bounds_text(gt, ge, lt, le) -> str:
    if lt is None and le is None:
        return "must be positive" if gt == 0 else f"must be > {gt}" if gt is not None else f"must be >= {ge}"
    low = f"({gt}" if gt is not None else f"[{ge}" if ge is not None else "(-inf"
    return f"expected a number in {low}, {lt if lt is not None else le}{')' if lt is not None else ']'}"


def _check_fields(cfg: Config) -> None:
    for key, value, meta, nullable in _fields(cfg, ""):
        if "choices" in meta and value not in meta["choices"]:
            raise ConfigError(f"{key}={value!r}: expected one of {', '.join(meta['choices'])}")
        if "bounds" in meta and value is not None:
            gt, ge, lt, le = meta["bounds"]
            if ((gt is not None and not value > gt) or (ge is not None and not value >= ge)
                    or (lt is not None and not value < lt) or (le is not None and not value <= le)):
                raise ConfigError(f"{key}={value}: {_bounds_text(gt, ge, lt, le)}{' or null' * nullable}")


# -- the config alone -----------------------------------------------------------------------------------------------
def check_config(cfg: Config) -> None:
    """The rules that need no devices: each field's choices and bounds, then the rules across fields."""
    _check_fields(cfg)
    m = cfg.model
    if m.head_dim is None and m.hidden_size % m.num_heads:
        raise ConfigError(
            f"model.hidden_size={m.hidden_size} is not divisible by model.num_heads={m.num_heads}; set model.head_dim")
    if m.num_heads % m.kv_heads:
        raise ConfigError(f"model.num_kv_heads={m.kv_heads} must divide model.num_heads={m.num_heads}")
    if m.rotary_dim % 2 or m.rotary_dim == 0:
        raise ConfigError(f"model.head_dim={m.dim_per_head}: rotary embeddings need an even head dimension to rotate "
                          f"(model.partial_rotary_factor={m.partial_rotary_factor} rotates {m.rotary_dim} dims)")
    _check_rope_scaling(m.rope_scaling)
    _check_layer_types(m)
    _check_mla(m)
    _check_moe(m.moe, m.num_layers)
    p = cfg.parallel
    degrees = {k: getattr(p, k) for k in DEGREE_KEYS}
    for k, v in degrees.items():
        if v == 0 or v < -1:
            raise ConfigError(f"parallel.{k}={v}: expected a positive degree or -1 (the remaining devices)")
    if sum(v == -1 for v in degrees.values()) > 1:
        many = ", ".join(f"parallel.{k}" for k, v in degrees.items() if v == -1)
        raise ConfigError(f"more than one degree is -1 ({many}); at most one may take the remaining devices")
    ps = cfg.log.profile_steps
    if ps is not None and not (len(ps) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in ps)
                               and 1 <= ps[0] <= ps[1]):
        raise ConfigError(f"log.profile_steps={ps}: expected [first, last] steps with 1 <= first <= last")
    if cfg.checkpoint.resume == "":
        raise ConfigError("checkpoint.resume='': expected auto, none or a checkpoint path")
    d = cfg.data
    if d.weights is not None:
        if not d.paths or len(d.weights) != len(d.paths):
            raise ConfigError(f"data.weights={d.weights}: expected one weight per entry of data.paths={d.paths}")
        if not all(isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) and w > 0
                   for w in d.weights):
            raise ConfigError(f"data.weights={d.weights}: expected positive numbers")
    if d.paths is not None and (not d.paths or not all(isinstance(p, str) for p in d.paths)):
        raise ConfigError(f"data.paths={d.paths}: expected a list of prepared directories")
    make_rules(p.rules, p.sequence_parallel)  # the table's own parser names the bad entry
    tasks = cfg.eval.tasks
    if tasks is not None and not all(isinstance(t, str) and t and "," not in t for t in tasks):
        raise ConfigError(f"eval.tasks={tasks}: expected a list of lm-eval task names, e.g. "
                          f"eval.tasks=[hellaswag,arc_easy]")


def _check_mla(m) -> None:
    a = m.mla
    if not a.enabled:
        return
    if a.qk_rope_head_dim % 2:
        raise ConfigError(f"model.mla.qk_rope_head_dim={a.qk_rope_head_dim}: rotary embeddings need an even count")
    if a.v_head_dim > a.qk_head_dim:
        raise ConfigError(f"model.mla.v_head_dim={a.v_head_dim} exceeds the query/key head dim "
                          f"{a.qk_head_dim} (qk_nope_head_dim + qk_rope_head_dim)")
    for on, what in ((m.qk_norm, "model.qk_norm"), (m.qkv_bias, "model.qkv_bias"),
                     (m.sliding_window is not None, "model.sliding_window"),
                     (m.kv_heads != m.num_heads, "model.num_kv_heads"), (m.head_dim is not None, "model.head_dim"),
                     (m.partial_rotary_factor != 1, "model.partial_rotary_factor")):
        if on:
            raise ConfigError(f"{what} does not apply to latent attention (model.mla.kv_lora_rank="
                              f"{a.kv_lora_rank}); leave it unset")


LAYER_TYPES = ("sliding_attention", "full_attention")


def _check_layer_types(m) -> None:
    types_ = m.layer_types
    if types_ is None:
        return
    if len(types_) != m.num_layers or any(t not in LAYER_TYPES for t in types_):
        raise ConfigError(f"model.layer_types={types_}: expected model.num_layers={m.num_layers} entries, each "
                          f"{' or '.join(LAYER_TYPES)}")
    if "sliding_attention" in types_ and m.sliding_window is None:
        raise ConfigError("model.layer_types has sliding_attention layers but model.sliding_window is null; set the "
                          "window")


ROPE_FIELDS = {"yarn": ("original_max_position_embeddings",),
               "llama3": ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def _check_rope_scaling(r: RopeScalingConfig) -> None:
    missing = [k for k in ROPE_FIELDS.get(r.rope_type, ()) if getattr(r, k) is None]
    if missing:
        raise ConfigError(f"model.rope_scaling.rope_type={r.rope_type} needs model.rope_scaling.{missing[0]}")
    if r.rope_type == "llama3" and r.low_freq_factor >= r.high_freq_factor:
        raise ConfigError(f"model.rope_scaling.low_freq_factor={r.low_freq_factor} must be below "
                          f"model.rope_scaling.high_freq_factor={r.high_freq_factor}")


def _check_moe(moe: MoEConfig, num_layers: int) -> None:
    if not moe.enabled:
        return
    if moe.top_k > moe.num_experts:
        raise ConfigError(f"model.moe.top_k={moe.top_k} exceeds model.moe.num_experts={moe.num_experts}")
    dense = moe.dense_layers or []
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers for i in dense):
        raise ConfigError(f"model.moe.dense_layers={moe.dense_layers}: expected layer indices in [0, "
                          f"{num_layers}) (model.num_layers={num_layers})")
    if not any(moe.is_moe_layer(i) for i in range(num_layers)):
        listed = f" and model.moe.dense_layers={moe.dense_layers}" if moe.dense_layers else ""
        raise ConfigError(f"model.moe.first_dense_layers={moe.first_dense_layers}{listed} leave no MoE layer among "
                          f"model.num_layers={num_layers}")
    if moe.num_groups > 1 and (moe.num_experts % moe.num_groups or moe.num_experts // moe.num_groups < 2):
        raise ConfigError(f"model.moe.num_groups={moe.num_groups} must split model.moe.num_experts={moe.num_experts} "
                          f"into groups of at least 2 experts")
    if moe.top_groups > moe.num_groups or (moe.num_groups > 1 and moe.top_k > moe.top_groups * (
            moe.num_experts // moe.num_groups)):
        raise ConfigError(f"model.moe.top_groups={moe.top_groups} of model.moe.num_groups={moe.num_groups} leaves "
                          f"fewer experts than model.moe.top_k={moe.top_k}, or more groups than there are")
    if moe.router_bias_update and moe.router != "sigmoid":
        raise ConfigError(f"model.moe.router_bias_update={moe.router_bias_update} needs model.moe.router=sigmoid "
                          f"(the bias only steers the sigmoid router's choice)")


# -- resuming -------------------------------------------------------------------------------------------------------
# What fixes the order of the training samples: the token stream that `build_datasets` makes of `data.*` (the embedded
# corpus or the blend of `data.paths`), permuted by `train.seed`. `max_bytes` only caps the embedded corpus;
# `weights` and `tokenizer` only matter for prepared directories.
_ORDER_KEYS = {"embedded": ("train.seed", "data.paths", "data.validation_fraction", "data.max_bytes"),
               "paths": ("train.seed", "data.paths", "data.weights", "data.tokenizer", "data.validation_fraction")}
# A new batch size or sequence length is a deliberate change of the run's shape (step s then reads samples from
# s x the new batch size on): allowed on resume, and reported at start-up.
_SHAPE_KEYS = ("train.global_batch_size", "train.seq_len")
_MISSING = object()


def _changes(saved: dict, current: dict, keys) -> list[tuple[str, typing.Any, typing.Any]]:
    """(key, saved value, current value) for each of `keys` that differs; a key the saved config lacks is skipped."""
    out = []
    for key in keys:
        section, name = key.split(".")
        old, new = (saved.get(section) or {}).get(name, _MISSING), current[section][name]
        if old is not _MISSING and old != new:
            out.append((key, old, new))
    return out


def _shown_value(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _flat(tree: dict, prefix: str) -> dict[str, typing.Any]:
    out = {}
    for name, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = value
    return out


def _model_changes(saved: dict, current: dict) -> str:
    old, new = _flat(saved.get("model") or {}, "model."), _flat(current["model"], "model.")
    changed = [f"{k}={_shown_value(old[k])} there, {_shown_value(new[k])} here"
               for k in new if k in old and old[k] != new[k]]
    return "; ".join(changed) if changed else "no model key differs"


def check_weights(cfg: Config, saved: dict, key: str, where: str, mismatch: str | None) -> None:
    """Refuses the checkpoint at `where` (named by config `key`), whose resolved config was `saved`, when its
    weights' shapes do not fit this run's model (`mismatch` says how: `checkpoint.state.mismatch`): one line naming the
    model keys that differ, before any array is read."""
    if mismatch is None:
        return
    if key == "checkpoint.resume":
        advice = ("set them back to resume it, or train this model in another train.output_dir (or "
                  "checkpoint.dir)")
    else:
        advice = "set them to the checkpoint's, or start this model without checkpoint.init_from"
    raise ConfigError(f"{key}: {where} holds weights of another model ({_model_changes(saved, cfg.to_dict())}; "
                      f"{mismatch}): {advice}")


def check_resume(cfg: Config, saved: dict, where: str, mismatch: str | None = None) -> list[str]:
    """Resuming the checkpoint at `where`, whose resolved config was `saved` (`Config.to_dict()` form): refuses
    weights of other shapes (`check_weights`) and a changed data order unless `checkpoint.allow_data_change`; returns
    the allowed changes as `key old -> new`."""
    check_weights(cfg, saved, "checkpoint.resume", where, mismatch)
    current = cfg.to_dict()
    kinds = {"paths" if (c.get("data") or {}).get("paths") else "embedded" for c in (saved, current)}
    order = _changes(saved, current, dict.fromkeys(k for kind in ("paths", "embedded") if kind in kinds
                                                   for k in _ORDER_KEYS[kind]))
    if order and not cfg.checkpoint.allow_data_change:
        was = ", ".join(f"{k}={_shown_value(old)}" for k, old, _ in order)
        now = ", ".join(f"{k}={_shown_value(new)}" for k, _, new in order)
        raise ConfigError(
            f"checkpoint.resume: {where} was written with {was}; this run has {now}: resuming would change the data "
            f"order (set checkpoint.allow_data_change=true to accept, or checkpoint.init_from={where} with another "
            f"train.output_dir to start a new run from its weights)")
    return [f"{k} {_shown_value(old)} -> {_shown_value(new)}"
            for k, old, new in order + _changes(saved, current, _SHAPE_KEYS)]
