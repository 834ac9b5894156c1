"""The split of the layers into pipeline chunks: the balanced split from its cost model, and the gather that
puts each chunk's layers (and, transposed, their gradients) where the stages need them.

8 fake CPU devices; the gather is checked for every stage count and split shape it can meet (layer dim split over
the stages or whole on each, layers moving one or several stages, padded slots)."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

from mlm_jax import load_config
from mlm_jax.parallel.stages import STAGE, ChunkLayout, balanced_sizes, chunk_sizes

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
    L, W = layout.layers, layout.width
    canonical = jnp.arange(L, dtype=jnp.float32)[:, None] * jnp.ones((1, 3))  # layer l holds l
    spec = PartitionSpec(STAGE) if layout.sharded else PartitionSpec()

    def per_stage(block, g_VW):
        chunks, pullback = jax.vjp(layout.gather, block)
        g, g_transposed = pullback(g_VW[:, 0])[0], jax.linear_transpose(layout._fetch, block)(g_VW[:, 0])[0]
        if not layout.sharded:
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
