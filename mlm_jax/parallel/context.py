"""Context parallelism: causal attention over a sequence sharded on the `context` mesh axis.

B batch, S sequence (global; a block's key length), L a rank's local sequence (2C), C chunk (S / 2cp), T a
block's query length, R context ranks, N query heads, K kv heads (N % K == 0), G = N / K, H head dim.

Layout. Causal attention gives late positions more keys than early ones, so the trainer permutes the sequence
once with `load_balance_order`: cut into 2cp chunks of C tokens, rank r holds chunk r (its "A") and chunk
2cp-1-r (its "B"); every rank then has the same amount of work. Only attention mixes positions, so nothing else
needs to know the order (positions for RoPE travel with the tokens).

Blocks. Rank r's queries meet the keys of rank s as C x C blocks that are either full or aligned causal, never
masked in between: s == r gives (A,A) and (B,B) causal (one call) plus (B,A) full; s < r gives (A_r,A_s) and
(B_r,A_s) full; s > r gives (B_r,A_s) and (B_r,B_s) full. So every step but the first is two full blocks of
static shape, chosen by index arithmetic on r and s and stacked along batch into one kernel call. Partial
results are merged by log-sum-exp in fp32 (online softmax); every query row sees its own diagonal at step 0, so
no lse is ever -inf.

Strategies. "allgather" gathers K and V (the K kv heads, never repeated to N) once and walks the ranks;
memory grows with S but there is one collective. "ring" passes K/V blocks to the next rank with `ppermute`
(cp - 1 transfers), issuing the next transfer before computing on the current block so the two overlap.

Manual axes. The shard_map is manual over every mesh axis, not only `context`: cuDNN attention's custom
partitioning fails inside a partially manual shard_map (seen with jax 0.11.2), so batch and heads are laid out
explicitly, as the default rules lay out attention's activations (`_manual_spec`).

Gradient of lse. The merge weights depend on each block's lse, so the kernel must differentiate it. The XLA
block is plain jnp (the lse `dot_product_attention` returns is `stop_gradient`-ed and cast to the input dtype).
The cuDNN residual has no gradient either (jax's cuDNN VJP drops its cotangent), and the public API exposes no
backward kernel that takes it, so `with_lse_gradient` adds the term in a custom VJP: d lse / d scores = P, hence
dq += scale dlse (P K) and dk += scale P^T (dlse q), both from one attention call with K as the values and its
VJP. That costs about one more attention forward+backward per block; a backward kernel taking the merged
out/lse (cuDNN's through Transformer Engine) would remove it. cuDNN also returns its lse in the input dtype
(bf16), which bounds the merge's relative accuracy near bf16 rounding.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from mlm_jax.parallel.rules import DATA_AXES

CONTEXT, TENSOR = "context", "tensor"

Kernel = Callable[..., tuple[jax.Array, jax.Array]]  # (q, k, v, causal, impl, mask) -> (out, lse_BTN)
# A masked score: finite, so that a query row with no key of its segment in a block gets a finite lse far below any
# real one (its output then weighs nothing in the merge, and no gradient is NaN), where -inf would give NaNs.
MASKED = -0.7 * float(np.finfo(np.float32).max)


def load_balance_order(seq_len: int, cp: int) -> np.ndarray:
    """`perm` with `x[:, perm]` rank-major: rank r's shard is chunk r then chunk 2cp-1-r."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} must be a multiple of 2 x context degree = {2 * cp}")
    chunks = np.arange(seq_len, dtype=np.int32).reshape(2 * cp, seq_len // (2 * cp))
    return np.concatenate([chunks[i] for r in range(cp) for i in (r, 2 * cp - 1 - r)])


def _jnp_attention(q_BTNH, k_BSKH, v_BSKH, causal: bool, mask_BTS=None):
    """XLA block: fp32 scores, plain autodiff through both outputs; `mask_BTS` keeps each query to its segment."""
    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    q_BTKGH = q_BTNH.reshape(B, T, K, N // K, H)
    s_BKGTS = jnp.einsum("btkgh,bskh->bkgts", q_BTKGH, k_BSKH, preferred_element_type=jnp.float32) / np.sqrt(H)
    if mask_BTS is not None:
        s_BKGTS = jnp.where(mask_BTS[:, None, None], s_BKGTS, MASKED)
    if causal:  # square and aligned top-left
        s_BKGTS = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s_BKGTS, -jnp.inf)
    lse_BKGT = jax.nn.logsumexp(s_BKGTS, axis=-1)
    p_BKGTS = jnp.exp(s_BKGTS - lse_BKGT[..., None]).astype(v_BSKH.dtype)
    out_BTKGH = jnp.einsum("bkgts,bskh->btkgh", p_BKGTS, v_BSKH, preferred_element_type=jnp.float32)
    return out_BTKGH.reshape(B, T, N, H).astype(q_BTNH.dtype), lse_BKGT.transpose(0, 3, 1, 2).reshape(B, T, N)


def _fused_attention(q_BTNH, k_BSKH, v_BSKH, causal: bool, impl: str, mask_BTS=None):
    """`jax.nn.dot_product_attention` with its lse (B T N, no gradient) in fp32."""
    mask = None if mask_BTS is None else mask_BTS[:, None]
    out_BTNH, lse_BTN = jax.nn.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, mask=mask,
                                                     scale=1 / np.sqrt(q_BTNH.shape[-1]), is_causal=causal,
                                                     implementation=impl, return_residual=True)
    return out_BTNH, jax.lax.stop_gradient(lse_BTN.astype(jnp.float32))


def with_lse_gradient(kernel: Kernel) -> Kernel:
    """`kernel` (whose lse carries no gradient) with the lse's gradient added in a custom VJP."""
    @functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
    def attention(q_BTNH, k_BSKH, v_BSKH, causal, impl, mask_BTS=None):
        return kernel(q_BTNH, k_BSKH, v_BSKH, causal, impl, mask_BTS)

    def fwd(q_BTNH, k_BSKH, v_BSKH, causal, impl, mask_BTS=None):
        out_BTNH, pullback, lse_BTN = jax.vjp(lambda q, k, v: kernel(q, k, v, causal, impl, mask_BTS),
                                              q_BTNH, k_BSKH, v_BSKH, has_aux=True)
        return (out_BTNH, lse_BTN), (pullback, q_BTNH, k_BSKH, mask_BTS)

    def bwd(causal, impl, res, cts):
        pullback, q_BTNH, k_BSKH, mask_BTS = res
        d_out_BTNH, d_lse_BTN = cts
        dq_BTNH, dk_BSKH, dv_BSKH = pullback(d_out_BTNH)
        # Attention with K as the values: its output is P K, and its VJP in the values is P^T x (summed over a
        # GQA group's query heads, as dk needs).
        pk_BTNH, p_t = jax.vjp(lambda vals: kernel(q_BTNH, k_BSKH, vals, causal, impl, mask_BTS)[0], k_BSKH)
        w_BTN1 = d_lse_BTN[..., None] / np.sqrt(q_BTNH.shape[-1])
        dq_BTNH = dq_BTNH + (w_BTN1 * pk_BTNH.astype(jnp.float32)).astype(dq_BTNH.dtype)
        dk_BSKH = dk_BSKH + p_t((w_BTN1 * q_BTNH.astype(jnp.float32)).astype(q_BTNH.dtype))[0]
        return dq_BTNH, dk_BSKH, dv_BSKH, None

    attention.defvjp(fwd, bwd)
    return attention


_fused_attention_with_lse_gradient = with_lse_gradient(_fused_attention)


def attention_with_lse(q_BTNH, k_BSKH, v_BSKH, *, causal: bool, impl: str,
                       mask_BTS: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """One block: output in q's dtype and fp32 lse (B T N), both differentiable. Causal blocks are square;
    `mask_BTS` keeps each query to the keys of its segment."""
    if impl == "xla":
        return _jnp_attention(q_BTNH, k_BSKH, v_BSKH, causal, mask_BTS)
    if impl == "cudnn":
        return _fused_attention_with_lse_gradient(q_BTNH, k_BSKH, v_BSKH, causal, impl, mask_BTS)
    raise ValueError(f"context-parallel attention supports impl 'xla' or 'cudnn', not {impl!r}")


def _merge(acc, out_BCNH, lse_BCN):
    """Online softmax: two partial results over disjoint keys -> one, in fp32."""
    acc_out_BCNH, acc_lse_BCN = acc
    lse_new_BCN = jnp.logaddexp(acc_lse_BCN, lse_BCN)
    return (acc_out_BCNH * jnp.exp(acc_lse_BCN - lse_new_BCN)[..., None]
            + out_BCNH.astype(jnp.float32) * jnp.exp(lse_BCN - lse_new_BCN)[..., None], lse_new_BCN)


def _merge_at(acc, i, out_BCNH, lse_BCN):
    """Merge into query chunk `i` (0 = A, 1 = B; may be traced) of the (B 2 C ...) accumulator."""
    acc_out_B2CNH, acc_lse_B2CN = acc
    part = (jax.lax.dynamic_index_in_dim(acc_out_B2CNH, i, 1, keepdims=False),
            jax.lax.dynamic_index_in_dim(acc_lse_B2CN, i, 1, keepdims=False))
    out_BCNH, lse_BCN = _merge(part, out_BCNH, lse_BCN)
    return (jax.lax.dynamic_update_index_in_dim(acc_out_B2CNH, out_BCNH, i, 1),
            jax.lax.dynamic_update_index_in_dim(acc_lse_B2CN, lse_BCN, i, 1))


def _mask(seg_q_BC, seg_k_BC):
    """[B, C, C] same-segment mask of a block, or None without segment ids."""
    return None if seg_q_BC is None else seg_q_BC[:, :, None] == seg_k_BC[:, None, :]


def _diagonal_step(q_B2CNH, k_B2CKH, v_B2CKH, impl, seg_q_B2C=None, seg_k_B2C=None):
    """Own keys: (A,A) and (B,B) causal in one call, (B,A) full; returns the fp32 accumulator."""
    B, _, C, N, H = q_B2CNH.shape
    flat = lambda x: x.reshape(2 * B, C, *x.shape[3:])  # (A, B) pairs of each sequence along batch: no copy
    flat_mask = None if seg_q_B2C is None else _mask(flat(seg_q_B2C), flat(seg_k_B2C))
    out, lse = attention_with_lse(flat(q_B2CNH), flat(k_B2CKH), flat(v_B2CKH), causal=True, impl=impl,
                                  mask_BTS=flat_mask)
    acc = out.reshape(B, 2, C, N, H).astype(jnp.float32), lse.reshape(B, 2, C, N)
    mask = None if seg_q_B2C is None else _mask(seg_q_B2C[:, 1], seg_k_B2C[:, 0])
    out_BCNH, lse_BCN = attention_with_lse(q_B2CNH[:, 1], k_B2CKH[:, 0], v_B2CKH[:, 0], causal=False, impl=impl,
                                           mask_BTS=mask)
    return _merge_at(acc, 1, out_BCNH, lse_BCN)


def _off_diagonal_step(acc, q_B2CNH, k_B2CKH, v_B2CKH, s, r, impl, seg_q_B2C=None, seg_k_B2C=None):
    """Keys of rank s != r: s < r gives (A_r,A_s), (B_r,A_s); s > r gives (B_r,A_s), (B_r,B_s); one call."""
    B, _, C, N, H = q_B2CNH.shape
    i = (s > r).astype(jnp.int32)  # query chunk of the first block, key chunk of the second
    pick = lambda x, j: jax.lax.dynamic_index_in_dim(x, j, 1, keepdims=False)
    pair = lambda x0, x1: jnp.stack([x0, x1], 1).reshape(2 * B, C, *x0.shape[2:])
    mask = None
    if seg_q_B2C is not None:
        mask = _mask(pair(pick(seg_q_B2C, i), seg_q_B2C[:, 1]), pair(seg_k_B2C[:, 0], pick(seg_k_B2C, i)))
    out, lse = attention_with_lse(pair(pick(q_B2CNH, i), q_B2CNH[:, 1]), pair(k_B2CKH[:, 0], pick(k_B2CKH, i)),
                                  pair(v_B2CKH[:, 0], pick(v_B2CKH, i)), causal=False, impl=impl, mask_BTS=mask)
    out_B2CNH, lse_B2CN = out.reshape(B, 2, C, N, H), lse.reshape(B, 2, C, N)
    acc = _merge_at(acc, i, out_B2CNH[:, 0], lse_B2CN[:, 0])
    return _merge_at(acc, 1, out_B2CNH[:, 1], lse_B2CN[:, 1])


def _local_attention(q_BLNH, k_BLKH, v_BLKH, seg_BL=None, *, strategy: str, impl: str, cp: int):
    """One rank's shard (L = 2C local tokens: chunks A and B) against every rank's keys; the keys' segment ids
    (`seg_BL`, where the batch has them) travel with them."""
    B, L, N, H = q_BLNH.shape
    chunks = lambda x: x.reshape(B, 2, L // 2, *x.shape[2:])
    q_B2CNH = chunks(q_BLNH)
    kv = (chunks(k_BLKH), chunks(v_BLKH)) + (() if seg_BL is None else (chunks(seg_BL),))
    seg_q_B2C = None if seg_BL is None else kv[2]
    r = jax.lax.axis_index(CONTEXT)
    if strategy == "allgather":
        gathered = [jax.lax.all_gather(x, CONTEXT, axis=1) for x in kv]
        owned = lambda s: tuple(jax.lax.dynamic_index_in_dim(x, s, 1, keepdims=False) for x in gathered)
    for t in range(cp):  # step t holds the keys of rank s = r - t (mod cp); step 0 is the diagonal
        s = (r - t) % cp
        if strategy == "allgather":
            block = owned(s)
        else:
            block = kv
            if t + 1 < cp:  # start the next block's transfer before computing on this one
                kv = jax.lax.ppermute(kv, CONTEXT, [(j, (j + 1) % cp) for j in range(cp)])
        k_B2CKH, v_B2CKH, *seg_k = block
        seg_k_B2C = seg_k[0] if seg_k else None
        if t == 0:
            acc = _diagonal_step(q_B2CNH, k_B2CKH, v_B2CKH, impl, seg_q_B2C, seg_k_B2C)
        else:
            acc = _off_diagonal_step(acc, q_B2CNH, k_B2CKH, v_B2CKH, s, r, impl, seg_q_B2C, seg_k_B2C)
    return acc[0].reshape(B, L, N, H).astype(q_BLNH.dtype)


def _manual_spec(mesh, q_BSNH, k_BSKH) -> P:
    """Layout of q, k, v and out in the shard_map: batch over the data axes, heads over `tensor`, as the default
    rules lay out attention's activations (another layout is correct too, but XLA reshards it at the boundary)."""
    free = [a for a in mesh.axis_names if a not in mesh.manual_axes]
    batch, ways = [], 1
    for a in DATA_AXES:
        if a in free and mesh.shape[a] > 1 and q_BSNH.shape[0] % (ways * mesh.shape[a]) == 0:
            batch.append(a)
            ways *= mesh.shape[a]
    t = mesh.shape[TENSOR]
    heads = TENSOR if TENSOR in free and t > 1 and q_BSNH.shape[2] % t == 0 and k_BSKH.shape[2] % t == 0 else None
    return P(tuple(batch) or None, CONTEXT, heads)


def context_attention(q_BSNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, *, mesh: Mesh, strategy: str,
                      impl: str, window: int | None = None, local: bool | jax.Array = True,
                      segment_ids: jax.Array | None = None) -> jax.Array:
    """Causal attention on a load-balanced sequence sharded over `context` (and batch/heads as `_manual_spec`),
    within each token's segment where `segment_ids` ([B, S], in the same order) say; sliding windows are refused
    (`validation` says so before anything is traced).

    The shard_map is manual over every mesh axis not manual already: cuDNN attention's custom partitioning fails
    inside a partially manual one (jax 0.11). Inside an outer `shard_map` (the pipeline's, over `stage`) the
    context mesh has that axis manual, and the inner one must be given that mesh rather than `mesh`.
    """
    context_mesh = jax.sharding.get_abstract_mesh()
    mesh = mesh if context_mesh.empty else context_mesh
    cp = mesh.shape[CONTEXT]
    if window is not None:
        raise ValueError(f"context-parallel attention has no sliding window (got {window})")
    if q_BSNH.shape[1] % (2 * cp):
        raise ValueError(f"sequence length {q_BSNH.shape[1]} must be a multiple of 2 x context degree = {2 * cp}")
    spec = _manual_spec(mesh, q_BSNH, k_BSKH)
    body = functools.partial(_local_attention, strategy=strategy, impl=impl, cp=cp)
    segs, seg_specs = ((), ()) if segment_ids is None else ((segment_ids,), (P(spec[0], CONTEXT),))
    return jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec) + seg_specs, out_specs=spec,
                         axis_names=set(mesh.axis_names) - set(mesh.manual_axes),
                         check_vma=False)(q_BSNH, k_BSKH, v_BSKH, *segs)
