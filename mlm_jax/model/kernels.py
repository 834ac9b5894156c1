"""Which implementation each layer runs: one frozen value, resolved once and passed to the model when it is built
(Megatron Core's layer specs choose the same way), so that what a layer computes never depends on what happened to
be installed when it was traced.

`mlm_jax.validation.plan` resolves the training kernels (`model.attention_impl=auto`, `model.moe.impl=auto`) from
the devices and the layout, `parallel.kernels.layout_kernels` adds the layout's explicit-collective replacements, and
`mlm_jax.infer` adds the decode-step kernels. The default is the reference: XLA everywhere, what one CPU device runs.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Kernels:
    attention: str = "xla"  # the attention kernel: cudnn (flash attention), xla or te (Transformer Engine)
    experts: str = "ragged"  # dropless experts' grouped matmul: ragged, mgpu or mgpu-compile (`ops.grouped_matmul`)
    # products from the master weights (`linear.master_einsum`, `embed.master_take`): cast on their shard before
    # a gather, weight gradients from fp32 products (FSDP; per-layer gradient accumulation)
    master: bool = False
    # segments (packed documents) through cuDNN's packed layout for rows of up to this many, 0 = through a mask
    # (`ops.packed_attention`; Hopper GPUs, never with context parallelism, whose blocks split documents)
    packed_segments: int = 0
    # A layout's replacements for what needs explicit collectives (`parallel.kernels`), None = compute locally:
    attend: Callable | None = None  # `attention.local_attention`'s signature (context or pipeline-stage attention)
    expert_ffn: Callable | None = None  # `experts.expert_ffn`'s signature (expert parallelism)
    # Decode steps (`mlm_jax.infer`), None = XLA:
    few_rows: Callable | None = None  # `ops.gemv.einsum`: a bf16 product of a few rows
    cached_attention: Callable | None = None  # `ops.flash_decode.step`: a decode step's attention over the cache
    residual: Callable | None = None  # `ops.gemv.add_residual`: a residual add and the next RMSNorm's factor
    gated: Callable | None = None  # `ops.gemv.gated`: a gated MLP's gate/up product and activation

