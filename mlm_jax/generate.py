"""Text generation: `mlm_jax.generate(model, prompts, ...)`, and `python -m mlm_jax.generate PATH --prompt TEXT`.

A batch of prompts of any lengths is right-padded to a bucket (a power of two), run once through the model to fill
a preallocated key/value cache (`Transformer.prefill`), then decoded one token per step (`Transformer.decode`)
inside one jitted `lax.while_loop` that stops when every row has produced a stop token or `max_new_tokens`, checked
every STEPS_PER_CHECK steps (a loop of known trip count inside, which needs no answer from the host between steps):
one compiled program per (batch, prompt bucket, cache size in steps of CACHE_STEP), whatever the lengths and step
counts. The model runs where its parameters are: on one device, or sharded over several (tensor parallelism,
`load_pretrained(..., tensor=N)`, or a trainer's layout), its activations laid out by the same rules table as in
training.

Shapes: B prompts, P padded prompt length, C cache length, V vocabulary.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import math
import sys
import types
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mlm_jax.layers import axes as ax
from mlm_jax.layers.transformer import Transformer
from mlm_jax.parallel.rules import DATA_AXES, make_rules

MIN_BUCKET = 16
CACHE_STEP = 128
STEPS_PER_CHECK = 8
FUSE_ROWS = 5  # rows from which a decode step's products that share an input run as one (`Block.fuse_projections`)


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
    with run.context():
        out_BN, steps = _generate(run.graphdef, run.state, run.layers, run.tokens_BP, run.lengths_B,
                                  run.put(np.zeros((len(run.lengths_B), width), np.int32)),
                                  max_new_tokens, run.temperature, run.top_p, run.key, run.stops, run.length,
                                  run.top_k, run.greedy)
    return run.finish(np.asarray(out_BN)[:, :min(int(steps), max_new_tokens)])


def stream(model: Transformer, prompt: Sequence[int], *, max_new_tokens: int, temperature: float = 0.0,
           top_k: int | None = None, top_p: float | None = None, seed: int = 0, stop_tokens: Sequence[int] = (),
           rules=None) -> Iterator[int]:
    """`generate` of one prompt, yielding each new token as soon as it is produced (one jitted step each); the
    arguments are checked before the first token is asked for."""
    return _stream(Run(model, [prompt], max_new_tokens, temperature, top_k, top_p, seed, stop_tokens, rules),
                   max_new_tokens)


def _stream(run: Run, max_new_tokens: int) -> Iterator[int]:
    with run.context():
        token_B, cache = _prefill(run.graphdef, run.state, run.layers, run.tokens_BP, run.lengths_B,
                                  run.temperature, run.top_p, run.key, run.length, run.top_k, run.greedy)
        positions_B = run.lengths_B
        for t in range(max_new_tokens):
            token = int(token_B[0])
            yield token
            if token in run.stop_set or t + 1 == max_new_tokens:
                return
            token_B, cache = _step(run.graphdef, run.state, run.layers, token_B, positions_B + t, cache,
                                   run.temperature, run.top_p, jax.random.fold_in(run.key, t + 1), run.top_k,
                                   run.greedy)


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
        # a copy of the weights, per layer; q/k/v and gate/up each one product from FUSE_ROWS rows (an H200, llama-1b:
        # batch 32 1.631 against 1.662 ms a step; batch 1 0.925 unfused against 0.948)
        self.layers = _layer_states(self.graphdef, self.state, len(prompts) >= FUSE_ROWS)
        self.kv_heads = getattr(model.blocks.attn.c, "kv_heads", None)  # None: latent attention
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

    @contextlib.contextmanager
    def context(self):
        """While tracing: the activation layouts of the model's mesh by the rules table, the expert-parallel kernel
        an MoE model's split experts need and the repeated K/V heads of fewer K/V heads than tensor ranks (as the
        trainer installs them); on one GPU, the Pallas kernels for attention's output projection of a few rows
        (`layers.gemv`), its attention over the cache (`layers.flash_decode`) and, from FUSE_ROWS rows, its
        residual adds (`gemv.add_residual`) and gated MLPs' gate/up products (`gemv.gated`): custom calls, which
        XLA cannot partition."""
        from mlm_jax.layers import flash_decode, gemv
        kernels, resolver = {}, contextlib.nullcontext()
        if self.platform == "gpu" and (self.mesh is None or self.mesh.size == 1):
            kernels[ax.FEW_ROWS], kernels[ax.CACHED_ATTENTION] = gemv.einsum, flash_decode.step
            if self.rows >= FUSE_ROWS:  # fewer rows: the few-row products come in many more slices (`gemv.FEW`),
                # which XLA sums inside the residual add's fusion
                kernels[ax.RESIDUAL], kernels[ax.GATED] = gemv.add_residual, gemv.gated
        if self.mesh is not None:
            from mlm_jax.layers.attention import local_attention
            from mlm_jax.parallel.expert import expert_parallel_ffn
            from mlm_jax.parallel.kernels import repeated_kv_heads
            from mlm_jax.parallel.sharding import activation_resolver
            if any(size > 1 for size in self.mesh.shape.values()):  # tokens or experts split, as `parallel_kernels`
                kernels[ax.EXPERT_FFN] = functools.partial(expert_parallel_ffn, mesh=self.mesh)
            t = self.mesh.shape.get("tensor", 1)
            if self.kv_heads and self.kv_heads % t:  # the prompt's attention as in training (cuDNN's partitioner
                # needs the query and key heads split alike); decode steps then attend through XLA's products
                kernels[ax.ATTENTION] = functools.partial(repeated_kv_heads, repeat=t // self.kv_heads,
                                                          attention=local_attention)
            resolver = ax.activation_resolver(activation_resolver(self.mesh, self.rules))
        with resolver, ax.kernels(**kernels):
            yield

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


@functools.partial(jax.jit, static_argnames=("graphdef", "fuse"))
def _layer_states(graphdef, state, fuse):
    return nnx.merge(graphdef, state).layer_states(fuse)


@functools.partial(jax.jit, static_argnames=("graphdef", "length", "top_k", "greedy"))
def _prefill(graphdef, state, layers, tokens_BP, lengths_B, temperature, top_p, key, length, top_k, greedy):
    logits_BV, cache = nnx.merge(graphdef, state).prefill(tokens_BP, lengths_B, length, layers)
    return sample(logits_BV, key, temperature, top_p, top_k, greedy), cache


@functools.partial(jax.jit, static_argnames=("graphdef", "top_k", "greedy"), donate_argnames=("cache",))
def _step(graphdef, state, layers, token_B, positions_B, cache, temperature, top_p, key, top_k, greedy):
    logits_B1V, cache = nnx.merge(graphdef, state).decode(token_B[:, None], positions_B[:, None], cache, layers)
    return sample(logits_B1V[:, 0], key, temperature, top_p, top_k, greedy), cache


@functools.partial(jax.jit, static_argnames=("graphdef", "length", "top_k", "greedy"), donate_argnames=("out_BN",))
def _generate(graphdef, state, layers, tokens_BP, lengths_B, out_BN, max_new_tokens, temperature, top_p, key,
              stops_S, length, top_k, greedy):
    """`out_BN` filled with new tokens, and how many steps ran: the prefill's token, then decode steps until every
    row has stopped or `max_new_tokens` (traced, at most N: any count compiles once), in blocks of STEPS_PER_CHECK
    (the steps past the end are dropped by the caller)."""
    model = nnx.merge(graphdef, state)
    logits_BV, cache = model.prefill(tokens_BP, lengths_B, length, layers)
    token_B = sample(logits_BV, key, temperature, top_p, top_k, greedy)
    out_BN = out_BN.at[:, 0].set(token_B)
    done_B = jnp.isin(token_B, stops_S)

    def running(carry):
        t, _, _, done_B, _ = carry
        return (t < max_new_tokens) & ~jnp.all(done_B)

    def step(t, carry):
        token_B, cache, done_B, out_BN = carry
        logits_B1V, cache = model.decode(token_B[:, None], (lengths_B + t - 1)[:, None], cache, layers)
        token_B = sample(logits_B1V[:, 0], jax.random.fold_in(key, t), temperature, top_p, top_k, greedy)
        out_BN = jax.lax.dynamic_update_index_in_dim(out_BN, token_B, t, axis=1)
        return token_B, cache, done_B | jnp.isin(token_B, stops_S), out_BN

    def steps(carry):
        t, *rest = carry
        rest = jax.lax.fori_loop(0, STEPS_PER_CHECK, lambda i, c: step(t + i, c), tuple(rest))
        return t + STEPS_PER_CHECK, *rest

    t, _, _, _, out_BN = jax.lax.while_loop(running, steps, (jnp.int32(1), token_B, cache, done_B, out_BN))
    return out_BN, t


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ValueError(message)


def main(argv=None) -> int:
    """`python -m mlm_jax.generate PATH --prompt TEXT`: the prompt's continuation, streamed to stdout as it is
    produced; bad input is one `error:` line on stderr and exit code 2."""
    p = _Parser(prog="python -m mlm_jax.generate", description="Continue a prompt with a trained or converted model.")
    p.add_argument("path", help="a converted dir, a run's output dir, or a checkpoints dir")
    p.add_argument("--prompt", required=True)
    p.add_argument("--tokenizer", help="a tokenizer.json (default: the one beside the checkpoint, or the run's)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (the default) is greedy")
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tensor", type=int, default=1, help="split the model over this many local devices")
    try:
        args = p.parse_args(argv)
        from mlm_jax.convert import ConvertError
        from mlm_jax.convert.pretrained import load_pretrained, load_tokenizer
        try:
            info = load_tokenizer(args.path, args.tokenizer)
            if not args.prompt:
                raise ValueError("--prompt is empty: give the text to continue")
            prompt = info.tokenizer.encode(args.prompt, add_special_tokens=True).tolist()
            if info.context and len(prompt) >= info.context:
                raise ValueError(f"--prompt is {len(prompt)} tokens, and the model's context is {info.context}: "
                                 f"shorten it")
            room = info.context - len(prompt) if info.context else args.max_new_tokens
            model = load_pretrained(args.path, tensor=args.tensor)
            tokens = stream(model, prompt, max_new_tokens=min(args.max_new_tokens, room),
                            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                            stop_tokens=info.eos_ids)
            print(args.prompt, end="", flush=True)
            shown, text, new = "", "", []
            for token in tokens:
                new.append(token)
                text = info.tokenizer.decode(new, skip_special_tokens=True)
                if not text.endswith("\ufffd"):  # an unfinished character waits for its next token
                    print(text[len(shown):], end="", flush=True)
                    shown = text
            print(text[len(shown):])  # what is left unfinished at the end, as the whole decode shows it
        except ConvertError as e:
            raise ValueError(str(e)) from None
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


class _CallableModule(types.ModuleType):
    """`mlm_jax.generate(...)` calls `generate` even once this module is imported (which makes `mlm_jax.generate`
    the module)."""

    def __call__(self, *args, **kwargs):
        return generate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    sys.exit(main())
