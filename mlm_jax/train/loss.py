"""Next-token cross-entropy in fp32 (logits may arrive in bf16 and sharded over the vocabulary)."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def cross_entropy(logits_BSV: jax.Array, targets_BS: jax.Array) -> jax.Array:
    """Mean over all tokens of -log softmax(logits)[target]."""
    logits_BSV = logits_BSV.astype(jnp.float32)
    lse_BS = jax.nn.logsumexp(logits_BSV, axis=-1)
    target_BS = jnp.take_along_axis(logits_BSV, targets_BS[..., None], axis=-1)[..., 0]
    return jnp.mean(lse_BS - target_BS)
