"""The split of the layers into pipeline chunks: the balanced split from its cost model, and the gather that
puts each chunk's layers (and, transposed, their gradients) where the stages need them.

8 fake CPU devices; the gather is checked for every stage count and split shape it can meet (layer dim split over
the stages or whole on each, layers moving one or several stages, padded slots)."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from mlm_jax import load_config
from mlm_jax.model.transformer import layer_kinds, model_spec
from mlm_jax.parallel.stages import (
    STAGE,
    ChunkLayout,
    balanced_sizes,
    chunk_sizes,
    run_chunk,
)

LLAMA_1B = ["model.vocab_size=32768", "model.hidden_size=2048", "model.num_layers=16", "model.num_heads=16",
            "model.ffn_size=5632"]
LLAMA3_8B = ["model.vocab_size=128256", "model.hidden_size=4096", "model.num_layers=32", "model.num_heads=32",
             "model.num_kv_heads=8", "model.ffn_size=14336"]


@pytest.mark.parametrize("model, seq, stages, virtual, sizes", [
    (LLAMA_1B, 2048, 2, 1, (9, 7)),  # the head costs 1.21 layers
    (LLAMA_1B, 2048, 2, 2, (4, 4, 5, 3)),
    (LLAMA3_8B, 8192, 4, 1, (8, 9, 9, 6)),  # 2.09 layers: 9 + 0 against the even split's 8 + 2.09
    (["model.num_layers=4"], 128, 2, 1, (2, 2)),  # the tiny model's head is cheap: the even split is best
])
def test_balanced_split_of_known_models(model, seq, stages, virtual, sizes):
    m = load_config(None, model).model
    assert chunk_sizes("balanced", m, seq, stages, virtual) == sizes


def test_balanced_sizes_minimise_the_costliest_chunk():
    """Against every split of up to 9 layers over 2 to 4 chunks (exhaustive), head costs 0 to 3.5 layers."""
    for chunks, layers, head in itertools.product((2, 3, 4), range(4, 10), np.arange(0, 3.75, 0.25)):
        extra = [0.0] * (chunks - 1) + [float(head)]
        got = balanced_sizes(layers, chunks, extra)
        best = min(max(n + e for n, e in zip(split, extra))
                   for split in itertools.product(range(layers + 1), repeat=chunks) if sum(split) == layers)
        assert sum(got) == layers and min(got) >= 0
        assert max(n + e for n, e in zip(got, extra)) == pytest.approx(best), (chunks, layers, head, got)


def _mesh(stages):
    return Mesh(np.array(jax.devices()[:stages]), (STAGE,))


@pytest.mark.parametrize("sizes, stages, virtual", [
    ((4, 4), 2, 1), ((5, 3), 2, 1), ((2, 2, 2, 2), 2, 2), ((1, 3, 3, 1), 2, 2), ((2, 3, 3, 2, 2, 3), 3, 2),
    ((3, 3, 2), 3, 1), ((0, 4, 4, 0), 4, 1), ((1, 2, 3, 2, 2, 1, 3, 2), 4, 2), ((2,) * 8, 8, 1)])
def test_gather_puts_each_layer_in_its_chunk_slot_and_returns_its_gradient(sizes, stages, virtual):
    """And its gradient, `scatter` (gathers and ppermutes), equals the transpose autodiff derives."""
    layout = ChunkLayout(sizes, stages, virtual)
    pool = layout.pools["blocks"]
    L, W = layout.layers, layout.width
    assert W == max(sizes) and pool.width == W
    canonical = jnp.arange(L, dtype=jnp.float32)[:, None] * jnp.ones((1, 3))  # layer l holds l
    spec = PartitionSpec(STAGE) if pool.sharded else PartitionSpec()

    def per_stage(block, g_VW):
        chunks, pullback = jax.vjp(pool.gather, block)
        g, g_transposed = pullback(g_VW[:, 0])[0], jax.linear_transpose(pool._fetch, block)(g_VW[:, 0])[0]
        if not pool.sharded:
            g, g_transposed = jax.lax.psum(g, STAGE), jax.lax.psum(g_transposed, STAGE)
        return chunks[:, None], g, g_transposed

    # the cotangent of slot (v, p, i) is 1 + its layer where the slot is used, 0 on padding
    cot = np.where(layout.active, layout.slots + 1.0, 0.0)[..., None] * np.ones(3)
    chunks, g, g_transposed = jax.jit(jax.shard_map(
        per_stage, mesh=_mesh(stages), in_specs=(spec, PartitionSpec(None, STAGE)),
        out_specs=(PartitionSpec(None, STAGE), spec, spec), check_vma=False))(canonical, jnp.asarray(cot, jnp.float32))
    assert chunks.shape == (virtual, stages, W, 3)
    got = np.asarray(chunks[..., 0])
    np.testing.assert_array_equal(got[layout.active], layout.slots[layout.active])
    np.testing.assert_array_equal(np.asarray(g), 1.0 + np.asarray(canonical))  # each layer's own cotangent, once
    np.testing.assert_array_equal(np.asarray(g), np.asarray(g_transposed))  # `scatter` is the gather's transpose
    np.testing.assert_array_equal(np.asarray(layout.canonical(chunks))[:, 0], np.arange(L))


D, M = ("dense_blocks", False), ("blocks", False)  # an MoE model's dense and MoE layers (full attention)
G, W = ("blocks", False), ("blocks", True)  # full and sliding-window layers of one stack


@pytest.mark.parametrize("kinds, sizes, stages, virtual, stacks, optional, local", [
    # DeepSeek-V3-like: the dense first layers get slots of their own, which the other chunks leave empty
    ((D, D, M, M, M, M, M), (4, 3), 2, 1, ("dense_blocks",) * 2 + ("blocks",) * 3, (True, True, False, False, True),
     (False,) * 5),
    # Qwen3-MoE-like: a dense layer every other layer, the chunks out of phase
    ((M, D, M, D, M, D), (1, 2, 2, 1), 2, 2, ("dense_blocks", "blocks"), (True, True), (False,) * 2),
    # Gemma 3: one stack, the window chosen per chunk where the slots disagree
    ((W, W, G, W, W, G, W, W), (4, 4), 2, 1, ("blocks",) * 4, (False,) * 4, (True, None, None, True)),
])
def test_layers_of_several_kinds_share_slots_of_one_stack_each(kinds, sizes, stages, virtual, stacks, optional,
                                                               local):
    layout = ChunkLayout(sizes, stages, virtual, kinds)
    slots = layout.chunk_slots
    assert (slots.stacks, slots.optional, slots.local) == (stacks, optional, local)
    for (v, p, i), l in np.ndenumerate(layout.slots):  # every layer once, in order, in a slot of its stack
        if l >= 0:
            assert kinds[l][0] == stacks[i] and layout.local[v, p, i] == kinds[l][1]
    assert sorted(layout.slots[layout.active].tolist()) == list(range(len(kinds)))
    for chunk in layout.slots.reshape(-1, layout.width):
        assert list(chunk[chunk >= 0]) == sorted(chunk[chunk >= 0])
    for stack, pool in layout.pools.items():  # each stack's pool row holds that slot's layer, as a stack row
        rows = layout.rows(stack)
        mine = [i for i, s in enumerate(stacks) if s == stack]
        expect = np.where(layout.active[:, :, mine], layout.slots[:, :, mine], -1)
        np.testing.assert_array_equal(np.where(pool.active, np.asarray(rows)[pool.slots], -1), expect)


@pytest.mark.parametrize("pooled", ["stacked", "list"])
def test_an_unrolled_chunk_branches_around_its_optional_slots_only(pooled):
    """A 3-layer chunk beside a 1-layer one: slots 1 and 2 are optional and sit in a conditional each, slot 0 runs
    unconditionally (a conditional returns its products' gradients by a copy). The chunk's layers may come stacked
    or as a list of layers (the executor's, taken apart once a step), with the same program."""
    cfg = load_config(None, ["model.num_layers=4", "model.scan_layers=false"])
    layout = ChunkLayout((3, 1), 1, 2, layer_kinds(cfg.model))
    slots = layout.chunk_slots
    assert slots.optional == (False, True, True)
    spec = model_spec(cfg.model)
    rows = jax.tree.map(lambda a: jax.ShapeDtypeStruct((layout.width, *a.shape[1:]), a.dtype), spec.shapes["blocks"])
    model = nnx.merge(spec.graphdef, spec.shapes)

    def chunk(pool, x, active):
        if pooled == "list":
            pool = [jax.tree.map(lambda a, j=j: a[j], pool) for j in range(layout.width)]
        return run_chunk(model, x, jnp.zeros(x.shape[:2], jnp.int32), {"blocks": pool}, slots, active)[0]

    x = jax.ShapeDtypeStruct((1, 8, cfg.model.hidden_size), jnp.float32)
    jaxpr = jax.make_jaxpr(chunk)(rows, x, jax.ShapeDtypeStruct((layout.width,), jnp.bool_))
    assert [e.primitive.name for e in jaxpr.eqns].count("cond") == 2
