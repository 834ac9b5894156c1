"""How the layers split into pipeline chunks, and how each stage gathers its chunks' layers from the canonical
(L, ...) parameters.

Chunk c = v*P + p (V virtual chunks on each of P stages) holds `sizes[c]` consecutive layers, in model order.
An even split gives every chunk L/(V*P); `balanced` takes layers off the chunks that also run the embedding (the
first) and the vocabulary head and loss (the last), as far as a matmul-FLOP cost model says that shortens the
slowest chunk (Megatron's `num_layers_in_last_pipeline_stage` / `account_for_loss_in_pipeline_split`, computed);
a list gives the sizes. In the SPMD program every chunk has room for the longest one (`width` layers): the
missing layers of a shorter chunk are skipped (`active`), not computed.

The parameters stay canonical, their layer dim sharded over `stage` in contiguous blocks of L/P when P divides
it (else whole on every stage). A stage's chunks need other layers than its block as soon as V > 1 or the split
is uneven; `ChunkLayout.gather` fetches those with one `ppermute` per stage distance, whose transpose (autodiff,
or `jax.vjp`) returns the chunks' gradients to the canonical blocks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import jax
import jax.numpy as jnp
import numpy as np

from mlm_jax.config import ConfigError, ModelConfig

STAGE = "stage"
SPLITS = ("even", "balanced")  # or a list of chunk sizes


def layer_flops(m: ModelConfig, seq_len: int) -> float:
    """Forward matmul FLOPs per token of one block: projections, causal attention and the (routed) FFN."""
    hd = m.dim_per_head
    attention = 2 * m.hidden_size * hd * (2 * m.num_heads + 2 * m.kv_heads) + 2 * seq_len * m.num_heads * hd
    mats = 3 if m.activation == "swiglu" else 2
    if m.moe.enabled:  # a pipelined MoE model has MoE blocks only
        ffn = 2 * mats * m.hidden_size * m.expert_ffn * (m.moe.top_k + m.moe.shared_experts)
        ffn += 2 * m.hidden_size * m.moe.num_experts
    else:
        ffn = 2 * mats * m.hidden_size * m.ffn_size
    return attention + ffn


def head_flops(m: ModelConfig) -> float:
    return 2 * m.hidden_size * m.vocab_size


def balanced_sizes(layers: int, chunks: int, extra: list[float]) -> tuple[int, ...]:
    """Chunk sizes (sum `layers`) that minimise the largest chunk cost, `size + extra[c]` in layer units.

    Among the minimisers the even split wins when it is one; otherwise every chunk takes as many layers as that
    cost allows, and the surplus comes off the costliest chunks, the earliest first (the first stage holds the
    most microbatches in flight)."""
    if layers % chunks == 0 and max(layers // chunks + e for e in extra) <= _best(layers, extra) + 1e-9:
        return (layers // chunks,) * chunks
    top = _best(layers, extra)
    sizes = [max(0, math.floor(top - e + 1e-9)) for e in extra]
    for _ in range(sum(sizes) - layers):
        c = max(range(chunks), key=lambda i: (sizes[i] + extra[i], -i) if sizes[i] else (-math.inf, 0))
        sizes[c] -= 1
    return tuple(sizes)


def _best(layers: int, extra: list[float]) -> float:
    """The least largest chunk cost: the smallest candidate n + extra[c] whose room holds every layer."""
    candidates = sorted({n + e for e in extra for n in range(layers + 1)})
    return next(t for t in candidates if sum(max(0, math.floor(t - e + 1e-9)) for e in extra) >= layers)


def chunk_sizes(split, m: ModelConfig, seq_len: int, stages: int, virtual: int) -> tuple[int, ...]:
    """`parallel.pipeline_layers` as the layer count of each chunk, checked (ConfigError names the key)."""
    chunks, L = stages * virtual, m.num_layers
    what = f"parallel.stage={stages}" + (f" x parallel.virtual_stages={virtual}" if virtual > 1 else "")
    if isinstance(split, str) and split == "even":
        if L % chunks:
            raise ConfigError(f"model.num_layers={L} is not divisible by {what}: set parallel.pipeline_layers="
                              f"balanced or a list of {chunks} chunk sizes")
        return (L // chunks,) * chunks
    if isinstance(split, str) and split == "balanced":
        if L < chunks:
            raise ConfigError(f"model.num_layers={L} cannot fill the {chunks} chunks of {what}")
        head = head_flops(m) / layer_flops(m, seq_len)
        return balanced_sizes(L, chunks, [0.0] * (chunks - 1) + [head])
    if isinstance(split, (list, tuple)):
        if stages == 1:
            raise ConfigError(f"parallel.pipeline_layers={list(split)} needs pipeline stages (parallel.stage > 1)")
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in split):
            raise ConfigError(f"parallel.pipeline_layers={list(split)}: expected layer counts (integers >= 0)")
        if len(split) != chunks or sum(split) != L:
            raise ConfigError(f"parallel.pipeline_layers={list(split)}: expected {chunks} chunk sizes ({what}, chunk "
                              f"v*stages + p on stage p) summing to model.num_layers={L}")
        return tuple(split)
    raise ConfigError(f"parallel.pipeline_layers={split!r}: expected one of {', '.join(SPLITS)} or a list of "
                      f"{chunks} chunk sizes")


@dataclass(frozen=True)
class ChunkLayout:
    """Where each chunk's layers come from: `sizes[c]` layers for chunk c = v*P + p, in model order."""

    sizes: tuple[int, ...]
    stages: int
    virtual: int

    @classmethod
    def even(cls, layers: int, stages: int, virtual: int) -> ChunkLayout:
        return cls((layers // (stages * virtual),) * (stages * virtual), stages, virtual)

    @property
    def layers(self) -> int:
        return sum(self.sizes)

    @property
    def width(self) -> int:
        """The layers a chunk has room for: the longest chunk's."""
        return max(self.sizes)

    @property
    def uneven(self) -> bool:
        return len(set(self.sizes)) > 1

    @property
    def sharded(self) -> bool:
        """Whether the canonical layer dim is split over the stages (in blocks of L/P), or whole on each."""
        return self.stages > 1 and self.layers % self.stages == 0

    @cached_property
    def slots(self) -> np.ndarray:
        """[v, p, i]: the canonical layer of slot i of chunk (v, p), -1 past the chunk's end."""
        V, P, W = self.virtual, self.stages, self.width
        starts = np.cumsum((0,) + self.sizes)
        out = np.full((V, P, W), -1, np.int64)
        for c, n in enumerate(self.sizes):
            out[c // P, c % P, :n] = np.arange(starts[c], starts[c] + n)
        return out

    @cached_property
    def active(self) -> np.ndarray:
        """[v, p, i]: whether slot i of chunk (v, p) holds a layer."""
        return self.slots >= 0

    @cached_property
    def position(self) -> np.ndarray:
        """[l]: the flat (V*P*width) slot of canonical layer l."""
        flat = self.slots.reshape(-1)
        out = np.zeros(self.layers, np.int64)
        out[flat[flat >= 0]] = np.nonzero(flat >= 0)[0]
        return out

    @property
    def _block(self) -> int:
        """Canonical rows each stage holds."""
        return self.layers // self.stages if self.sharded else self.layers

    @cached_property
    def _moves(self):
        """(sends, take, back): for each stage distance d, the local rows every stage sends d stages on (padded to
        the most any stage sends); for every stage, the rows of its pool (its block, then what it received, by
        distance) that fill its V*width chunk slots; and for the gradients' way back, every stage's rows of
        (its pool's block part, then what came back, by distance, then a zero row) that make its block's gradient.
        Each layer is in one chunk, so each pool row feeds at most one used slot and the way back needs no sums."""
        V, P, W, block = self.virtual, self.stages, self.width, self._block
        owner = (lambda l: l // block) if self.sharded else (lambda l: None)
        need = {}  # (distance, sender) -> local rows, in first-needed order
        for q in range(P):
            for l in self.slots[:, q].reshape(-1):
                s = owner(l) if l >= 0 else None
                if s is not None and s != q:
                    rows = need.setdefault(((q - s) % P, s), [])
                    if l % block not in rows:
                        rows.append(l % block)
        distances = sorted({d for d, _ in need})
        counts = {d: max(len(need.get((d, s), [])) for s in range(P)) for d in distances}
        base = {d: block + sum(counts[e] for e in distances if e < d) for d in distances}
        sends = [(d, np.array([need.get((d, s), []) + [0] * (counts[d] - len(need.get((d, s), [])))
                               for s in range(P)], np.int32)) for d in distances]
        take = np.zeros((P, V * W), np.int32)
        back = np.full((P, block), base[distances[-1]] + counts[distances[-1]] if distances else block, np.int32)
        for q in range(P):
            for j, l in enumerate(self.slots[:, q].reshape(-1)):
                s = owner(l) if l >= 0 else None
                if l >= 0 and s not in (None, q):
                    take[q, j] = base[(q - s) % P] + need[((q - s) % P, s)].index(l % block)
                elif l >= 0:
                    take[q, j] = back[q, l % block] = l % block
        for (d, s), rows in need.items():
            for k, r in enumerate(rows):
                back[s, r] = base[d] + k
        return sends, take, back

    @property
    def moves_nothing(self) -> bool:
        """Whether each stage's block already is its chunks' layers, in order (V = 1, an even split)."""
        sends, take, _ = self._moves
        return not sends and take.shape[1] == self._block and bool((take == np.arange(self._block)).all())

    def gather(self, block):
        """Inside the stages' `shard_map`: this stage's (V, width, ...) chunk layers from its canonical `block`
        ((L/P, ...) or (L, ...) leaves); slots past a chunk's end hold some layer of the block, unused. Its
        gradient is `scatter`."""
        V, W = self.virtual, self.width
        if self.moves_nothing:
            return jax.tree.map(lambda a: a.reshape(V, W, *a.shape[1:]), block)

        @jax.custom_vjp
        def move(block):
            return self._fetch(block)
        move.defvjp(lambda b: (self._fetch(b), None), lambda _, g: (self.scatter(g),))
        return move(block)

    def _fetch(self, block):
        V, W, P = self.virtual, self.width, self.stages
        sends, take, _ = self._moves
        p = jax.lax.axis_index(STAGE)

        def one(a):
            pool = [a]
            for d, rows in sends:
                out = jnp.take(a, jnp.asarray(rows)[p], axis=0)
                pool.append(jax.lax.ppermute(out, STAGE, [(s, (s + d) % P) for s in range(P)]))
            return jnp.take(jnp.concatenate(pool), jnp.asarray(take)[p], axis=0).reshape(V, W, *a.shape[1:])
        return jax.tree.map(one, block)

    def scatter(self, g_chunks):
        """The transpose of `gather`: (V, width, ...) chunk gradients back to the block's rows, as gathers and the
        reverse `ppermute`s (a transposed gather would be a scatter-add, atomics on GPUs). Where the layer dim is
        whole on every stage, each stage returns its own chunks' part, to be summed over the stages."""
        V, W, P, block = self.virtual, self.width, self.stages, self._block
        if self.moves_nothing:
            return jax.tree.map(lambda g: g.reshape(block, *g.shape[2:]), g_chunks)
        sends, take, back = self._moves
        p = jax.lax.axis_index(STAGE)
        used = self.active.transpose(1, 0, 2).reshape(P, V * W)
        slot_of = np.full((P, block + sum(r.shape[1] for _, r in sends)), V * W, np.int32)  # pool row -> slot
        for q in range(P):
            slot_of[q, take[q][used[q]]] = np.nonzero(used[q])[0]

        def one(g):
            zero = jnp.zeros((1, *g.shape[2:]), g.dtype)
            pool = jnp.take(jnp.concatenate([g.reshape(V * W, *g.shape[2:]), zero]), jnp.asarray(slot_of)[p], axis=0)
            parts, at = [pool[:block]], block
            for d, rows in sends:
                n = rows.shape[1]
                parts.append(jax.lax.ppermute(pool[at:at + n], STAGE, [((s + d) % P, s) for s in range(P)]))
                at += n
            return jnp.take(jnp.concatenate(parts + [zero]), jnp.asarray(back)[p], axis=0)
        return jax.tree.map(one, g_chunks)

    def canonical(self, tree_VPW):
        """(V, P, width, ...) leaves (per-slot values of every stage) -> (L, ...), in model order."""
        pos = jnp.asarray(self.position)
        return jax.tree.map(lambda a: jnp.take(a.reshape(-1, *a.shape[3:]), pos, axis=0), tree_VPW)
