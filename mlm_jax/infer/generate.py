"""Text generation: `mlm_jax.generate(model, prompts, ...)` and `stream`.

A batch of prompts of any lengths is right-padded to a bucket (a power of two), run once through the model to fill
a preallocated key/value cache (`infer.decode.prefill`), then decoded one token per step (`infer.decode.decode`)
inside one jitted `lax.while_loop` that stops when every row has produced a stop token or `max_new_tokens`, checked
every STEPS_PER_CHECK steps (a loop of known trip count inside, which needs no answer from the host between steps):
one compiled program per (batch, prompt bucket, cache size in steps of CACHE_STEP), whatever the lengths and step
counts. The model runs where its parameters are: on one device, or sharded over several (tensor parallelism,
`load_pretrained(..., tensor=N)`, or a trainer's layout), its activations laid out by the same rules table as in
training.

Shapes: B prompts, P padded prompt length, C cache length, V vocabulary.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mlm_jax.infer import decode as dec
from mlm_jax.model.kernels import Kernels
from mlm_jax.model.transformer import Transformer
from mlm_jax.ops import flash_decode, gemv
from mlm_jax.parallel.rules import DATA_AXES, make_rules
from mlm_jax.setup import on_mesh

MIN_BUCKET = 16
CACHE_STEP = 128
STEPS_PER_CHECK = 8
FUSE_ROWS = 5  # rows from which a decode step's products that share an input run as one (`infer.blocks`)


def bucket(n: int) -> int:
    """The padded length for `n`: the next power of two, at least MIN_BUCKET."""
    return max(MIN_BUCKET, 1 << (max(n, 1) - 1).bit_length())


def generate(model: Transformer, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, seed: int = 0,
             stop_tokens: Sequence[int] = (), rules=None) -> list[list[int]]:
    """The new tokens of each prompt (a list of token ids, any length): up to `max_new_tokens`, ending with the
    first of `stop_tokens` produced (included). `temperature` 0 is greedy; otherwise tokens are sampled at that
    temperature from the `top_k` most likely and the smallest set whose probability reaches `top_p`, reproducibly
    for a `seed`. `rules` (a rules table, default the trainer's default) lays out the activations of a model
    sharded over several devices."""
    run = Run(model, prompts, max_new_tokens, temperature, top_k, top_p, seed, stop_tokens, rules)
    width = bucket(max_new_tokens) + STEPS_PER_CHECK  # room for a last block of steps past the end
    with run.layout():
        out_BN, steps = _generate(run.graphdef, run.state, run.layers, run.tokens_BP, run.lengths_B,
                                  run.put(np.zeros((len(run.lengths_B), width), np.int32)),
                                  max_new_tokens, run.temperature, run.top_p, run.key, run.stops, run.length,
                                  run.top_k, run.greedy, run.kernels, run.fuse)
    return run.finish(np.asarray(out_BN)[:, :min(int(steps), max_new_tokens)])


def stream(model: Transformer, prompt: Sequence[int], *, max_new_tokens: int, temperature: float = 0.0,
           top_k: int | None = None, top_p: float | None = None, seed: int = 0, stop_tokens: Sequence[int] = (),
           rules=None) -> Iterator[int]:
    """`generate` of one prompt, yielding each new token as soon as it is produced (one jitted step each); the
    arguments are checked before the first token is asked for."""
    return _stream(Run(model, [prompt], max_new_tokens, temperature, top_k, top_p, seed, stop_tokens, rules),
                   max_new_tokens)


def _stream(run: Run, max_new_tokens: int) -> Iterator[int]:
    with run.layout():
        token_B, cache = _prefill(run.graphdef, run.state, run.layers, run.tokens_BP, run.lengths_B,
                                  run.temperature, run.top_p, run.key, run.length, run.top_k, run.greedy,
                                  run.kernels, run.fuse)
        positions_B = run.lengths_B
        for t in range(max_new_tokens):
            token = int(token_B[0])
            yield token
            if token in run.stop_set or t + 1 == max_new_tokens:
                return
            token_B, cache = _step(run.graphdef, run.state, run.layers, token_B, positions_B + t, cache,
                                   run.temperature, run.top_p, jax.random.fold_in(run.key, t + 1), run.top_k,
                                   run.greedy, run.kernels, run.fuse)


class Run:
    """One call's checked inputs, padded batch, cache and sampling settings, on the model's devices."""

    def __init__(self, model, prompts, max_new_tokens, temperature, top_k, top_p, seed, stop_tokens, rules):
        vocab = model.embed.embedding.shape[0]
        check(prompts, max_new_tokens, temperature, top_k, top_p, stop_tokens, vocab)
        self.graphdef, self.state = nnx.split(model)
        leaf = jax.tree.leaves(self.state)[0]
        sharding = getattr(leaf, "sharding", None)
        self.mesh = sharding.mesh if isinstance(sharding, jax.sharding.NamedSharding) else None
        self.platform = next(iter(leaf.devices())).platform if isinstance(leaf, jax.Array) else jax.default_backend()
        self.rules = make_rules("default", False) if rules is None else rules
        if self.mesh is not None and hasattr(model.blocks, "moe") and self.mesh.shape.get("context", 1) > 1:
            raise ValueError("an MoE model split over a context-parallel mesh cannot generate: load the checkpoint "
                             "with mlm_jax.load_pretrained(path, tensor=N)")
        # q/k/v and gate/up each one product from FUSE_ROWS rows (an H200, llama-1b: batch 32 1.631 against 1.662
        # ms a step; batch 1 0.925 unfused against 0.948)
        self.fuse = len(prompts) >= FUSE_ROWS
        self.setup = None if self.mesh is None else _on_mesh(self.mesh, self.rules, model.kernels,
                                                               getattr(model.blocks.attn.c, "kv_heads", None),
                                                               hasattr(model.blocks, "moe"))
        self.kernels = decode_kernels(model.kernels if self.setup is None else self.setup.kernels, self.platform,
                                      self.mesh is None or self.mesh.size == 1, self.fuse)
        self.layers = _layer_states(self.graphdef, self.state, self.fuse)  # a copy of the weights, per layer
        self.rows = len(prompts)
        # rows padded (with one-token prompts) to a multiple of the data-parallel degree, which splits them
        dp = 1 if self.mesh is None else math.prod(self.mesh.shape.get(a, 1) for a in DATA_AXES)
        prompts = list(prompts) + [[0]] * (-len(prompts) % dp)
        lengths = [len(p) for p in prompts]
        B, P = len(prompts), bucket(max(lengths))
        tokens = np.zeros((B, P), np.int32)
        for b, p in enumerate(prompts):
            tokens[b, :len(p)] = p
        self.tokens_BP, self.lengths_B = self.put(tokens), self.put(np.asarray(lengths, np.int32))
        # Each decode step reads the whole cache: sized to the longest row's end, in steps of CACHE_STEP
        self.length = -(-(max(lengths) + max_new_tokens) // CACHE_STEP) * CACHE_STEP
        self.greedy, self.top_k = temperature == 0, top_k
        self.temperature = jnp.float32(temperature or 1.0)
        self.top_p = None if top_p is None else jnp.float32(top_p)
        self.key = jax.random.key(seed)
        self.stop_set = {int(t) for t in stop_tokens}
        self.stops = jnp.asarray(sorted(self.stop_set) or [-1], jnp.int32)

    def put(self, x: np.ndarray) -> jax.Array:
        if self.mesh is None:
            return jnp.asarray(x)
        return jax.device_put(x, jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec()))

    def layout(self):
        """While tracing: the activation layouts of the model's mesh by the rules table (none on one device)."""
        return contextlib.nullcontext() if self.setup is None else self.setup.layout

    def finish(self, out_BN: np.ndarray) -> list[list[int]]:
        """Each row's tokens up to and including its first stop token."""
        result = []
        for row in out_BN[:self.rows].tolist():
            stop = next((i for i, t in enumerate(row) if t in self.stop_set), None)
            result.append(row if stop is None else row[:stop + 1])
        return result


def check(prompts, max_new_tokens, temperature, top_k, top_p, stop_tokens, vocab: int) -> None:
    """One-line ValueErrors for what `generate` cannot run."""
    if not prompts:
        raise ValueError("prompts: expected at least one prompt (a list of token ids)")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompts[{i}] is empty: a prompt needs at least one token")
        bad = [t for t in p if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"prompts[{i}] holds token {bad[0]}, outside the model's vocabulary of {vocab}")
    if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
        raise ValueError(f"max_new_tokens={max_new_tokens!r}: expected an integer >= 1")
    if not temperature >= 0:
        raise ValueError(f"temperature={temperature!r}: expected a number >= 0 (0 = greedy)")
    if top_k is not None and not (isinstance(top_k, int) and 1 <= top_k <= vocab):
        raise ValueError(f"top_k={top_k!r}: expected an integer from 1 to the vocabulary size {vocab}, or None")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p!r}: expected a probability in (0, 1], or None")
    bad = [t for t in stop_tokens if not 0 <= int(t) < vocab]
    if bad:
        raise ValueError(f"stop_tokens holds {bad[0]}, outside the model's vocabulary of {vocab}")


def sample(logits_BV: jax.Array, key, temperature, top_p, top_k: int | None, greedy: bool) -> jax.Array:
    """The next token of each row: the most likely (greedy), or drawn at `temperature` from the `top_k` most
    likely and the smallest set whose probability reaches `top_p` (the most likely always kept)."""
    if greedy:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    logits_BV = logits_BV.astype(jnp.float32) / temperature
    if top_k is not None:
        kth_B1 = jax.lax.top_k(logits_BV, top_k)[0][:, -1:]
        logits_BV = jnp.where(logits_BV < kth_B1, -jnp.inf, logits_BV)
    if top_p is not None:
        sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
        probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
        before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV  # probability of the tokens ranked above
        cut_B1 = jnp.min(jnp.where(before_BV < top_p, sorted_BV, jnp.inf), axis=-1, keepdims=True)
        logits_BV = jnp.where(logits_BV < cut_B1, -jnp.inf, logits_BV)
    return jax.random.categorical(key, logits_BV, axis=-1).astype(jnp.int32)


@functools.cache
def _on_mesh(mesh, rules, kernels: Kernels, kv_heads: int | None, moe: bool):
    """`setup.on_mesh`, once per mesh and model kind: the kernels are static arguments of the compiled steps."""
    return on_mesh(mesh, rules, kernels, kv_heads=kv_heads, moe=moe)


def decode_kernels(kernels: Kernels, platform: str, one_device: bool, fuse: bool) -> Kernels:
    """`kernels` with the decode steps' own on one GPU: the Pallas kernels for attention's output projection of a
    few rows (`ops.gemv`), its attention over the cache (`ops.flash_decode`) and, from FUSE_ROWS rows, its
    residual adds (`gemv.add_residual`) and gated MLPs' gate/up products (`gemv.gated`): custom calls, which XLA
    cannot partition. Fewer rows: the few-row products come in many more slices (`gemv.FEW`), which XLA sums inside
    the residual add's fusion."""
    if platform != "gpu" or not one_device:
        return kernels
    residual = dict(residual=gemv.add_residual, gated=gemv.gated) if fuse else {}
    return dataclasses.replace(kernels, few_rows=gemv.einsum, cached_attention=flash_decode.step, **residual)


@functools.partial(jax.jit, static_argnames=("graphdef", "fuse"))
def _layer_states(graphdef, state, fuse):
    return dec.layer_states(nnx.merge(graphdef, state), fuse)


@functools.partial(jax.jit, static_argnames=("graphdef", "length", "top_k", "greedy", "kernels", "fuse"))
def _prefill(graphdef, state, layers, tokens_BP, lengths_B, temperature, top_p, key, length, top_k, greedy, kernels,
             fuse):
    logits_BV, cache = dec.prefill(nnx.merge(graphdef, state), tokens_BP, lengths_B, length, layers, kernels, fuse)
    return sample(logits_BV, key, temperature, top_p, top_k, greedy), cache


@functools.partial(jax.jit, static_argnames=("graphdef", "top_k", "greedy", "kernels", "fuse"),
                   donate_argnames=("cache",))
def _step(graphdef, state, layers, token_B, positions_B, cache, temperature, top_p, key, top_k, greedy, kernels,
          fuse):
    logits_B1V, cache = dec.decode(nnx.merge(graphdef, state), token_B[:, None], positions_B[:, None], cache, layers,
                                   kernels, fuse)
    return sample(logits_B1V[:, 0], key, temperature, top_p, top_k, greedy), cache


@functools.partial(jax.jit, static_argnames=("graphdef", "length", "top_k", "greedy", "kernels", "fuse"),
                   donate_argnames=("out_BN",))
def _generate(graphdef, state, layers, tokens_BP, lengths_B, out_BN, max_new_tokens, temperature, top_p, key,
              stops_S, length, top_k, greedy, kernels, fuse):
    """`out_BN` filled with new tokens, and how many steps ran: the prefill's token, then decode steps until every
    row has stopped or `max_new_tokens` (traced, at most N: any count compiles once), in blocks of STEPS_PER_CHECK
    (the steps past the end are dropped by the caller)."""
    model = nnx.merge(graphdef, state)
    logits_BV, cache = dec.prefill(model, tokens_BP, lengths_B, length, layers, kernels, fuse)
    token_B = sample(logits_BV, key, temperature, top_p, top_k, greedy)
    out_BN = out_BN.at[:, 0].set(token_B)
    done_B = jnp.isin(token_B, stops_S)

    def running(carry):
        t, _, _, done_B, _ = carry
        return (t < max_new_tokens) & ~jnp.all(done_B)

    def step(t, carry):
        token_B, cache, done_B, out_BN = carry
        logits_B1V, cache = dec.decode(model, token_B[:, None], (lengths_B + t - 1)[:, None], cache, layers, kernels,
                                       fuse)
        token_B = sample(logits_B1V[:, 0], jax.random.fold_in(key, t), temperature, top_p, top_k, greedy)
        out_BN = jax.lax.dynamic_update_index_in_dim(out_BN, token_B, t, axis=1)
        return token_B, cache, done_B | jnp.isin(token_B, stops_S), out_BN

    def steps(carry):
        t, *rest = carry
        rest = jax.lax.fori_loop(0, STEPS_PER_CHECK, lambda i, c: step(t + i, c), tuple(rest))
        return t + STEPS_PER_CHECK, *rest

    t, _, _, _, out_BN = jax.lax.while_loop(running, steps, (jnp.int32(1), token_B, cache, done_B, out_BN))
    return out_BN, t
