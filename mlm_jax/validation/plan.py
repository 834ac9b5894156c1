"""The rules for running a config on given devices, checked in one pass before anything is traced or written, and
the plan they resolve: the degrees on these devices (counts, divisibility, layout), the microbatch count, and the
kernels the backend and the installed packages can run (`model.attention_impl=auto` and `model.moe.impl=auto` are
resolved here and nowhere else). A kernel that runs only under some conditions declares them where it is defined
(`model.attention.unavailable`, `ops.grouped_matmul.mgpu_unavailable`, `ops.te.missing`); this pass asks it, and the
trainer builds exactly what `plan` chose. The rules on the config alone are `validation.config`'s, run first.

Elsewhere `ConfigError` comes only from what must touch files or other processes to be checked: the data loader,
the checkpoint directory and its metadata, and the multi-process flags.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
from dataclasses import dataclass

import jax

from mlm_jax.config import Config, ConfigError
from mlm_jax.model import attention
from mlm_jax.model.kernels import Kernels
from mlm_jax.ops import grouped_matmul, te
from mlm_jax.parallel.mesh import data_parallel_degree, dcn_degrees, device_groups
from mlm_jax.parallel.rules import MESH_AXES
from mlm_jax.parallel.stages import chunk_sizes
from mlm_jax.validation import tasks
from mlm_jax.validation.config import check_config


# -- degrees --------------------------------------------------------------------------------------------------------
def _shown(degrees: dict[str, int], prefix: str) -> str:
    return " x ".join(f"parallel.{prefix}{a}={v}" for a, v in degrees.items() if v != 1) or "all 1"


def resolve_degrees(cfg: Config, num_devices: int) -> dict[str, int]:
    """Total degree of every mesh axis (in-host x DCN), the one -1 filled in, checked against the device count.

    Layout rules are `check_layout`'s; `plan` runs both.
    """
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
    t = cfg.train
    dp = data_parallel_degree(degrees)
    B, micro, M = t.global_batch_size, t.micro_batch_size, t.num_microbatches
    if micro and M and micro * dp * M != B:
        raise ConfigError(f"train.micro_batch_size={micro} x data-parallel degree {dp} x train.num_microbatches={M} "
                          f"!= train.global_batch_size={B}")
    if not micro:
        M = M or max(1, degrees["stage"])
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
    if P > 1 and m.moe.enabled and m.moe.aux_loss_scope == "global" and m.moe.aux_loss_coef > 0:
        raise ConfigError(f"model.moe.aux_loss_scope=global with parallel.stage={P}: the pipeline counts the expert "
                          f"loads per microbatch; use model.moe.aux_loss_scope=microbatch")
    if P > 1 and m.precision == "fp8_delayed":
        raise ConfigError(f"model.precision=fp8_delayed with parallel.stage={P}: the pipeline does not carry the "
                          f"delayed-scaling histories; use model.precision=fp8 (current scaling) or bf16")
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
    dcn = dcn_degrees(cfg)
    hosts = math.prod(dcn.values())
    if hosts == 1:
        return
    by_process, groups = device_groups(devices)
    if hosts != groups:
        raise ConfigError(f"{_shown(dcn, 'dcn_')} multiply to {hosts}, but the devices span {groups} "
                          f"{'process(es)' if by_process else 'slices'}")


# -- the backend ----------------------------------------------------------------------------------------------------
def attention_kernel(impl: str, dtype: str, platform: str) -> str:
    """`model.attention_impl` resolved: auto takes cuDNN flash attention on GPUs for 16-bit inputs, XLA's fused
    softmax elsewhere."""
    if impl != "auto":
        return impl
    return "cudnn" if platform == "gpu" and dtype in ("bfloat16", "float16") else "xla"


def _packed_segments(cfg: Config, kernel: str, d: dict[str, int], capability: str) -> int:
    """The documents a row may hold for cuDNN's packed layout (`ops.packed_attention`), 0 where segments go through
    a mask: other kernels, GPUs before Hopper, context parallelism (its blocks split documents), and latent
    attention (whose value heads differ from its query heads)."""
    bound = cfg.model.max_segments_per_row
    if kernel != "cudnn" or d["context"] > 1 or cfg.model.mla.enabled or float(capability or 0) < 9.0:
        return 0
    return max(1, cfg.train.seq_len // 64) if bound is None else bound


def _check_backend(cfg: Config, d: dict[str, int], platform: str, device_kind: str,
                   device_capability: str = "", gpu_here: bool = True) -> tuple[Kernels, str, str | None]:
    """The kernels this run will use, after checking the chosen ones can run here, and their names for the
    start-up report (attention, experts). `gpu_here`: this process has a GPU of its own (without one, GPU devices
    are described for compilation only, by the layout planner, and the Mosaic grouped matmul's weight gradient is
    compiled in its stand-in, `ops.grouped_matmul`'s `mgpu-compile`)."""
    m = cfg.model
    dtype = m.dtype
    for key, value in (("attention_impl", m.attention_impl), ("precision", m.precision)):
        if value in ("te", "fp8_te") and (reason := te.missing()):
            raise ConfigError(f"model.{key}={value} needs Transformer Engine (transformer_engine.jax), which does not "
                              f"import here ({reason})")
    if cfg.data.masks_documents and m.attention_impl == "te":
        setting = "true" if cfg.data.document_masking else "null (on for prepared directories)"
        raise ConfigError(f"data.document_masking={setting} with model.attention_impl=te: the Transformer Engine "
                          "kernel here keeps no documents apart; use model.attention_impl=auto, or "
                          "data.document_masking=false to let documents see each other")
    kernel = attention_kernel(m.attention_impl, dtype, platform)
    if reason := attention.unavailable(kernel, dtype, platform):
        key = f"model.attention_impl={m.attention_impl}" if m.attention_impl == kernel else f"model.dtype={dtype}"
        raise ConfigError(f"{key}: {reason}")
    width = m.mla.qk_head_dim if m.mla.enabled else m.dim_per_head
    if kernel == "cudnn" and not gpu_here and width > 128:
        raise ConfigError(f"model.attention_impl={m.attention_impl}: cuDNN flash attention at head dim {width} (over "
                          "128) compiles only in a process with a GPU (jax checks the head dim against its own "
                          "device); plan this model on a GPU machine, or with model.attention_impl=xla (whose "
                          "memory counts the attention scores)")
    chosen = {"cudnn": "cudnn (flash attention)", "xla": "xla", "te": "te (Transformer Engine fused attention)"}
    attn = chosen[kernel]
    if m.attention_impl == "auto" and kernel == "xla":
        attn += f" (cudnn: {attention.unavailable('cudnn', dtype, platform).split(';')[0]})"
    if d["context"] > 1:
        attn += f", context-parallel {cfg.parallel.context_strategy} over {d['context']} ranks"
    kernels = Kernels(attention=kernel, packed_segments=_packed_segments(cfg, kernel, d, device_capability))
    if kernels.packed_segments:
        attn += f", documents through the packed layout (up to {kernels.packed_segments} a row)"
    if not m.moe.enabled:
        return kernels, attn, None
    if m.moe.capacity_factor is not None:
        return kernels, attn, "capacity (batched einsums)"
    F_local = m.expert_ffn // d["tensor"]
    reason = grouped_matmul.mgpu_unavailable(dtype, m.hidden_size, F_local, platform, device_kind)
    if m.moe.impl == "mgpu" and reason:
        raise ConfigError(f"model.moe.impl=mgpu: {reason}; use model.moe.impl=auto or ragged")
    if m.moe.impl == "ragged" or reason:
        why = f" (mgpu: {reason})" if m.moe.impl == "auto" else ""
        return kernels, attn, f"dropless, jax.lax.ragged_dot{why}"
    if not gpu_here:
        return (dataclasses.replace(kernels, experts="mgpu-compile"), attn,
                "dropless, mgpu (Pallas Mosaic-GPU grouped GEMM; the weight gradient's stand-in: compiled only)")
    return dataclasses.replace(kernels, experts="mgpu"), attn, "dropless, mgpu (Pallas Mosaic-GPU grouped GEMM)"


@dataclass(frozen=True)
class Plan:
    """What a run is built from: the resolved degrees, the microbatch count, the kernels chosen (before the layout
    adds its own, `parallel.kernels.layout_kernels`), and their names as the start-up report prints them."""

    degrees: dict[str, int]
    accum_steps: int
    kernels: Kernels
    attention: str
    experts: str | None


def plan(cfg: Config, devices) -> Plan:
    """Every rule for running `cfg` on `devices`, before anything is traced; raises `ConfigError`."""
    check_config(cfg)
    devices = list(devices)
    degrees, M = check_degrees(cfg, len(devices))
    _check_hosts(cfg, devices)
    kernels, attn, experts = _check_backend(cfg, degrees, devices[0].platform, devices[0].device_kind,
                                            getattr(devices[0], "compute_capability", ""),
                                            gpu_here=jax.default_backend() == "gpu")
    _check_matmul_impl(cfg.train.matmul_impl, devices[0].platform)
    _check_eval_tasks(cfg)
    _check_dashboards(cfg)
    return Plan(degrees, M, kernels, attn, experts)


TRITON_GEMM = "xla_gpu_enable_triton_gemm"


def _check_matmul_impl(impl: str, platform: str) -> None:
    if impl == "cublas" and platform != "gpu":
        raise ConfigError(f"train.matmul_impl=cublas: cuBLAS needs GPUs, the devices here are {platform}; use "
                          f"train.matmul_impl=auto or xla")


def matmuls(impl: str, platform: str, microbatches: int, pipelined: bool, xla_flags: str | None = None
            ) -> tuple[dict, str | None]:
    """`train.matmul_impl` resolved: (the train step's XLA compiler options, their name for the start-up report);
    `pipelined`: the step runs the pipeline executor. Off GPUs there is no choice to make (`plan` has refused
    `cublas` there).

    XLA's autotuner times Triton against cuBLAS for each product alone and keeps the faster; for a microbatch's
    smaller products it keeps Triton more often, and in the step those run slower than cuBLAS would: llama-1b on an
    H100 with cuBLAS for every product, +2.0-2.3% at 4 microbatches, +1.4-1.9% at 8 and +2.2% for the 3B shape at 4,
    -0.9% for one batch of 8 (RESULTS.md, 2026-12-06). In the pipeline executor it gained 0.8% but raised the peak
    memory by 0.7 GiB (1.7 with unequal chunks). So auto turns Triton's GEMMs off where the step accumulates
    microbatches outside the pipeline executor, unless `XLA_FLAGS` (`xla_flags`, the environment's by default)
    already says: the user's flag decides."""
    if platform != "gpu":
        return {}, None
    if impl == "auto" and TRITON_GEMM in (os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags):
        return {}, f"as XLA_FLAGS sets --{TRITON_GEMM}"
    if impl == "cublas" or (impl == "auto" and microbatches > 1 and not pipelined):
        return {TRITON_GEMM: False}, "cublas" + (f" (auto: {microbatches} microbatches)" if impl == "auto" else "")
    return {}, "xla (its autotuner: Triton or cuBLAS per product)"


def _check_dashboards(cfg: Config) -> None:
    """The packages of the run's dashboards installed: tensorboardX (a dependency, but a bare checkout may lack it)
    and, when the run logs to Weights & Biases, wandb."""
    if cfg.log.tensorboard and importlib.util.find_spec("tensorboardX") is None:
        raise ConfigError("log.tensorboard=true: the tensorboardX package is not installed (pip install -e ., or "
                          "log.tensorboard=false)")
    if cfg.log.wandb_project is not None and importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"log.wandb_project={cfg.log.wandb_project}: the wandb package is not installed "
                          f"(pip install 'mlm_jax[wandb]')")


def _check_eval_tasks(cfg: Config) -> None:
    """lm-eval installed, and the tasks known to it, when training evaluates them."""
    e = cfg.eval
    if not (e.tasks and e.every):
        return
    if reason := tasks.missing():
        raise ConfigError(f"eval.tasks={e.tasks}: {reason}")
    if e.include_path is not None and not os.path.isdir(e.include_path):
        raise ConfigError(f"eval.include_path={e.include_path}: not a directory")
    if reason := tasks.unknown_task(e.tasks, e.include_path):
        raise ConfigError(f"eval.tasks={e.tasks}: {reason}")
