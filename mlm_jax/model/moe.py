"""Mixture-of-experts FFN: a router picks `top_k` of `num_experts` SwiGLU experts per token.

Shapes: B batch, S sequence, D model, E experts, K top-k, F expert ffn.

Routing runs in fp32 on the global (automatically sharded) batch, so every statistic below is a global-batch
statistic whatever the layout: XLA turns the means into all-reduces. The experts themselves run through
`model.experts.expert_ffn`, or the layout's expert-parallel kernel (`Kernels.expert_ffn`), with the grouped matmul
`Kernels.experts` names.

- softmax router (Mixtral, Qwen3-MoE): softmax over all E logits, top-k, weights renormalised to sum 1 (unless
  `normalize_weights` is off).
- sigmoid router (DeepSeek-V3): sigmoid scores; the top-k are chosen on score + a per-expert `bias` that the
  trainer moves towards balanced load after each step (never by the gradient); weights are the chosen scores,
  renormalised. With `num_groups` > 1 the choice is limited to each token's `top_groups` best expert groups
  (`grouped`); `routed_scaling_factor` scales the weights.
- Load-balancing loss (Switch/GShard): E * sum_e f_e * p_e, f_e the fraction of assignments routed to expert e
  (no gradient), p_e the mean routing probability of e. Router z-loss: mean of logsumexp(logits)^2.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from mlm_jax.config import MoEConfig
from mlm_jax.model import axes as ax
from mlm_jax.model.experts import expert_ffn
from mlm_jax.model.kernels import Kernels
from mlm_jax.model.linear import param
from mlm_jax.model.mlp import MLP


@dataclass(frozen=True)
class MoELayerConfig:
    dim: int
    ffn: int  # per expert
    moe: MoEConfig


def grouped(choice_BSE: jax.Array, groups: int, top_groups: int) -> jax.Array:
    """`choice_BSE` with the experts outside each token's `top_groups` best groups at -inf: a group scores the sum
    of its two best experts (DeepSeek-V3's node-limited routing)."""
    B, S, E = choice_BSE.shape
    choice_BSGX = choice_BSE.reshape(B, S, groups, E // groups)
    group_BSG = jnp.sum(jax.lax.top_k(choice_BSGX, 2)[0], axis=-1)
    _, best_BST = jax.lax.top_k(group_BSG, top_groups)
    keep_BSG = jnp.any(jax.nn.one_hot(best_BST, groups, dtype=bool), axis=2)
    return jnp.where(keep_BSG[..., None], choice_BSGX, -jnp.inf).reshape(B, S, E)


class Router(nnx.Module):
    def __init__(self, dim: int, num_experts: int, *, std: float, with_bias: bool, param_dtype, rngs: nnx.Rngs):
        self.kernel = param(std * jax.random.normal(rngs.params(), (dim, num_experts), param_dtype), (ax.EMBED, None))
        if with_bias:
            self.bias = param(jnp.zeros((num_experts,), param_dtype), (None,))


class Experts(nnx.Module):
    """The experts' stacked SwiGLU weights; the expert dim shards over `expert`, the ffn dim over `tensor`."""

    def __init__(self, c: MoELayerConfig, *, std: float, out_std: float, param_dtype, rngs: nnx.Rngs):
        E, D, F = c.moe.num_experts, c.dim, c.ffn
        self.gate = param(std * jax.random.normal(rngs.params(), (E, D, F), param_dtype), (ax.EXPERTS, ax.EMBED, ax.MLP))
        self.up = param(std * jax.random.normal(rngs.params(), (E, D, F), param_dtype), (ax.EXPERTS, ax.EMBED, ax.MLP))
        self.down = param(out_std * jax.random.normal(rngs.params(), (E, F, D), param_dtype),
                          (ax.EXPERTS, ax.MLP, ax.EMBED))


class MoE(nnx.Module):
    def __init__(self, c: MoELayerConfig, *, std: float, out_std: float, dtype, param_dtype, rngs: nnx.Rngs,
                 precision: str = "bf16", fp8_history: int = 16, kernels: Kernels = Kernels()):
        self.c, self.dtype, self.kernels = c, dtype, kernels
        m = c.moe
        self.router = Router(c.dim, m.num_experts, std=std, with_bias=m.router == "sigmoid", param_dtype=param_dtype,
                             rngs=rngs)
        self.experts = Experts(c, std=std, out_std=out_std, param_dtype=param_dtype, rngs=rngs)
        if m.shared_experts:
            self.shared = MLP(c.dim, m.shared_experts * c.ffn, activation="swiglu", std=std, out_std=out_std,
                              dtype=dtype, param_dtype=param_dtype, rngs=rngs, precision=precision,
                              fp8_history=fp8_history, kernels=kernels)

    def route(self, x_BSD: jax.Array) -> tuple[jax.Array, jax.Array, dict]:
        """(experts_BSK, weights_BSK, statistics) for the tokens of `x_BSD`."""
        m = self.c.moe
        E, K = m.num_experts, m.top_k
        logits_BSE = jnp.einsum("bsd,de->bse", x_BSD.astype(jnp.float32), self.router.kernel[...].astype(jnp.float32))
        if m.router == "softmax":
            scores_BSE = probs_BSE = jax.nn.softmax(logits_BSE, axis=-1)
            choice_BSE = scores_BSE
        else:
            scores_BSE = jax.nn.sigmoid(logits_BSE)
            choice_BSE = scores_BSE + jax.lax.stop_gradient(self.router.bias[...].astype(jnp.float32))
            probs_BSE = scores_BSE / jnp.sum(scores_BSE, axis=-1, keepdims=True)
        if m.num_groups > 1:
            choice_BSE = grouped(choice_BSE, m.num_groups, m.top_groups)
        _, experts_BSK = jax.lax.top_k(choice_BSE, K)
        chosen_BSK = jnp.take_along_axis(scores_BSE, experts_BSK, axis=-1)
        weights_BSK = chosen_BSK / jnp.sum(chosen_BSK, axis=-1, keepdims=True) if m.normalize_weights else chosen_BSK
        if m.routed_scaling_factor != 1:
            weights_BSK = weights_BSK * m.routed_scaling_factor
        load_E = jnp.mean(jnp.sum(jax.nn.one_hot(experts_BSK, E, dtype=jnp.float32), axis=2), axis=(0, 1)) / K
        probs_E = jnp.mean(probs_BSE, axis=(0, 1))
        stats = {
            "aux_loss": balance_loss(load_E, probs_E),
            "z_loss": jnp.mean(jnp.square(jax.nn.logsumexp(logits_BSE, axis=-1))),
            "load": load_E,  # fraction of assignments per expert (sums to 1)
            "probs": probs_E,  # mean routing probability per expert
        }
        return experts_BSK, weights_BSK, stats

    def __call__(self, x_BSD: jax.Array) -> tuple[jax.Array, dict]:
        m = self.c.moe
        experts_BSK, weights_BSK, stats = self.route(x_BSD)
        w = self.experts
        run = self.kernels.expert_ffn or expert_ffn
        y_BSD, dropped = run(x_BSD.astype(self.dtype), experts_BSK, weights_BSK.astype(self.dtype),
                             w.gate[...].astype(self.dtype), w.up[...].astype(self.dtype),
                             w.down[...].astype(self.dtype), capacity_factor=m.capacity_factor,
                             capacity_group_rows=m.capacity_group_rows, impl=self.kernels.experts)
        stats["dropped"] = dropped.astype(jnp.float32) / (experts_BSK.size)  # fraction of assignments dropped
        if hasattr(self, "shared"):
            y_BSD = y_BSD + self.shared(x_BSD)
        return ax.constrain(y_BSD, (ax.ACT_BATCH, ax.ACT_SEQ, ax.ACT_EMBED)), stats


def balance_loss(load_E: jax.Array, probs_E: jax.Array) -> jax.Array:
    """The Switch load-balancing loss `E x sum_e f_e p_e` (per layer over a leading dim, if any): `f_e` the fraction
    of assignments to expert e (a constant to the gradient), `p_e` its mean routing probability."""
    return load_E.shape[-1] * jnp.sum(jax.lax.stop_gradient(load_E) * probs_E, axis=-1)


def moe_metrics(loss: jax.Array, stats: dict) -> dict:
    """A step's metrics from its MoE layers' routing statistics (`MoE.route`, each stacked along a leading MoE-layer
    dim): the cross-entropy `loss`, the auxiliary and z-losses as means over the layers, and per layer the fraction
    of assignments dropped and each expert's load."""
    return {"loss": loss, "moe_aux_loss": jnp.mean(stats["aux_loss"]), "moe_z_loss": jnp.mean(stats["z_loss"]),
            "moe_dropped": stats["dropped"], "moe_load": stats["load"]}
