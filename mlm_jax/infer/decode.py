"""Prefill and decode steps of a trained `Transformer`, through decode-time blocks built from its weights
(`infer.blocks`): each layer on its own (unstacked), in model order, its norms folded and its products fused where
they can be.

Shapes: B batch, P prompt (padded), T new positions.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mlm_jax.infer.blocks import DecodeBlock, foldable, fusable
from mlm_jax.model.kernels import Kernels
from mlm_jax.model.transformer import Transformer, default_positions


def layer_state(block_state: dict, stack_block, fuse: bool) -> dict:
    """A trained layer's weights (`block_state`, of a block like `stack_block`) in the form its decode-time block
    takes: the pre-norms' gains multiplied into the weights they feed and the norms' scales set to the identity
    where the block folds (the same function), q/k/v and gate/up each one product where `fuse` and it fuses."""
    c = stack_block.c
    if not foldable(c):
        return block_state
    s = jax.tree.map(lambda w: w, block_state)  # a copy of the dicts: the caller's stay as they were
    attn, mlp = s["attn"], s["mlp"]
    for norm, module, linears in ((stack_block.attn_norm, "attn_norm", (attn["q"], attn["k"], attn["v"])),
                                  (stack_block.mlp_norm, "mlp_norm", [mlp[k] for k in ("up", "gate") if k in mlp])):
        gain_D = norm.offset + s[module]["scale"].astype(jnp.float32)
        for linear in linears:
            w = linear["kernel"]
            linear["kernel"] = (w.astype(jnp.float32) * gain_D.reshape(-1, *(1,) * (w.ndim - 1))).astype(w.dtype)
        s[module] = {**s[module], "scale": jnp.full_like(s[module]["scale"], 1.0 - norm.offset)}
    if not (fuse and fusable(c)):
        return s
    a = c.attention
    D, K, G, H = a.dim, a.kv_heads, a.num_heads // a.kv_heads, a.head_dim
    qkv = {"kernel": jnp.concatenate([attn["q"]["kernel"].reshape(D, K, G, H), attn["k"]["kernel"][:, :, None],
                                      attn["v"]["kernel"][:, :, None]], axis=2)}
    if a.qkv_bias:
        qkv["bias"] = jnp.concatenate([attn["q"]["bias"].reshape(K, G, H), attn["k"]["bias"][:, None],
                                       attn["v"]["bias"][:, None]], axis=1)
    s["attn"] = {**{k: v for k, v in attn.items() if k not in ("q", "k", "v")}, "qkv": qkv}
    if "gate" in mlp:
        gate_up = {"kernel": jnp.stack([mlp["gate"]["kernel"], mlp["up"]["kernel"]], axis=1)}
        s["mlp"] = {**{k: v for k, v in mlp.items() if k not in ("gate", "up")}, "gate_up": gate_up}
    return s


def layer_states(model: Transformer, fuse: bool = True) -> list[dict]:
    """Each layer's decode-time weights (`layer_state`), in model order. Decoding runs every layer at every step:
    a layer taken out of the stacked weights inside the decode loop would be copied at every step, once outside it
    is read in place."""
    out = []
    for (stack, _), start, count in model.runs:
        stacked = nnx.to_pure_dict(nnx.state(getattr(model, stack)))
        out += [layer_state(jax.tree.map(lambda w, i=i: w[i], stacked), getattr(model, stack), fuse)
                for i in range(start, start + count)]
    return out


def block_graphdef(model: Transformer, stack: str, kernels: Kernels, fuse: bool) -> nnx.GraphDef:
    """The structure of `stack`'s decode-time blocks, running `kernels`."""
    trained = getattr(model, stack)
    c = trained.c
    return nnx.graphdef(nnx.eval_shape(lambda: DecodeBlock(
        c, folded=foldable(c), fused=fuse and fusable(c), dtype=trained.attn_norm.dtype, param_dtype=jnp.float32,
        rngs=nnx.Rngs(0), kernels=kernels)))


def layer(model: Transformer, stack: str, i: int, kernels: Kernels = Kernels(), fuse: bool = True) -> DecodeBlock:
    """Layer `i` of `stack` as a decode-time block (`layer_state`): the same function as the trained layer."""
    stacked = nnx.to_pure_dict(nnx.state(getattr(model, stack)))
    state = layer_state(jax.tree.map(lambda w: w[i], stacked), getattr(model, stack), fuse)
    return nnx.merge(block_graphdef(model, stack, kernels, fuse), state)


def blocks(model: Transformer, layers: list[dict], kernels: Kernels, fuse: bool):
    """(decode-time block, local) for every layer in model order, unrolled whatever `scan_layers` says: each layer
    updates its own cache buffer in place. `layers`: `layer_states(model, fuse)`."""
    layers = iter(layers)
    for (stack, local), _, count in model.runs:
        graphdef = block_graphdef(model, stack, kernels, fuse)
        for _ in range(count):
            yield nnx.merge(graphdef, next(layers)), local


def prefill(model: Transformer, tokens_BP: jax.Array, lengths_B: jax.Array, length: int, layers: list[dict],
            kernels: Kernels, fuse: bool = True) -> tuple[jax.Array, list]:
    """Right-padded prompts (row b: `lengths_B[b]` tokens) -> (the logits after each prompt's last token, each
    layer's key/value cache for sequences of up to `length` positions, `infer.kv_cache`). `layers`:
    `layer_states(model, fuse)`."""
    positions_BP = default_positions(tokens_BP)
    x_BPD, cache = model.embed(tokens_BP), []
    for block, local in blocks(model, layers, kernels, fuse):
        x_BPD, layer_cache = block.prefill(x_BPD, positions_BP, local, lengths_B, length)
        cache.append(layer_cache)
    last_B1D = jnp.take_along_axis(x_BPD, (lengths_B - 1)[:, None, None], axis=1)
    return model.logits(last_B1D)[:, 0], cache


def decode(model: Transformer, tokens_BT: jax.Array, positions_BT: jax.Array, cache: list[dict], layers: list[dict],
           kernels: Kernels, fuse: bool = True) -> tuple[jax.Array, list]:
    """New tokens at `positions_BT` (each row's next positions) -> (their logits, the cache with them)."""
    x_BTD, out, row_scale_BT1 = model.embed(tokens_BT), [], None
    for (block, local), layer_cache in zip(blocks(model, layers, kernels, fuse), cache, strict=True):
        x_BTD, layer_cache, row_scale_BT1 = block.decode(x_BTD, positions_BT, local, layer_cache, row_scale_BT1)
        out.append(layer_cache)
    return model.logits(x_BTD), out
