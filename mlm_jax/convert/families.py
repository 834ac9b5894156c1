"""Which family converts what, both ways: an HF architecture name on the way in, our model config on the way out.
One table here, so the families never import each other to dispatch."""
from __future__ import annotations

from types import ModuleType

from mlm_jax.config import ModelConfig
from mlm_jax.convert import ConvertError, deepseek_v3, gemma3, llama, mixtral, qwen3_moe

BY_ARCHITECTURE = {**dict.fromkeys(llama.ARCHITECTURES, llama), mixtral.ARCHITECTURE: mixtral,
                   qwen3_moe.ARCHITECTURE: qwen3_moe, gemma3.ARCHITECTURE: gemma3,
                   deepseek_v3.ARCHITECTURE: deepseek_v3}
ARCHITECTURES = tuple(BY_ARCHITECTURE)


def for_architecture(arch) -> ModuleType:
    """The family that reads an HF `config.json` whose `architectures` starts with `arch`."""
    if arch not in ARCHITECTURES:
        raise ConvertError(f"architecture {arch!r} is not supported (expected one of {', '.join(ARCHITECTURES)})")
    return BY_ARCHITECTURE[arch]


def model_config(hf: dict) -> ModelConfig:
    """Our model section for an HF `config.json`, by its architecture's family."""
    return for_architecture((hf.get("architectures") or [None])[0]).model_config(hf)


def for_model(m: ModelConfig) -> ModuleType:
    """The family that names and lays out `m`'s tensors: DeepSeek-V3 for latent attention, Gemma 3 for post-norms,
    for a mixture of experts Qwen3-MoE (QK-norm) or Mixtral, else the Llama family (Llama, Mistral, Qwen2, Qwen3)."""
    if m.mla.enabled:
        return deepseek_v3
    if m.post_norms:
        return gemma3
    if m.moe.enabled:
        return qwen3_moe if m.qk_norm else mixtral
    return llama
