"""Next-token cross-entropy in fp32 (logits may arrive in bf16 and sharded over the vocabulary), whole or in
chunks of the sequence so that the logits of the whole batch never exist at once.

A step's loss is Megatron's per-token loss: the sum over the target tokens that count (the loss mask) over how many
they are in the whole step, so each microbatch, pipeline microbatch and data-parallel rank adds its share and the
loss does not depend on the layout or the accumulation.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from mlm_jax.model import axes as ax
from mlm_jax.model.linear import CastWeight


def cross_entropy(logits_BSV: jax.Array, targets_BS: jax.Array, weights_BS: jax.Array | None = None,
                  count=None) -> jax.Array:
    """Sum over tokens of -log softmax(logits)[target], each token times its weight (`weights_BS`, the loss mask;
    all 1 without), over `count` (a microbatch's share of the step's mean: the step's token count; the mean over
    these tokens without)."""
    logits_BSV = logits_BSV.astype(jnp.float32)
    lse_BS = jax.nn.logsumexp(logits_BSV, axis=-1)
    # A masked sum rather than a gather: it partitions over a vocabulary sharded across devices.
    target_BS = jnp.sum(jnp.where(jnp.arange(logits_BSV.shape[-1]) == targets_BS[..., None], logits_BSV, 0.0), -1)
    nll_BS = lse_BS - target_BS
    if weights_BS is None and count is None:
        return jnp.mean(nll_BS)
    if weights_BS is not None:
        nll_BS = nll_BS * weights_BS
    return jnp.sum(nll_BS) / (token_count(targets_BS, weights_BS) if count is None else count)


def token_count(targets_BS: jax.Array, weights_BS: jax.Array | None = None):
    """The tokens whose targets count: the weights' sum, or every token (a Python int) without weights."""
    return targets_BS.size if weights_BS is None else jnp.sum(weights_BS.astype(jnp.float32))


def head_loss(model, x_BSD: jax.Array, targets_BS: jax.Array, chunks: int = 1, weights_BS: jax.Array | None = None,
              count=None) -> jax.Array:
    """`cross_entropy` of `model`'s final norm and output head on the last block's output `x_BSD`: through
    `model.logits` whole, or over `chunks` slices of the sequence (`train.loss_chunks`, `chunked_cross_entropy`)."""
    if chunks == 1:
        logits_BSV = model.logits(x_BSD)  # in the "head" scope
        with jax.named_scope("loss"):
            return cross_entropy(logits_BSV, targets_BS, weights_BS, count)
    with jax.named_scope("head"):
        x_BSD, weight, tied = model.head_input(x_BSD)
        if weights_BS is None:
            weights_BS = jnp.ones(targets_BS.shape, jnp.float32)
        count = token_count(targets_BS, None) if count is None else count
        return chunked_cross_entropy(x_BSD, weight, targets_BS, chunks, tied, model.softcap, weights_BS,
                                     jnp.asarray(count, jnp.float32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def chunked_cross_entropy(x_BSD: jax.Array, weight: jax.Array, targets_BS: jax.Array, chunks: int, tied: bool,
                          softcap: float | None, weights_BS: jax.Array | None = None, count=None) -> jax.Array:
    """`cross_entropy` of the logits `x_BSD @ weight` ([D, V], or the [V, D] embedding table if `tied`; stored in
    any dtype, multiplied in x's; or a `linear.CastWeight`, whose copy is multiplied and whose master takes the
    gradient), optionally soft-capped, computed over `chunks` interleaved slices of the sequence (positions s with
    s % chunks = c): only one slice's logits exist at a time. `weights_BS` and `count` as `cross_entropy`'s (the
    mean over every token without).

    The forward pass computes the gradients too, one slice at a time (the weight's summed in fp32), so that the
    backward pass only scales them: no logits are kept or recomputed. Interleaved slices keep a sequence sharded
    over devices (context parallelism) evenly split in every slice.
    """
    return _chunked(x_BSD, weight, targets_BS, chunks, tied, softcap, weights_BS, count, grads=False)[0]


def _chunked(x_BSD, weight, targets_BS, chunks, tied, softcap, weights_BS, count, grads=True):
    B, S, D = x_BSD.shape
    w = (weight.copy if isinstance(weight, CastWeight) else weight).astype(x_BSD.dtype)
    logits_eq, dx_eq, dw_eq = (("bsd,vd->bsv", "bsv,vd->bsd", "bsd,bsv->vd") if tied else
                               ("bsd,dv->bsv", "bsv,dv->bsd", "bsd,bsv->dv"))
    if weights_BS is None:
        weights_BS = jnp.ones(targets_BS.shape, jnp.float32)
    count = B * S if count is None else count

    def slices(a):  # [B, S, ...] -> [chunks, B, S / chunks, ...]: slice c holds the positions c, c + chunks, ...
        return jnp.moveaxis(a.reshape(B, S // chunks, chunks, *a.shape[2:]), 2, 0)

    def chunk(dw, xs):
        x_BsD, targets_Bs, weights_Bs = xs
        logits_BsV = jnp.einsum(logits_eq, x_BsD, w)
        logits_BsV = ax.constrain(logits_BsV, (ax.ACT_BATCH, ax.ACT_SEQ, ax.ACT_VOCAB)).astype(jnp.float32)
        if softcap is not None:
            capped_BsV = jnp.tanh(logits_BsV / softcap)
            logits_BsV = (softcap * capped_BsV).astype(x_BSD.dtype).astype(jnp.float32)
        lse_Bs = jax.nn.logsumexp(logits_BsV, axis=-1)
        hit_BsV = jnp.arange(logits_BsV.shape[-1]) == targets_Bs[..., None]
        loss = jnp.sum(weights_Bs * (lse_Bs - jnp.sum(jnp.where(hit_BsV, logits_BsV, 0.0), -1)))
        if not grads:
            return dw, (loss, None)
        d_BsV = (jnp.exp(logits_BsV - lse_Bs[..., None]) - hit_BsV) * (weights_Bs / count)[..., None]
        if softcap is not None:
            d_BsV = d_BsV * (1 - capped_BsV * capped_BsV)
        d_BsV = d_BsV.astype(x_BSD.dtype)
        dx_BsD = jnp.einsum(dx_eq, d_BsV, w, preferred_element_type=jnp.float32)
        dw = dw + jnp.einsum(dw_eq, x_BsD, d_BsV, preferred_element_type=jnp.float32)
        return dw, (loss, dx_BsD)

    dw, (losses, dx_cBsD) = jax.lax.scan(chunk, jnp.zeros(w.shape, jnp.float32) if grads else None,
                                         (slices(x_BSD), slices(targets_BS), slices(weights_BS)))
    if not grads:
        return jnp.sum(losses) / count, None
    dx_BSD = jnp.moveaxis(dx_cBsD, 0, 2).reshape(B, S, D)
    return jnp.sum(losses) / count, (dx_BSD, dw)


def _chunked_fwd(x_BSD, weight, targets_BS, chunks, tied, softcap, weights_BS=None, count=None):
    loss, (dx_BSD, dw) = _chunked(x_BSD, weight, targets_BS, chunks, tied, softcap, weights_BS, count)
    # empty arrays carry the inputs' dtypes for the gradients, which are kept in fp32 until scaled
    return loss, (dx_BSD, dw, *jax.tree.map(lambda a: jnp.zeros(0, a.dtype), (x_BSD, weight)))


def _chunked_bwd(chunks, tied, softcap, residuals, g):
    dx_BSD, dw, x_like, w_like = residuals
    if isinstance(w_like, CastWeight):  # the gradient is the master's; the copy gets none (`linear.copy_einsum`)
        dweight = CastWeight((g * dw).astype(w_like.master.dtype), jnp.zeros(dw.shape, w_like.copy.dtype))
    else:
        dweight = (g * dw).astype(w_like.dtype)
    return (g * dx_BSD).astype(x_like.dtype), dweight, None, None, None


chunked_cross_entropy.defvjp(_chunked_fwd, _chunked_bwd)
