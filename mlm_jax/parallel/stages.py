"""How the layers split into pipeline chunks, and how each stage gathers its chunks' layers from the canonical
(n, ...) parameter stacks.

Chunk c = v*P + p (V virtual chunks on each of P stages) holds `sizes[c]` consecutive layers, in model order.
An even split gives every chunk L/(V*P); `balanced` takes layers off the chunks that also run the embedding (the
first) and the vocabulary head and loss (the last), as far as a matmul-FLOP cost model says that shortens the
slowest chunk (Megatron's `num_layers_in_last_pipeline_stage` / `account_for_loss_in_pipeline_split`, computed);
a list gives the sizes. In the SPMD program every chunk has room for the longest one (`width` layers): the
missing layers of a shorter chunk are skipped, not computed, and so are the kinds a slot holds in other chunks
only (an MoE model's dense layers, Gemma's full-attention layers among sliding-window ones).

Each parameter stack (`blocks`, and an MoE model's `dense_blocks`) stays canonical, its layer dim sharded over
`stage` in contiguous blocks when P divides it (else whole on every stage). A stage's chunks need other layers than
its block as soon as V > 1, the split is uneven or the layers differ by kind; `StackPool.gather` fetches those with
one `ppermute` per stage distance, whose transpose (autodiff, or `jax.vjp`) returns the chunks' gradients to the
canonical blocks. `run_chunk` runs one chunk's slots with the model's own layers (`Transformer.block_fn`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import jax
import jax.numpy as jnp
import numpy as np

from mlm_jax.config import ConfigError, ModelConfig
from mlm_jax.model.transformer import Kind, Transformer

STAGE = "stage"
SPLITS = ("even", "balanced")  # or a list of chunk sizes


def layer_flops(m: ModelConfig, seq_len: int) -> float:
    """Forward matmul FLOPs per token of a block, the mean over the model's layers: projections, causal attention
    and the FFN (routed experts in an MoE layer, the dense FFN in the others)."""
    hd = m.dim_per_head
    attention = 2 * m.hidden_size * hd * (2 * m.num_heads + 2 * m.kv_heads) + 2 * seq_len * m.num_heads * hd
    mats = 2 if m.activation == "gelu" else 3
    dense = 2 * mats * m.hidden_size * m.ffn_size
    if not m.moe.enabled:
        return attention + dense
    routed = 2 * mats * m.hidden_size * m.expert_ffn * (m.moe.top_k + m.moe.shared_experts)
    routed += 2 * m.hidden_size * m.moe.num_experts
    moe_layers = sum(m.moe.is_moe_layer(i) for i in range(m.num_layers))
    return attention + (moe_layers * routed + (m.num_layers - moe_layers) * dense) / m.num_layers


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
class ChunkSlots:
    """The layer slots every pipeline chunk has (`parallel.stages.ChunkLayout` lays them out): slot i holds a layer
    of stack `stacks[i]` in the chunks that fill it, and none in the others where `optional[i]`; `local[i]` says
    whether its layer attends through the sliding window, None where that differs from chunk to chunk."""

    stacks: tuple[str, ...]
    optional: tuple[bool, ...]
    local: tuple[bool | None, ...]

    def row(self, i: int) -> int:
        """Slot i's row in its stack's chunk layers: the slots of that stack before it."""
        return self.stacks[:i].count(self.stacks[i])

    @property
    def runs(self) -> tuple[tuple[str, int, int], ...]:
        """The slots as runs of one stack: (stack, first slot, count)."""
        runs: list[list] = []
        for i, stack in enumerate(self.stacks):
            if runs and runs[-1][0] == stack:
                runs[-1][2] += 1
            else:
                runs.append([stack, i, 1])
        return tuple(tuple(r) for r in runs)


@dataclass(frozen=True)
class ChunkLayout:
    """Where each chunk's layers come from: `sizes[c]` consecutive layers for chunk c = v*P + p, in model order.

    Every chunk runs the same `width` slots, each of one parameter stack (`kinds`, per model layer: its stack, and
    whether it attends through the sliding window; `model.transformer.layer_kinds`): the shortest sequence of
    stacks into which every chunk's sequence fits in order, a chunk's layers taking the earliest slots that fit.
    A chunk leaves the other slots empty (skipped, not computed). A slot's layer is a sliding-window one in some
    chunks and a full one in others where the pattern says so; the window is then chosen at run time, inside the
    attention kernel. No slot chooses between stacks (an MoE model's dense and MoE layers): the stages run different
    chunks at the same tick, and the branches of such a choice would own different collectives.
    """

    sizes: tuple[int, ...]
    stages: int
    virtual: int
    kinds: tuple[Kind, ...] | None = None  # per model layer; None: every layer a full-attention layer of `blocks`

    @classmethod
    def even(cls, layers: int, stages: int, virtual: int) -> ChunkLayout:
        return cls((layers // (stages * virtual),) * (stages * virtual), stages, virtual)

    @property
    def layers(self) -> int:
        return sum(self.sizes)

    @cached_property
    def layer_kinds(self) -> tuple[Kind, ...]:
        return self.kinds or (("blocks", False),) * self.layers

    @property
    def stacks(self) -> tuple[str, ...]:
        """The parameter stacks the layers come from."""
        return tuple(sorted({stack for stack, _ in self.layer_kinds}))

    def rows(self, stack: str) -> list[int]:
        """The model layers `stack` holds, in order (its rows)."""
        return [l for l, (s, _) in enumerate(self.layer_kinds) if s == stack]

    @cached_property
    def _aligned(self) -> tuple[tuple[str, ...], np.ndarray]:
        """(the slots' stacks, [v, p, i] the model layer in slot i of chunk (v, p) or -1)."""
        starts = np.cumsum((0,) + self.sizes)
        chunks = [list(range(starts[c], starts[c] + n)) for c, n in enumerate(self.sizes)]
        stacks, places = supersequence([[self.layer_kinds[l][0] for l in layers] for layers in chunks])
        out = np.full((self.virtual, self.stages, len(stacks)), -1, np.int64)
        for c, (layers, where) in enumerate(zip(chunks, places)):
            out[c // self.stages, c % self.stages, where] = layers
        return tuple(stacks), out

    @property
    def slots(self) -> np.ndarray:
        """[v, p, i]: the canonical layer of slot i of chunk (v, p), -1 where the chunk leaves it empty."""
        return self._aligned[1]

    @property
    def width(self) -> int:
        """The slots every chunk has: at least the longest chunk's layer count."""
        return self.slots.shape[2]

    @cached_property
    def active(self) -> np.ndarray:
        """[v, p, i]: whether slot i of chunk (v, p) holds a layer."""
        return self.slots >= 0

    @cached_property
    def local(self) -> np.ndarray:
        """[v, p, i]: whether slot i of chunk (v, p) holds a sliding-window layer."""
        return np.vectorize(lambda l: l >= 0 and self.layer_kinds[l][1], otypes=[bool])(self.slots)

    @cached_property
    def chunk_slots(self) -> ChunkSlots:
        """The slots as the model runs them (`run_chunk`)."""
        V, P, W = self.slots.shape
        used = self.active.reshape(V * P, W)
        local = self.local.reshape(V * P, W)
        kinds = [set(local[used[:, i], i].tolist()) for i in range(W)]
        return ChunkSlots(stacks=self._aligned[0], optional=tuple(bool(not used[:, i].all()) for i in range(W)),
                          local=tuple(k.pop() if len(k) == 1 else None for k in kinds))

    @cached_property
    def position(self) -> np.ndarray:
        """[l]: the flat (V*P*width) slot of canonical layer l."""
        flat = self.slots.reshape(-1)
        out = np.zeros(self.layers, np.int64)
        out[flat[flat >= 0]] = np.nonzero(flat >= 0)[0]
        return out

    @cached_property
    def pools(self) -> dict[str, StackPool]:
        """Per stack, the gather of its canonical (n, ...) weights into each stage's (V, slots of that stack, ...)
        chunk layers."""
        out = {}
        for stack in self.stacks:
            row_of = {l: r for r, l in enumerate(self.rows(stack))}
            mine = [i for i, s in enumerate(self._aligned[0]) if s == stack]
            rows = np.vectorize(lambda l: row_of.get(l, -1), otypes=[np.int64])(self.slots[:, :, mine])
            out[stack] = StackPool(rows, len(row_of), self.stages, self.virtual)
        return out

    def canonical(self, tree_VPW):
        """(V, P, width, ...) leaves (per-slot values of every stage) -> (L, ...), in model order."""
        pos = jnp.asarray(self.position)
        return jax.tree.map(lambda a: jnp.take(a.reshape(-1, *a.shape[3:]), pos, axis=0), tree_VPW)


def supersequence(seqs: list[list]) -> tuple[list, list[list[int]]]:
    """A short common supersequence of `seqs` and, per sequence, the positions its items take in it (each the
    earliest that keeps the rest optimal): pairwise shortest supersequences, longest sequence first. One sequence's
    prefixes (an even or uneven split of one kind of layer) give the longest one, each aligned at its start."""
    order = sorted(range(len(seqs)), key=lambda j: -len(seqs[j]))
    merged, places = list(seqs[order[0]]), {order[0]: list(range(len(seqs[order[0]])))}
    for j in order[1:]:
        merged, old_to_new, places[j] = _pair_supersequence(merged, seqs[j])
        for k in places:
            if k != j:
                places[k] = [old_to_new[i] for i in places[k]]
    return merged, [places[j] for j in range(len(seqs))]


def _pair_supersequence(a: list, b: list) -> tuple[list, list[int], list[int]]:
    """The shortest common supersequence of a and b, and where each item of a and of b lands in it."""
    n, m = len(a), len(b)
    rest = np.zeros((n + 1, m + 1), np.int64)  # rest[i, j]: the shortest supersequence of a[i:] and b[j:]
    rest[n, :], rest[:, m] = m - np.arange(m + 1), n - np.arange(n + 1)
    for i in range(n - 1, -1, -1):
        for j in range(m - 1, -1, -1):
            rest[i, j] = 1 + (rest[i + 1, j + 1] if a[i] == b[j] else min(rest[i + 1, j], rest[i, j + 1]))
    out, at_a, at_b, i, j = [], [], [], 0, 0
    while i < n or j < m:
        if i < n and j < m and a[i] == b[j]:
            at_a.append(len(out)), at_b.append(len(out))
            out.append(a[i])
            i, j = i + 1, j + 1
        elif i < n and (j == m or rest[i + 1, j] <= rest[i, j + 1]):
            at_a.append(len(out))
            out.append(a[i])
            i += 1
        else:
            at_b.append(len(out))
            out.append(b[j])
            j += 1
    return out, at_a, at_b


class StackPool:
    """One parameter stack's share of the chunks: `slots[v, p, j]` is the stack row (-1: none) that row j of chunk
    (v, p)'s pool holds. The stack's rows are split over the stages in contiguous blocks when P divides them (as the
    rules table shards the `layers` dim), else whole on each stage."""

    def __init__(self, slots: np.ndarray, length: int, stages: int, virtual: int):
        self.slots, self.length, self.stages, self.virtual = slots, length, stages, virtual

    @property
    def width(self) -> int:
        return self.slots.shape[2]

    @cached_property
    def active(self) -> np.ndarray:
        return self.slots >= 0

    @property
    def sharded(self) -> bool:
        """Whether the canonical layer dim is split over the stages (in blocks of n/P), or whole on each."""
        return self.stages > 1 and self.length % self.stages == 0

    @property
    def _block(self) -> int:
        """Canonical rows each stage holds."""
        return self.length // self.stages if self.sharded else self.length

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
        ((n/P, ...) or (n, ...) leaves); rows no layer fills hold some layer of the block, unused. Its gradient is
        `scatter`."""
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


def run_chunk(model: Transformer, x_BSD: jax.Array, positions_BS: jax.Array, pools: dict, slots: ChunkSlots,
              active: jax.Array | None = None, local: jax.Array | None = None,
              segment_ids_BS: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """A pipeline chunk of `model`'s layers (the tokens' segments, if any, kept apart): slot i runs row
    `slots.row(i)` of `pools[slots.stacks[i]]` (that stack's chunk layers, stacked, or for unrolled layers a list
    of them, which each product reads without a copy out of a stack) where the traced `active[i]` says, if
    `slots.optional[i]` (else always), as a sliding-window layer where `slots.local[i]`, or, where that is None,
    where the traced `local[i]` says. Returns the output and each slot's MoE statistics (zeros where the slot ran no
    MoE layer; {} for a model without experts).

    Slots of one stack in a row run as `Transformer.run_blocks` does (scanned or unrolled); optional slots sit in a
    `lax.cond` (scanned: every slot of the run, one body). A slot never chooses between stacks: the stages
    take different branches at the same tick, and a branch must not own a collective another lacks.
    """
    stats = {}
    if hasattr(model.blocks, "moe"):  # an MoE model: its MoE layers' statistics
        layer0 = _row(pools["blocks"], 0)
        stats = jax.eval_shape(model.block_fn(("blocks", False)), x_BSD, positions_BS, layer0, segment_ids_BS)[1]

    def zeros():
        return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), stats)

    def layer(stack, x_BSD, layer_state, on, is_local):
        block = model.block_fn((stack, is_local))

        def run(x_BSD, layer_state):
            y_BSD, layer_stats = block(x_BSD, positions_BS, layer_state, segment_ids_BS)
            return y_BSD, layer_stats or zeros()  # a dense layer of an MoE model: no routing

        if on is None:
            return run(x_BSD, layer_state)
        return jax.lax.cond(on, run, lambda x_BSD, _: (x_BSD, zeros()), x_BSD, layer_state)

    out = []
    for stack, start, count in slots.runs:
        row = slots.row(start)
        part = range(start, start + count)
        on = active[start:start + count] if any(slots.optional[i] for i in part) else None
        kinds = {slots.local[i] for i in part}
        if model.scan_layers:
            static = kinds.pop() if len(kinds) == 1 else None  # None: a choice per chunk
            flags = None
            if static is None:
                flags = jnp.stack([local[i] if slots.local[i] is None else jnp.asarray(slots.local[i])
                                   for i in part])

            def body(x_BSD, xs, stack=stack, static=static):
                w, o, f = xs
                return layer(stack, x_BSD, w, o, static if f is None else f)
            weights = jax.tree.map(lambda w: w[row:row + count], pools[stack])
            x_BSD, run_stats = jax.lax.scan(body, x_BSD, (weights, on, flags))
        else:
            run_stats = []
            for j, i in enumerate(part):
                is_local = local[i] if slots.local[i] is None else slots.local[i]
                x_BSD, layer_stats = layer(stack, x_BSD, _row(pools[stack], row + j),
                                           on[j] if slots.optional[i] else None, is_local)
                run_stats.append(layer_stats)
            run_stats = jax.tree.map(lambda *s: jnp.stack(s), *run_stats)
        out.append(run_stats)
    return x_BSD, jax.tree.map(lambda *s: jnp.concatenate(s), *out) if stats else {}


def _row(pool, i: int):
    """Row i of a stack's chunk layers (`run_chunk`'s pools: stacked, or a list of layers)."""
    return pool[i] if isinstance(pool, list) else jax.tree.map(lambda w: w[i], pool)
