"""Run configuration: frozen dataclasses per section, YAML files, dotted `section.key=value` overrides.

Every user mistake raises `ConfigError` with one line naming the key, the value and what is allowed; the CLI
turns it into `error: ...` and exit code 2. Each field declares its own allowed values (`choice`, `number`);
`mlm_jax.validation` checks them and every rule across fields, devices and backend in one pass
(`mlm_jax.load_config` parses and checks). This module imports nothing of the package.
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


def choice(*allowed: str, default: str | None = None):
    """A string field restricted to `allowed` (the list lives here, beside the field, and nowhere else); the
    default is the first unless given."""
    return field(default=default or allowed[0], metadata={"choices": allowed})


def number(default, *, gt: float | None = None, ge: float | None = None, lt: float | None = None,
           le: float | None = None):
    """A numeric field with bounds, checked by `mlm_jax.validation` (None stays allowed for optional fields)."""
    return field(default=default, metadata={"bounds": (gt, ge, lt, le)})


def positive(default):
    return number(default, gt=0)


def non_negative(default):
    return number(default, ge=0)


@dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts FFNs (`num_experts: 0` = a dense model).

    Layer i is an MoE layer when i >= `first_dense_layers`, (i - first_dense_layers) % `every_n_layers` == 0 and
    i is not listed in `dense_layers`.
    `router`: softmax (Mixtral, Qwen3-MoE: softmax over all experts, top-k) or sigmoid (DeepSeek-V3: sigmoid
    scores, top-k chosen on score + a per-expert bias); `normalize_weights` renormalises the chosen k to sum 1. `router_bias_update` > 0 moves that
    bias by this step size towards balanced load after every step (aux-loss-free balancing, outside the gradient).
    `capacity_factor`: null = dropless; else capacity is counted per group of `capacity_group_rows` batch rows of
    each forward pass (GShard's groups; 1 = per sequence, as MaxText): each expert takes at most
    ceil(group tokens x top_k / experts x factor) of a group's assignments, whatever the layout.
    `shared_experts`: experts every token passes through (one SwiGLU of shared_experts x expert_ffn_size).
    `aux_loss_scope`: the tokens the load-balancing loss's expert loads are counted over: `microbatch` (each forward
    pass's batch, across the data-parallel ranks, as Megatron-LM; the objective then changes with the number of
    microbatches) or `global` (the step's whole batch, the global-batch balancing of Qiu et al. 2025: with
    microbatches, one more forward pass first counts the loads).
    """

    num_experts: int = non_negative(0)
    top_k: int = positive(2)
    expert_ffn_size: int | None = positive(None)  # null = model.ffn_size
    capacity_factor: float | None = positive(None)
    capacity_group_rows: int = positive(1)
    router: str = choice("softmax", "sigmoid")
    router_bias_update: float = non_negative(0.0)
    aux_loss_coef: float = non_negative(0.01)
    aux_loss_scope: str = choice("microbatch", "global")
    z_loss_coef: float = non_negative(0.0)
    shared_experts: int = non_negative(0)
    every_n_layers: int = positive(1)
    first_dense_layers: int = non_negative(0)
    dense_layers: list | None = None  # further layers that stay dense (Qwen3-MoE's mlp_only_layers)
    normalize_weights: bool = True
    # DeepSeek-V3's grouped top-k: experts in `num_groups` groups, a token's top_k taken from the `top_groups`
    # groups whose two best (biased) scores sum highest; the weights then times `routed_scaling_factor`
    num_groups: int = positive(1)
    top_groups: int = positive(1)
    routed_scaling_factor: float = positive(1.0)
    # grouped matmul of dropless experts: ragged_dot, Hopper's Mosaic-GPU kernels, or mgpu where they run
    impl: str = choice("auto", "ragged", "mgpu")

    @property
    def enabled(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, i: int) -> bool:
        periodic = i >= self.first_dense_layers and (i - self.first_dense_layers) % self.every_n_layers == 0
        return self.enabled and periodic and i not in (self.dense_layers or ())


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3) instead of the Q/K/V projections when `kv_lora_rank` > 0:
    keys and values from a normed latent of `kv_lora_rank`, queries from one of `q_lora_rank` (null: a direct
    projection), each head's query/key `qk_nope_head_dim` dims without position plus `qk_rope_head_dim` rotated
    ones (the key's shared by every head), values of `v_head_dim`."""

    kv_lora_rank: int = non_negative(0)
    q_lora_rank: int | None = positive(None)
    qk_nope_head_dim: int = positive(128)
    qk_rope_head_dim: int = positive(64)
    v_head_dim: int = positive(128)
    latent_norm_eps: float = positive(1e-6)

    @property
    def enabled(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def qk_head_dim(self) -> int:
        """A query's and key's dims per head: the ones without position and the rotated ones."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class RopeScalingConfig:
    """RoPE frequency scaling, Hugging Face's `rope_scaling` fields: `rope_type` linear (positions divided by
    `factor`), llama3 (`factor`, `low_freq_factor`, `high_freq_factor`, `original_max_position_embeddings`) or yarn
    (`factor`, `original_max_position_embeddings`, `beta_fast`, `beta_slow`, `mscale`, `mscale_all_dim`,
    `attention_factor`, `truncate`)."""

    rope_type: str = choice("default", "linear", "llama3", "yarn")
    factor: float = positive(1.0)
    low_freq_factor: float | None = positive(None)
    high_freq_factor: float | None = positive(None)
    original_max_position_embeddings: int | None = positive(None)
    beta_fast: float = positive(32.0)
    beta_slow: float = positive(1.0)
    mscale: float | None = non_negative(None)
    mscale_all_dim: float | None = non_negative(None)
    attention_factor: float | None = positive(None)
    truncate: bool = True


@dataclass(frozen=True)
class ModelConfig:
    """Decoder shape. `num_kv_heads` and `head_dim` default to `num_heads` and `hidden_size // num_heads`."""

    vocab_size: int = positive(512)
    hidden_size: int = positive(128)
    num_layers: int = positive(4)
    num_heads: int = positive(4)
    num_kv_heads: int | None = positive(None)
    head_dim: int | None = positive(None)
    ffn_size: int = positive(384)
    norm: str = choice("rmsnorm", "layernorm")
    norm_eps: float = positive(1e-6)
    norm_scale_offset: float = 0.0  # a norm multiplies by offset + scale (Gemma: 1, its scales start at 0)
    post_norms: bool = False  # norms after attention and the FFN too, before their residual adds (Gemma 2, 3)
    activation: str = choice("swiglu", "gelu", "geglu")  # geglu: tanh-GELU gate (Gemma)
    rope_theta: float = positive(10000.0)
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    partial_rotary_factor: float = number(1.0, gt=0, le=1)  # the fraction of each head's dims that rotate
    # sliding-window attention: each query sees itself and the `sliding_window - 1` tokens before it, in every
    # layer, or in the layers `layer_types` marks sliding_attention (the others full_attention, as Hugging Face)
    sliding_window: int | None = positive(None)
    layer_types: list | None = None
    local_rope_theta: float | None = positive(None)  # RoPE base of the sliding layers (Gemma 3); null = rope_theta
    tie_embeddings: bool = False
    scale_embeddings: bool = False  # embeddings times sqrt(hidden_size) (Gemma)
    attention_scale: float | None = positive(None)  # softmax scale; null = 1 / sqrt(head_dim)
    final_logit_softcap: float | None = positive(None)  # logits = cap * tanh(logits / cap) (Gemma 2)
    qk_norm: bool = False
    qkv_bias: bool = False
    init_std: float = positive(0.02)
    dtype: str = choice(*DTYPES, default="bfloat16")
    # master weights; not float16, whose range AdamW's second moments (squared gradients) underflow
    param_dtype: str = choice("float32", "bfloat16")
    remat: str = choice("none", "dots", "full")
    attention_impl: str = choice("auto", "cudnn", "xla", "te")  # auto: cudnn on GPUs for 16-bit inputs, else xla
    # documents a row may hold for cuDNN's packed attention (Hopper; document masks, packed data); a step with a
    # fuller row runs masked attention, the same function, slower. null = train.seq_len // 64, 0 = masks always
    max_segments_per_row: int | None = non_negative(None)
    scan_layers: bool = True  # a lax.scan over the layers compiles once per model; unrolled runs faster
    # matmuls in `dtype` (bf16), XLA fp8 with current or delayed scaling, or Transformer Engine fp8
    precision: str = choice("bf16", "fp8", "fp8_delayed", "fp8_te")
    fp8_amax_history: int = positive(16)  # fp8_delayed: steps of max magnitudes each operand's scale takes the max of
    moe: MoEConfig = field(default_factory=MoEConfig)
    mla: MLAConfig = field(default_factory=MLAConfig)

    @property
    def expert_ffn(self) -> int:
        return self.moe.expert_ffn_size or self.ffn_size

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    def is_local(self, i: int) -> bool:
        """Whether layer i attends through the sliding window."""
        if self.sliding_window is None:
            return False
        return self.layer_types is None or self.layer_types[i] == "sliding_attention"

    @property
    def rotary_dim(self) -> int:
        return int(self.dim_per_head * self.partial_rotary_factor)


@dataclass(frozen=True)
class ParallelConfig:
    """Mesh degrees (one may be -1 = the remaining devices) and the rules table (preset name or overrides)."""

    data: int = -1
    stage: int = 1
    fsdp: int = 1
    context: int = 1
    expert: int = 1
    tensor: int = 1
    # allgather: K/V gathered once; ring: K/V blocks passed around (ppermute)
    context_strategy: str = choice("allgather", "ring")
    virtual_stages: int = positive(1)
    pipeline_schedule: str = choice("1f1b", "zb1", "gpipe")
    # layers per pipeline chunk: even, balanced (fewer on the chunk with the head, from a FLOP model), or a list
    # of stage x virtual_stages sizes in model order (chunk v*stage + p on stage p)
    pipeline_layers: Any = "even"
    sequence_parallel: bool = False
    shard_optimizer: bool = False
    rules: Any = "default"
    # Degrees across hosts/slices (the slow network): each multiplies the same axis' degree within a host.
    dcn_data: int = positive(1)
    dcn_stage: int = positive(1)
    dcn_fsdp: int = positive(1)


@dataclass(frozen=True)
class TrainConfig:
    """Steps and batch. `micro_batch_size` is per data-parallel replica, as in Megatron-LM; None = no accumulation."""

    steps: int = positive(200)
    global_batch_size: int = positive(16)
    micro_batch_size: int | None = positive(None)
    num_microbatches: int | None = positive(None)  # the same split as micro_batch_size: give either (or both)
    seq_len: int = positive(128)
    # the output head and cross-entropy over this many slices of the sequence, so the whole batch's logits never
    # exist at once (memory at large vocabularies); 1 = in one piece
    loss_chunks: int = positive(1)
    seed: int = non_negative(0)
    output_dir: str | None = None
    log_every: int = positive(10)
    eval_every: int = non_negative(100)  # 0 = never
    eval_batches: int = positive(4)
    # skip: drop the update and count it; stop: save the last good state and exit (checked on logged steps)
    nan_policy: str = choice("skip", "stop")
    # the train step's matrix products on GPUs: xla = XLA's autotuner picks Triton or cuBLAS for each; cublas =
    # cuBLAS for every one; auto = cublas where the step accumulates microbatches without pipeline stages, else
    # xla (`validation.plan.matmuls`)
    matmul_impl: str = choice("auto", "xla", "cublas")


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with a warmup then cosine, warmup-stable-decay (last `decay_fraction` of steps) or constant."""

    lr: float = positive(3e-3)
    min_lr: float = non_negative(3e-4)
    warmup_steps: int = non_negative(20)
    schedule: str = choice("cosine", "wsd", "constant")
    decay_fraction: float = number(0.2, ge=0, le=1)
    weight_decay: float = non_negative(0.1)
    beta1: float = number(0.9, ge=0, lt=1)
    beta2: float = number(0.95, ge=0, lt=1)
    eps: float = positive(1e-8)
    clip_grad: float | None = positive(1.0)
    moments_dtype: str = choice("float32", "bfloat16")  # Adam's moments between steps (updated in fp32)


@dataclass(frozen=True)
class DataConfig:
    """Training data: `paths` of prepared token directories (`python -m mlm_jax.data.prepare`), blended by
    `weights` (default: by size); without paths, the embedded corpus (the standard library's sources, bytes).
    `tokenizer` (byte or a tokenizer.json path) must be the one the directories were prepared with.
    `max_bytes` caps the embedded corpus. Fine-tuning data (prepared from chat or prompt/completion records) carries
    a loss mask and is packed."""

    paths: list | None = None
    weights: list | None = None
    tokenizer: str = "byte"
    validation_fraction: float = number(0.05, gt=0, lt=1)
    max_bytes: int | None = positive(None)
    # each document of a window attends only to itself, its positions count from its start, and the target after its
    # end-of-document token is not trained on (`data/documents.py`); null: for prepared directories and packed rows,
    # not for the embedded corpus's windows (`masks_documents`)
    document_masking: bool | None = None
    # whole examples packed into rows (`data/packing.py`), each its own segment; null: where the directories hold
    # loss masks (fine-tuning data)
    packing: bool | None = None
    long_examples: str = choice("refuse", "truncate")  # an example longer than a row of train.seq_len + 1 tokens

    @property
    def masks_documents(self) -> bool:
        """`document_masking`, or by default whether the data is prepared directories or packed. The embedded
        corpus's windows of 2048 tokens hold one source file in the median (3 at the 99th percentile), so masks
        change little of what it trains, for a step 6% slower on one H100 or H200 (benchmarks/RESULTS.md)."""
        if self.document_masking is not None:
            return self.document_masking
        return bool(self.paths) or bool(self.packing)


@dataclass(frozen=True)
class CheckpointConfig:
    """Sharded async checkpoints. `dir` defaults to `<train.output_dir>/checkpoints`; `every: 0` saves only at the
    end (and on SIGTERM/SIGINT); `save: false` never saves on its own (benchmarks, sweeps: a signal then stops
    training without a checkpoint; `Trainer.save()` still writes one). `resume`: auto (the newest in `dir`, if any),
    none, or a checkpoint path.
    `init_from`: start a new run from another checkpoint's weights (fresh optimizer). Resuming with another
    `train.seed` or data blend than the checkpoint recorded changes the data order and is refused unless
    `allow_data_change` is set."""

    dir: str | None = None
    every: int = non_negative(0)
    save: bool = True
    keep: int = positive(3)
    resume: str = "auto"
    init_from: str | None = None
    allow_data_change: bool = False


@dataclass(frozen=True)
class LogConfig:
    """`profile_steps: [a, b]` writes a jax.profiler trace of steps a..b (1-based, inclusive) to `profile_dir`
    (default `<train.output_dir>/profile`). `tensorboard` writes the logged metrics to
    `<train.output_dir>/tensorboard`; `wandb_project` also to a Weights & Biases run there (the `wandb` extra)."""

    sharding_report: bool = False
    progress: str = choice("auto", "always", "never")
    profile_steps: list | None = None
    profile_dir: str | None = None
    tensorboard: bool = True
    wandb_project: str | None = None


@dataclass(frozen=True)
class EvalConfig:
    """lm-evaluation-harness `tasks` run on the model being trained, every `every` steps and at the end (no tasks
    or `every: 0` = off), each run one record of `eval/<task>/<metric>` in metrics.jsonl. `limit` caps the
    documents per task, `include_path` is a directory of further task YAMLs, `batch_size` the sequences per
    forward pass."""

    tasks: list | None = None
    every: int = non_negative(1000)
    limit: int | None = positive(None)
    include_path: str | None = None
    batch_size: int = positive(8)


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
    eval: EvalConfig = field(default_factory=EvalConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_SECTION_TYPES = {k: v for k, v in typing.get_type_hints(Config).items() if k != "name"}
SECTIONS = tuple(_SECTION_TYPES)

def _keys(prefix: str, tp) -> list[str]:
    """Dotted keys of a config dataclass, nested sections (`model.moe.top_k`) spelled out."""
    hints = typing.get_type_hints(tp)
    return [k for f in dataclasses.fields(tp) for k in
            (_keys(f"{prefix}.{f.name}", hints[f.name]) if dataclasses.is_dataclass(hints[f.name])
             else [f"{prefix}.{f.name}"])]


def _all_keys() -> list[str]:
    return [k for s, t in _SECTION_TYPES.items() for k in _keys(s, t)]


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


def model_from_dict(values: dict) -> ModelConfig:
    """A model section from its dict form (a checkpoint's record); keys it lacks (older checkpoints) take their
    defaults."""
    m = ModelConfig()
    for k, v in values.items():
        m = _set(m, k, f"model.{k}", v)
    return m


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


def parse_config(path: str | os.PathLike | None = None, overrides: typing.Iterable[str] = ()) -> Config:
    """Defaults, then the YAML file at `path`, then `section.key=value` overrides, each checked against its field's
    type; the rules on values are `mlm_jax.validation`'s (`load_config` runs both)."""
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
    return cfg


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
