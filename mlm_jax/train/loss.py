"""Next-token cross-entropy in fp32 (logits may arrive in bf16 and sharded over the vocabulary)."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def cross_entropy(logits_BSV: jax.Array, targets_BS: jax.Array) -> jax.Array:
    """Mean over all tokens of -log softmax(logits)[target]."""
    logits_BSV = logits_BSV.astype(jnp.float32)
    lse_BS = jax.nn.logsumexp(logits_BSV, axis=-1)
    # A masked sum rather than a gather: it partitions over a vocabulary sharded across devices.
    target_BS = jnp.sum(jnp.where(jnp.arange(logits_BSV.shape[-1]) == targets_BS[..., None], logits_BSV, 0.0), -1)
    return jnp.mean(lse_BS - target_BS)
