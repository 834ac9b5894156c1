"""Mixtral in Hugging Face terms: Mistral's attention and norms with a mixture-of-experts FFN in every layer.

Built on `llama`, whose entries, config checks and keys this reuses. Shapes: D model, E experts, F expert
ffn, L layers. HF keeps one tensor per (layer, expert), a Linear (out, in); we stack both: experts' gate and up
kernels are (L, E, D, F), down (L, E, F, D), the router (L, D, E). HF's routing is ours with `router: softmax`:
softmax over all E logits, the top k, renormalised to sum 1, no token ever dropped (`capacity_factor: null`).

`router_jitter_noise` (HF multiplies the FFN input by uniform noise, in training only) is ignored on import and
exported as 0.0; `output_router_logits` only asks HF to return the router's logits, so it is ignored too.
"""
from __future__ import annotations

import dataclasses

from mlm_jax.config import ModelConfig, MoEConfig
from mlm_jax.convert import ConvertError, format, llama

ARCHITECTURE = "MixtralForCausalLM"
DEFAULTS = {"num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001}  # MixtralConfig's


def _moe(path: str, name: str) -> format.Entry:
    return format.Entry(("blocks", "moe", *path.split("/")), f"model.layers.{{i}}.block_sparse_moe.{name}", "linear")


ENTRIES = (
    *(e for e in llama.ENTRIES if e.path[:2] != ("blocks", "mlp")),
    _moe("router/kernel", "gate.weight"),
    _moe("experts/gate", "experts.{j}.w1.weight"),
    _moe("experts/up", "experts.{j}.w3.weight"),
    _moe("experts/down", "experts.{j}.w2.weight"),
)


def layout(m: ModelConfig, shapes: dict) -> list[tuple[format.Entry, tuple[int, ...]]]:
    return format.layout(m, shapes, ENTRIES, "Mixtral")


def model_config(hf: dict) -> ModelConfig:
    """Our model section for a Mixtral `config.json`: Mistral's checks (sliding_window above all), then the MoE."""
    dense = llama.model_config({**hf, "architectures": ["MistralForCausalLM"]})
    experts, top_k, aux = (DEFAULTS[k] if hf.get(k) is None else hf[k] for k in DEFAULTS)
    if not 1 <= top_k <= experts:
        raise ConvertError(f"num_experts_per_tok={top_k} with num_local_experts={experts}: expected 1 to "
                           f"{experts} experts per token")
    moe = MoEConfig(num_experts=experts, top_k=top_k, expert_ffn_size=dense.ffn_size, capacity_factor=None,
                    router="softmax", aux_loss_coef=float(aux), z_loss_coef=0.0, shared_experts=0,
                    every_n_layers=1, first_dense_layers=0)
    return dataclasses.replace(dense, moe=moe)


def hf_config(m: ModelConfig, dtype: str, carried: dict) -> dict:
    """`config.json` (MixtralForCausalLM) for `m`, which must have Mixtral's shape: a softmax-routed MoE FFN in
    every layer and nothing Mixtral lacks. `capacity_factor` and `z_loss_coef` only shape training; the export
    routes dropless, as mlm_jax does with `capacity_factor: null`."""
    moe = m.moe
    for unsupported, what in (
            (m.norm != "rmsnorm", f"model.norm={m.norm}"),
            (m.activation != "swiglu", f"model.activation={m.activation}"),
            (m.qk_norm, "model.qk_norm=true"),
            (m.qkv_bias, "model.qkv_bias=true"),
            (moe.router != "softmax", f"model.moe.router={moe.router}"),
            (not moe.normalize_weights, "model.moe.normalize_weights=false"),
            (moe.router_bias_update != 0, f"model.moe.router_bias_update={moe.router_bias_update}"),
            (moe.shared_experts, f"model.moe.shared_experts={moe.shared_experts}"),
            (not all(moe.is_moe_layer(i) for i in range(m.num_layers)),
             f"model.moe.first_dense_layers={moe.first_dense_layers}, every_n_layers={moe.every_n_layers}")):
        if unsupported:
            raise ConvertError(f"{what} cannot be exported (Mixtral: RMSNorm, no biases or QK-norm, a softmax "
                               f"router without bias, no shared experts, an MoE FFN in every layer)")
    config = llama.hf_config(dataclasses.replace(m, ffn_size=m.expert_ffn), dtype, {})
    config.pop("attention_bias", None), config.pop("mlp_bias", None)
    return {**config, "architectures": [ARCHITECTURE], "model_type": "mixtral", "sliding_window": m.sliding_window,
            "num_local_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
            "router_aux_loss_coef": moe.aux_loss_coef, "router_jitter_noise": 0.0, "output_router_logits": False,
            **carried}
