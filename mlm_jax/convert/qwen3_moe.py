"""Qwen3-MoE in Hugging Face terms: Qwen3's attention (QK-norm, explicit head dim) with softmax-routed experts.

Built on `llama`, whose entries, config checks and keys this reuses. HF keeps one tensor per (layer,
expert), a Linear (out, in); we stack both, as for Mixtral (`mixtral`). Layer i is sparse when it is not in
`mlp_only_layers` and (i + 1) % `decoder_sparse_step` == 0: our `moe.first_dense_layers` = step - 1,
`moe.every_n_layers` = step and `moe.dense_layers` = `mlp_only_layers`; the dense layers keep Qwen3's MLP
(`intermediate_size`), the experts theirs (`moe_intermediate_size`). `norm_topk_prob` is our
`moe.normalize_weights`. `output_router_logits` only asks HF to return the router's logits and is ignored.
"""
from __future__ import annotations

import dataclasses

from mlm_jax.config import ModelConfig, MoEConfig
from mlm_jax.convert import ConvertError, format, llama

ARCHITECTURE = "Qwen3MoeForCausalLM"


def _moe(path: str, name: str) -> format.Entry:
    return format.Entry(("blocks", "moe", *path.split("/")), f"model.layers.{{i}}.mlp.{name}", "linear")


ENTRIES = (
    *llama.ENTRIES,  # the dense layers' MLP pairs with `dense_blocks`
    _moe("router/kernel", "gate.weight"),
    _moe("experts/gate", "experts.{j}.gate_proj.weight"),
    _moe("experts/up", "experts.{j}.up_proj.weight"),
    _moe("experts/down", "experts.{j}.down_proj.weight"),
)


def layout(m: ModelConfig, shapes: dict) -> list[tuple[format.Entry, tuple[int, ...]]]:
    return format.layout(m, shapes, ENTRIES, "Qwen3-MoE")


def model_config(hf: dict) -> ModelConfig:
    """Our model section for a Qwen3-MoE `config.json`: Qwen3's checks, then the experts and their layers."""
    dense = llama.model_config({**hf, "architectures": ["Qwen3ForCausalLM"]})
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    top_k, step, ffn = hf.get("num_experts_per_tok"), hf.get("decoder_sparse_step", 1), hf.get("moe_intermediate_size")
    if not experts or top_k is None or ffn is None:
        raise ConvertError("config.json lacks num_experts, num_experts_per_tok or moe_intermediate_size")
    if not 1 <= top_k <= experts:
        raise ConvertError(f"num_experts_per_tok={top_k} with num_experts={experts}: expected 1 to {experts} "
                           f"experts per token")
    if not isinstance(step, int) or step < 1:
        raise ConvertError(f"decoder_sparse_step={step!r}: expected a positive integer")
    moe = MoEConfig(num_experts=experts, top_k=top_k, expert_ffn_size=ffn, capacity_factor=None, router="softmax",
                    aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)), z_loss_coef=0.0, shared_experts=0,
                    every_n_layers=step, first_dense_layers=step - 1,
                    dense_layers=sorted(hf.get("mlp_only_layers") or []) or None,
                    normalize_weights=bool(hf.get("norm_topk_prob", False)))
    m = dataclasses.replace(dense, moe=moe)
    if not any(moe.is_moe_layer(i) for i in range(m.num_layers)):
        raise ConvertError(f"decoder_sparse_step={step} and mlp_only_layers={hf.get('mlp_only_layers')} leave no "
                           f"sparse layer among num_hidden_layers={m.num_layers}")
    return m


def hf_config(m: ModelConfig, dtype: str, carried: dict) -> dict:
    """`config.json` (Qwen3MoeForCausalLM) for `m`: Qwen3's attention and a softmax router, with the MoE layers
    where Qwen3-MoE can place them (every `decoder_sparse_step`-th layer, less `mlp_only_layers`)."""
    moe = m.moe
    step = moe.every_n_layers
    layout_ok = moe.first_dense_layers == step - 1
    for unsupported, what in (
            (not m.qk_norm, "model.qk_norm=false"),
            (moe.router != "softmax", f"model.moe.router={moe.router}"),
            (moe.router_bias_update != 0, f"model.moe.router_bias_update={moe.router_bias_update}"),
            (moe.shared_experts, f"model.moe.shared_experts={moe.shared_experts}"),
            (not layout_ok, f"model.moe.first_dense_layers={moe.first_dense_layers} with every_n_layers={step}")):
        if unsupported:
            raise ConvertError(f"{what} cannot be exported (Qwen3-MoE: QK-norm, a softmax router without bias, no "
                               f"shared experts, MoE layers at every decoder_sparse_step-th layer)")
    config = llama.hf_config(m, dtype, {})
    return {**config, "architectures": [ARCHITECTURE], "model_type": "qwen3_moe", "num_experts": moe.num_experts,
            "num_experts_per_tok": moe.top_k, "moe_intermediate_size": m.expert_ffn, "decoder_sparse_step": step,
            "mlp_only_layers": list(moe.dense_layers or []), "norm_topk_prob": moe.normalize_weights,
            "router_aux_loss_coef": moe.aux_loss_coef, "output_router_logits": False, **carried}
