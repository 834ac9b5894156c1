"""Every rule a run's configuration must satisfy, checked in one pass before anything is traced or written.

Each rule raises `ConfigError` with one line naming the key, the value and what is allowed. Three kinds:

- fields: the choices and bounds that each field of `config.py` declares beside itself (`choice`, `number`);
- the config across fields (heads, MoE layers, schedules, data blends), which needs no devices (`check_config`,
  run by `load_config`);
- the run (`plan`): the degrees on the given devices (counts, divisibility, layout) and what the backend and the
  installed packages can run. A kernel that runs only under some conditions declares them where it is defined
  (`layers.attention.unavailable`, `layers.experts.mgpu_unavailable`, `layers.te.missing`); this pass asks it,
  and the trainer builds exactly what `plan` chose.

Elsewhere `ConfigError` comes only from what must touch files or other processes to be checked: the data loader,
the checkpoint directory and its metadata, and the multi-process flags.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import typing
from dataclasses import dataclass

from mlm_jax.config import Config, ConfigError, MoEConfig, RopeScalingConfig

DEGREE_KEYS = ("data", "stage", "fsdp", "context", "expert", "tensor")  # parallel.<axis>, the mesh axes' degrees


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
    from mlm_jax.parallel.rules import make_rules  # the table's own parser names the bad entry
    make_rules(p.rules, p.sequence_parallel)
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
    if a.v_head_dim > a.qk_nope_head_dim + a.qk_rope_head_dim:
        raise ConfigError(f"model.mla.v_head_dim={a.v_head_dim} exceeds the query/key head dim "
                          f"{a.qk_nope_head_dim + a.qk_rope_head_dim} (qk_nope_head_dim + qk_rope_head_dim)")
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


# -- degrees --------------------------------------------------------------------------------------------------------
def _shown(degrees: dict[str, int], prefix: str) -> str:
    return " x ".join(f"parallel.{prefix}{a}={v}" for a, v in degrees.items() if v != 1) or "all 1"


def resolve_degrees(cfg: Config, num_devices: int) -> dict[str, int]:
    """Total degree of every mesh axis (in-host x DCN), the one -1 filled in, checked against the device count.

    Layout rules are `check_layout`'s; `plan` runs both.
    """
    from mlm_jax.parallel.mesh import dcn_degrees
    from mlm_jax.parallel.rules import MESH_AXES
    p, dcn = cfg.parallel, dcn_degrees(cfg)
    hosts = math.prod(dcn.values())
    if num_devices % hosts:
        raise ConfigError(f"{_shown(dcn, 'dcn_')} multiply to {hosts}, which does not divide the {num_devices} devices")
    per_host = num_devices // hosts
    where = f"{per_host} devices" + (f" per DCN group ({_shown(dcn, 'dcn_')})" if hosts > 1 else "")
    degrees = {a: getattr(p, a) for a in MESH_AXES}
    known = math.prod(v for v in degrees.values() if v != -1)
    rest = [a for a, v in degrees.items() if v == -1]
    if rest:
        if per_host % known:
            raise ConfigError(
                f"parallel.{rest[0]}=-1: the other degrees multiply to {known}, which does not divide "
                f"the {where}")
        degrees[rest[0]] = per_host // known
    product = math.prod(degrees.values())
    if product != per_host:
        raise ConfigError(f"parallel degrees ({_shown(degrees, '')}) multiply to {product}, but {where} are present")
    return {a: degrees[a] * dcn[a] for a in MESH_AXES}


def accumulation_steps(cfg: Config, degrees: dict[str, int]) -> int:
    """Microbatches per step, M: global batch = micro batch x data-parallel degree x M.

    `train.micro_batch_size` and `train.num_microbatches` describe the same split; without either, M is 1 (or the
    pipeline depth, the fewest microbatches that fill a pipeline).
    """
    from mlm_jax.parallel.mesh import data_parallel_degree
    t = cfg.train
    dp = data_parallel_degree(degrees)
    B, micro, M = t.global_batch_size, t.micro_batch_size, t.num_microbatches
    if micro and M and micro * dp * M != B:
        raise ConfigError(f"train.micro_batch_size={micro} x data-parallel degree {dp} x train.num_microbatches={M} "
                          f"!= train.global_batch_size={B}")
    if not micro:
        M = M or (degrees["stage"] if degrees["stage"] > 1 else 1)
        if B % (dp * M):
            what = f"train.num_microbatches={M} x " if M > 1 else ""
            raise ConfigError(f"train.global_batch_size={B} is not divisible by {what}data-parallel degree {dp} "
                              f"(data x fsdp x expert)")
        return M
    if B % (dp * micro):
        raise ConfigError(f"train.global_batch_size={B} is not divisible by train.micro_batch_size={micro} x "
                          f"data-parallel degree {dp} (data x fsdp x expert)")
    return B // (dp * micro)


def check_degrees(cfg: Config, num_devices: int) -> tuple[dict[str, int], int]:
    """The degrees on `num_devices` devices and the microbatch count, with every rule they impose."""
    degrees = resolve_degrees(cfg, num_devices)
    return degrees, check_layout(cfg, degrees)


# -- the layout -----------------------------------------------------------------------------------------------------
def check_layout(cfg: Config, d: dict[str, int]) -> int:
    """What the degrees `d` require of the model and the batch; returns the microbatch count."""
    m, t = cfg.model, cfg.train
    P, V = d["stage"], cfg.parallel.virtual_stages
    if m.moe.enabled:
        _check_moe_layout(cfg, d)
    if V > 1 and P == 1:
        raise ConfigError(f"parallel.virtual_stages={V} needs pipeline stages (parallel.stage > 1)")
    if P > 1 and m.precision == "fp8_delayed":
        raise ConfigError(f"model.precision=fp8_delayed with parallel.stage={P}: the pipeline does not carry the "
                          f"delayed-scaling histories; use model.precision=fp8 (current scaling) or bf16")
    from mlm_jax.parallel.stages import chunk_sizes
    chunk_sizes(cfg.parallel.pipeline_layers, m, t.seq_len, P, V)
    if m.num_heads % d["tensor"]:
        raise ConfigError(f"model.num_heads={m.num_heads} is not divisible by parallel.tensor={d['tensor']}")
    if m.kv_heads % d["tensor"] and d["tensor"] % m.kv_heads:
        raise ConfigError(f"model.num_kv_heads={m.kv_heads} and parallel.tensor={d['tensor']}: one must divide the "
                          f"other (K/V heads split over the tensor ranks, or each repeated on the ranks sharing it)")
    cp = d["context"]
    if m.sliding_window is not None and cp > 1:
        raise ConfigError(f"model.sliding_window={m.sliding_window} with parallel.context={cp}: context-parallel "
                          f"attention has no sliding window; use parallel.context=1")
    if m.sliding_window is not None and m.attention_impl == "te":
        raise ConfigError(f"model.sliding_window={m.sliding_window} with model.attention_impl=te: the Transformer "
                          f"Engine kernel here is causal only; use model.attention_impl=auto")
    if cp > 1 and t.seq_len % (2 * cp):
        raise ConfigError(f"train.seq_len={t.seq_len} is not divisible by 2 x parallel.context={cp} (causal load "
                          f"balancing cuts the sequence into 2 x context chunks)")
    if cp > 1 and m.attention_impl == "te":
        raise ConfigError("model.attention_impl=te cannot serve parallel.context > 1: context-parallel attention "
                          "runs cudnn (GPU) or xla blocks; use model.attention_impl=auto")
    if t.seq_len % (t.loss_chunks * cp):
        within = f" x parallel.context={cp}" if cp > 1 else ""
        raise ConfigError(f"train.loss_chunks={t.loss_chunks}{within} does not divide train.seq_len={t.seq_len} (the "
                          f"chunks interleave the positions of each device's part of the sequence)")
    M = accumulation_steps(cfg, d)
    if P > 1 and M < P:
        raise ConfigError(f"{M} microbatch(es) cannot fill parallel.stage={P} pipeline stages: set "
                          f"train.num_microbatches >= {P}")
    if P > 1 and V > 1 and M % P:
        raise ConfigError(f"train.num_microbatches={M} must be a multiple of parallel.stage={P} with "
                          f"parallel.virtual_stages={V}")
    if m.moe.enabled and m.moe.capacity_factor is not None:
        _check_capacity_groups(cfg, d, M)
    return M


def _check_moe_layout(cfg: Config, d: dict[str, int]) -> None:
    moe = cfg.model.moe
    if moe.num_experts % d["expert"]:
        raise ConfigError(f"model.moe.num_experts={moe.num_experts} is not divisible by parallel.expert={d['expert']}")
    F, tp = cfg.model.expert_ffn, d["tensor"]
    if F % tp:
        raise ConfigError(f"model.moe.expert_ffn_size={F} is not divisible by parallel.tensor={tp} (each tensor rank "
                          f"holds a slice of every expert's ffn dim)")


def _check_capacity_groups(cfg: Config, d: dict[str, int], M: int) -> None:
    """Capacity is counted per group of rows (`model.moe.capacity_group_rows`): a device must hold whole groups,
    so that every layout drops the same assignments."""
    from mlm_jax.parallel.mesh import data_parallel_degree
    moe = cfg.model.moe
    g = moe.capacity_group_rows
    if d["context"] > 1:
        raise ConfigError(f"model.moe.capacity_factor={moe.capacity_factor} with parallel.context={d['context']}: "
                          f"capacity groups are whole batch rows (model.moe.capacity_group_rows={g}), which context "
                          f"parallelism splits; use dropless experts (capacity_factor: null)")
    rows = cfg.train.global_batch_size // M // data_parallel_degree(d)
    if rows % g:
        raise ConfigError(f"model.moe.capacity_group_rows={g} does not divide the {rows} batch row(s) each device "
                          f"holds per forward pass (train.global_batch_size={cfg.train.global_batch_size} / {M} "
                          f"microbatch(es) / data-parallel degree {data_parallel_degree(d)}): capacity groups must "
                          f"not straddle devices")


def _check_hosts(cfg: Config, devices) -> None:
    from mlm_jax.parallel.mesh import dcn_degrees, device_groups
    dcn = dcn_degrees(cfg)
    hosts = math.prod(dcn.values())
    if hosts == 1:
        return
    by_process, groups = device_groups(devices)
    if hosts != groups:
        raise ConfigError(f"{_shown(dcn, 'dcn_')} multiply to {hosts}, but the devices span {groups} "
                          f"{'process(es)' if by_process else 'slices'}")


# -- the backend ----------------------------------------------------------------------------------------------------
def _check_backend(cfg: Config, d: dict[str, int], platform: str, device_kind: str) -> tuple[str, str | None]:
    """The attention and expert kernels this run will use, after checking the chosen ones can run here."""
    from mlm_jax.layers import attention, te
    from mlm_jax.layers import experts as ex
    m = cfg.model
    dtype = m.dtype
    for key, value in (("attention_impl", m.attention_impl), ("precision", m.precision)):
        if value in ("te", "fp8_te") and (reason := te.missing()):
            raise ConfigError(f"model.{key}={value} needs Transformer Engine (transformer_engine.jax), which does not "
                              f"import here ({reason})")
    kernel = attention.kernel_for(m.attention_impl, dtype, platform)
    if reason := attention.unavailable(kernel, dtype, platform):
        key = f"model.attention_impl={m.attention_impl}" if m.attention_impl == kernel else f"model.dtype={dtype}"
        raise ConfigError(f"{key}: {reason}")
    chosen = {"cudnn": "cudnn (flash attention)", "xla": "xla", "te": "te (Transformer Engine fused attention)"}
    attn = chosen[kernel]
    if m.attention_impl == "auto" and kernel == "xla":
        attn += f" (cudnn: {attention.unavailable('cudnn', dtype, platform).split(';')[0]})"
    if d["context"] > 1:
        attn += f", context-parallel {cfg.parallel.context_strategy} over {d['context']} ranks"
    if not m.moe.enabled:
        return attn, None
    if m.moe.capacity_factor is not None:
        return attn, "capacity (batched einsums)"
    F_local = m.expert_ffn // d["tensor"]
    reason = ex.mgpu_unavailable(dtype, m.hidden_size, F_local, platform, device_kind)
    if m.moe.impl == "mgpu" and reason:
        raise ConfigError(f"model.moe.impl=mgpu: {reason}; use model.moe.impl=auto or ragged")
    if m.moe.impl == "ragged" or reason:
        why = f" (mgpu: {reason})" if m.moe.impl == "auto" else ""
        return attn, f"dropless, jax.lax.ragged_dot{why}"
    return attn, "dropless, mgpu (Pallas Mosaic-GPU grouped GEMM)"


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


def check_resume(cfg: Config, saved: dict, where: str) -> list[str]:
    """Resuming the checkpoint at `where`, whose resolved config was `saved` (`Config.to_dict()` form): refuses a
    changed data order unless `checkpoint.allow_data_change`; returns the allowed changes as `key old -> new`."""
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


@dataclass(frozen=True)
class Plan:
    """What a run is built from: the resolved degrees, the microbatch count and the kernels chosen (by name)."""

    degrees: dict[str, int]
    accum_steps: int
    attention: str
    experts: str | None


def plan(cfg: Config, devices) -> Plan:
    """Every rule for running `cfg` on `devices`, before anything is traced; raises `ConfigError`."""
    check_config(cfg)
    devices = list(devices)
    degrees, M = check_degrees(cfg, len(devices))
    _check_hosts(cfg, devices)
    attn, experts = _check_backend(cfg, degrees, devices[0].platform, devices[0].device_kind)
    _check_eval_tasks(cfg)
    return Plan(degrees, M, attn, experts)


def _check_eval_tasks(cfg: Config) -> None:
    """lm-eval installed, and the tasks known to it, when training evaluates them."""
    e = cfg.eval
    if not (e.tasks and e.every):
        return
    from mlm_jax.eval import tasks
    if reason := tasks.missing():
        raise ConfigError(f"eval.tasks={e.tasks}: {reason}")
    if e.include_path is not None and not os.path.isdir(e.include_path):
        raise ConfigError(f"eval.include_path={e.include_path}: not a directory")
    if reason := tasks.unknown_task(e.tasks, e.include_path):
        raise ConfigError(f"eval.tasks={e.tasks}: {reason}")
