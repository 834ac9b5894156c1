"""Run configuration: frozen dataclasses per section, YAML files, dotted `section.key=value` overrides.

Every user mistake raises `ConfigError` with one line naming the key, the value and what is allowed; the CLI
turns it into `error: ...` and exit code 2. Checks that need the device count live in `parallel/mesh.py`.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml


class ConfigError(ValueError):
    """A user mistake in the configuration; the message is one line."""


DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts FFNs (`num_experts: 0` = a dense model).

    Layer i is an MoE layer when i >= `first_dense_layers` and (i - first_dense_layers) % `every_n_layers` == 0.
    `router`: softmax (Mixtral: softmax over all experts, top-k, renormalised) or sigmoid (DeepSeek-V3: sigmoid
    scores, top-k chosen on score + a per-expert bias, weights renormalised). `router_bias_update` > 0 moves that
    bias by this step size towards balanced load after every step (aux-loss-free balancing, outside the gradient).
    `capacity_factor`: null = dropless; else each expert takes at most ceil(tokens x top_k / experts x factor).
    `shared_experts`: experts every token passes through (one SwiGLU of shared_experts x expert_ffn_size).
    """

    num_experts: int = 0
    top_k: int = 2
    expert_ffn_size: int | None = None  # null = model.ffn_size
    capacity_factor: float | None = None
    router: str = "softmax"
    router_bias_update: float = 0.0
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0
    shared_experts: int = 0
    every_n_layers: int = 1
    first_dense_layers: int = 0
    impl: str = "auto"  # grouped matmul of dropless experts: auto | ragged (jax.lax.ragged_dot) | mgpu (Hopper)

    @property
    def enabled(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, i: int) -> bool:
        return self.enabled and i >= self.first_dense_layers and (i - self.first_dense_layers) % self.every_n_layers == 0


@dataclass(frozen=True)
class ModelConfig:
    """Decoder shape. `num_kv_heads` and `head_dim` default to `num_heads` and `hidden_size // num_heads`."""

    vocab_size: int = 512
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int | None = None
    head_dim: int | None = None
    ffn_size: int = 384
    norm: str = "rmsnorm"
    norm_eps: float = 1e-6
    activation: str = "swiglu"
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    qk_norm: bool = False
    qkv_bias: bool = False
    init_std: float = 0.02
    dtype: str = "bfloat16"
    param_dtype: str = "float32"
    remat: str = "none"
    attention_impl: str = "auto"
    scan_layers: bool = True  # a lax.scan over the layers compiles once per model; unrolled runs faster
    precision: str = "bf16"  # matmuls in `dtype` (bf16), XLA fp8 with current scaling, or Transformer Engine fp8
    moe: MoEConfig = field(default_factory=MoEConfig)

    @property
    def expert_ffn(self) -> int:
        return self.moe.expert_ffn_size or self.ffn_size

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads


@dataclass(frozen=True)
class ParallelConfig:
    """Mesh degrees (one may be -1 = the remaining devices) and the rules table (preset name or overrides)."""

    data: int = -1
    stage: int = 1
    fsdp: int = 1
    context: int = 1
    expert: int = 1
    tensor: int = 1
    context_strategy: str = "allgather"  # allgather: K/V gathered once; ring: K/V blocks passed around (ppermute)
    virtual_stages: int = 1
    pipeline_schedule: str = "1f1b"
    sequence_parallel: bool = False
    shard_optimizer: bool = False
    rules: Any = "default"
    # Degrees across hosts/slices (the slow network): each multiplies the same axis' degree within a host.
    dcn_data: int = 1
    dcn_stage: int = 1
    dcn_fsdp: int = 1


@dataclass(frozen=True)
class TrainConfig:
    """Steps and batch. `micro_batch_size` is per data-parallel replica, as in Megatron-LM; None = no accumulation."""

    steps: int = 200
    global_batch_size: int = 16
    micro_batch_size: int | None = None
    num_microbatches: int | None = None  # the same split as micro_batch_size: give either (or both, consistent)
    seq_len: int = 128
    seed: int = 0
    output_dir: str | None = None
    log_every: int = 10
    eval_every: int = 100  # 0 = never
    eval_batches: int = 4
    nan_policy: str = "skip"  # skip: drop the update and count it; stop: save the last good state and exit


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with a warmup then cosine, warmup-stable-decay (last `decay_fraction` of steps) or constant."""

    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 20
    schedule: str = "cosine"
    decay_fraction: float = 0.2
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip_grad: float | None = 1.0


@dataclass(frozen=True)
class DataConfig:
    """Training data: `paths` of prepared token directories (`python -m mlm_jax.data.prepare`), blended by
    `weights` (default: by size); without paths, the embedded corpus (the standard library's sources, bytes).
    `tokenizer` (byte or a tokenizer.json path) must be the one the directories were prepared with.
    `max_bytes` caps the embedded corpus."""

    paths: list | None = None
    weights: list | None = None
    tokenizer: str = "byte"
    validation_fraction: float = 0.05
    max_bytes: int | None = None


@dataclass(frozen=True)
class CheckpointConfig:
    """Sharded async checkpoints. `dir` defaults to `<train.output_dir>/checkpoints`; `every: 0` saves only at the
    end (and on SIGTERM/SIGINT). `resume`: auto (the newest in `dir`, if any), none, or a checkpoint path.
    `init_from`: start a new run from another checkpoint's weights (fresh optimizer)."""

    dir: str | None = None
    every: int = 0
    keep: int = 3
    resume: str = "auto"
    init_from: str | None = None


@dataclass(frozen=True)
class LogConfig:
    """`profile_steps: [a, b]` writes a jax.profiler trace of steps a..b (1-based, inclusive) to `profile_dir`
    (default `<train.output_dir>/profile`)."""

    sharding_report: bool = False
    progress: str = "auto"
    profile_steps: list | None = None
    profile_dir: str | None = None


@dataclass(frozen=True)
class Config:
    name: str = "tiny"
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_SECTION_TYPES = {k: v for k, v in typing.get_type_hints(Config).items() if k != "name"}
SECTIONS = tuple(_SECTION_TYPES)

CHOICES = {
    "model.norm": ("rmsnorm", "layernorm"),
    "model.activation": ("swiglu", "gelu"),
    "model.dtype": DTYPES,
    "model.param_dtype": DTYPES,
    "model.remat": ("none", "dots", "full"),
    "model.attention_impl": ("auto", "cudnn", "xla", "te"),
    "model.precision": ("bf16", "fp8", "fp8_te"),
    "optim.schedule": ("cosine", "wsd", "constant"),
    "log.progress": ("auto", "always", "never"),
    "train.nan_policy": ("skip", "stop"),
    "parallel.pipeline_schedule": ("1f1b", "gpipe"),
    "parallel.context_strategy": ("allgather", "ring"),
    "model.moe.router": ("softmax", "sigmoid"),
    "model.moe.impl": ("auto", "ragged", "mgpu"),
}

POSITIVE = (
    "model.vocab_size", "model.hidden_size", "model.num_layers", "model.num_heads", "model.num_kv_heads",
    "model.head_dim", "model.ffn_size", "train.steps", "train.global_batch_size", "train.micro_batch_size",
    "train.seq_len", "train.log_every", "train.eval_batches", "checkpoint.keep", "train.num_microbatches",
    "parallel.virtual_stages", "parallel.dcn_data", "parallel.dcn_stage", "parallel.dcn_fsdp",
    "model.moe.top_k", "model.moe.expert_ffn_size", "model.moe.capacity_factor", "model.moe.every_n_layers",
)


def _keys(prefix: str, tp) -> list[str]:
    """Dotted keys of a config dataclass, nested sections (`model.moe.top_k`) spelled out."""
    hints = typing.get_type_hints(tp)
    return [k for f in dataclasses.fields(tp) for k in
            (_keys(f"{prefix}.{f.name}", hints[f.name]) if dataclasses.is_dataclass(hints[f.name])
             else [f"{prefix}.{f.name}"])]


def _all_keys() -> list[str]:
    return [k for s, t in _SECTION_TYPES.items() for k in _keys(s, t)]


def _flat(d: dict, prefix: str = "") -> dict:
    return {k: v for name, value in d.items() for k, v in
            (_flat(value, f"{prefix}{name}.").items() if isinstance(value, dict) else [(f"{prefix}{name}", value)])}


def _unknown(key: str) -> ConfigError:
    close = difflib.get_close_matches(key, _all_keys() + list(SECTIONS), n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return ConfigError(f"unknown config key {key!r}{hint}")


def _type_name(tp) -> str:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    base = args[0] if args else tp
    name = getattr(base, "__name__", str(base))
    if name == "Any":
        return "a preset name or a list of rules"
    return f"{name} or null" if type(None) in typing.get_args(tp) else name


def _coerce(key: str, value: Any, tp) -> Any:
    """Check `value` against the field type; ints widen to floats, '1e-3' strings parse as floats."""
    if tp is Any:
        return value
    optional = isinstance(tp, types.UnionType) and type(None) in typing.get_args(tp)
    base = next((a for a in typing.get_args(tp) if a is not type(None)), tp) if optional else tp
    if value is None:
        if optional:
            return None
    elif base is bool:
        if isinstance(value, bool):
            return value
    elif base is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif base is float:
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    elif base is str:
        if isinstance(value, str):
            return value
    elif base is list:
        if isinstance(value, str):
            return [value]
        if isinstance(value, (list, tuple)):
            return list(value)
    raise ConfigError(f"{key}={value!r}: expected {_type_name(tp)}")


def _apply(cfg: Config, key: str, value: Any) -> Config:
    section, _, name = key.partition(".")
    if section not in SECTIONS or not name:
        raise _unknown(key)
    return dataclasses.replace(cfg, **{section: _set(getattr(cfg, section), name, key, value)})


def _set(node, name: str, key: str, value: Any):
    """`node` with the dotted `name` set to `value`; a mapping given for a nested section sets its keys."""
    head, _, rest = name.partition(".")
    hints = typing.get_type_hints(type(node))
    if head not in hints:
        raise _unknown(key)
    child = getattr(node, head)
    if dataclasses.is_dataclass(child):
        if rest:
            return dataclasses.replace(node, **{head: _set(child, rest, key, value)})
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of keys, got {value!r}")
        for k, v in value.items():
            child = _set(child, str(k), f"{key}.{k}", v)
        return dataclasses.replace(node, **{head: child})
    if rest:
        raise _unknown(key)
    return dataclasses.replace(node, **{head: _coerce(key, value, hints[head])})


def _load_yaml(path: str) -> dict:
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except UnicodeDecodeError:
        raise ConfigError(f"--config {path}: not a UTF-8 text file") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark else ""
        raise ConfigError(f"--config {path}: malformed YAML{where}") from None
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read ({e.strerror})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of sections, got {type(data).__name__}")
    return data


def _parse_override(arg: str) -> tuple[str, Any]:
    key, eq, raw = arg.partition("=")
    if not eq or not key:
        raise ConfigError(f"argument {arg!r}: expected section.key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def load_config(path: str | os.PathLike | None = None, overrides: typing.Iterable[str] = ()) -> Config:
    """Defaults, then the YAML file at `path`, then `section.key=value` overrides; validated."""
    cfg = Config()
    if path is not None:
        path = os.fspath(path)
        cfg = dataclasses.replace(cfg, name=os.path.splitext(os.path.basename(path))[0])
        for section, values in _load_yaml(path).items():
            if section == "name" and isinstance(values, str):
                cfg = dataclasses.replace(cfg, name=values)
                continue
            if section not in SECTIONS:
                raise _unknown(str(section))
            if values is None:
                continue
            if not isinstance(values, dict):
                raise ConfigError(f"{section}: expected a mapping of keys, got {values!r}")
            for name, value in values.items():
                cfg = _apply(cfg, f"{section}.{name}", value)
    for arg in overrides:
        cfg = _apply(cfg, *_parse_override(arg))
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """Checks that need no devices."""
    flat = _flat({s: sec for s, sec in cfg.to_dict().items() if isinstance(sec, dict)})
    for key, allowed in CHOICES.items():
        if flat[key] not in allowed:
            raise ConfigError(f"{key}={flat[key]!r}: expected one of {', '.join(allowed)}")
    for key in POSITIVE:
        if flat[key] is not None and flat[key] <= 0:
            raise ConfigError(f"{key}={flat[key]}: must be positive")
    m = cfg.model
    if m.head_dim is None and m.hidden_size % m.num_heads:
        raise ConfigError(
            f"model.hidden_size={m.hidden_size} is not divisible by model.num_heads={m.num_heads}; set model.head_dim")
    if m.num_heads % m.kv_heads:
        raise ConfigError(f"model.num_kv_heads={m.kv_heads} must divide model.num_heads={m.num_heads}")
    if m.dim_per_head % 2:
        raise ConfigError(f"model.head_dim={m.dim_per_head}: rotary embeddings need an even head dimension")
    _validate_moe(m.moe, m.num_layers)
    p = cfg.parallel
    degrees = {k: getattr(p, k) for k in ("data", "stage", "fsdp", "context", "expert", "tensor")}
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
    if cfg.checkpoint.every < 0:
        raise ConfigError(f"checkpoint.every={cfg.checkpoint.every}: must be >= 0 (0 = only at the end)")
    if cfg.checkpoint.resume == "":
        raise ConfigError("checkpoint.resume='': expected auto, none or a checkpoint path")
    if cfg.train.eval_every < 0:
        raise ConfigError(f"train.eval_every={cfg.train.eval_every}: must be >= 0 (0 = no evaluation)")
    d = cfg.data
    if d.weights is not None:
        if not d.paths or len(d.weights) != len(d.paths):
            raise ConfigError(f"data.weights={d.weights}: expected one weight per entry of data.paths={d.paths}")
        if not all(isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) and w > 0
                   for w in d.weights):
            raise ConfigError(f"data.weights={d.weights}: expected positive numbers")
    if d.paths is not None and (not d.paths or not all(isinstance(p, str) for p in d.paths)):
        raise ConfigError(f"data.paths={d.paths}: expected a list of prepared directories")
    if not (0 < cfg.data.validation_fraction < 1):
        raise ConfigError(f"data.validation_fraction={cfg.data.validation_fraction}: expected a number in (0, 1)")
    o = cfg.optim
    if not (0 <= o.decay_fraction <= 1):
        raise ConfigError(f"optim.decay_fraction={o.decay_fraction}: expected a number in [0, 1]")
    if o.warmup_steps < 0:
        raise ConfigError(f"optim.warmup_steps={o.warmup_steps}: must be >= 0")
    if o.clip_grad is not None and o.clip_grad <= 0:
        raise ConfigError(f"optim.clip_grad={o.clip_grad}: must be positive or null")


def _validate_moe(moe: MoEConfig, num_layers: int) -> None:
    for key in ("num_experts", "shared_experts", "first_dense_layers"):
        if getattr(moe, key) < 0:
            raise ConfigError(f"model.moe.{key}={getattr(moe, key)}: must be >= 0")
    for key in ("router_bias_update", "aux_loss_coef", "z_loss_coef"):
        if getattr(moe, key) < 0:
            raise ConfigError(f"model.moe.{key}={getattr(moe, key)}: must be >= 0")
    if not moe.enabled:
        return
    if moe.top_k > moe.num_experts:
        raise ConfigError(f"model.moe.top_k={moe.top_k} exceeds model.moe.num_experts={moe.num_experts}")
    if not any(moe.is_moe_layer(i) for i in range(num_layers)):
        raise ConfigError(f"model.moe.first_dense_layers={moe.first_dense_layers} leaves no MoE layer among "
                          f"model.num_layers={num_layers}")
    if moe.router_bias_update and moe.router != "sigmoid":
        raise ConfigError(f"model.moe.router_bias_update={moe.router_bias_update} needs model.moe.router=sigmoid "
                          f"(the bias only steers the sigmoid router's choice)")


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
