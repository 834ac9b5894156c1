"""The head and cross-entropy over slices of the sequence (`train.loss_chunks`) compute what the whole logits do:
the function alone (untied, tied, soft-capped; any scale on its cotangent) and in training under layouts that shard
the vocabulary, the weights, the sequence and the layers (loss within 1e-5, every gradient leaf within 1e-4)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from families import FAMILIES
from layouts import assert_matches, fit, reference

from mlm_jax.train.loss import chunked_cross_entropy, cross_entropy

BASE = ["model.dtype=float32", "train.steps=2", "train.log_every=1", "train.eval_every=0",
        "train.global_batch_size=8", "train.seq_len=64", "log.progress=never", "optim.warmup_steps=0",
        "optim.lr=1e-2", "data.max_bytes=2000000", "checkpoint.save=false"]


def relative(a, b):
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b)))


@pytest.mark.parametrize("tied, softcap", [(False, None), (True, None), (True, 2.0)])
def test_chunks_equal_the_whole_logits(tied, softcap):
    B, S, D, V = 2, 24, 16, 40
    kx, kw, kt = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (B, S, D), jnp.float32)
    w = jax.random.normal(kw, (V, D) if tied else (D, V), jnp.float32)
    targets = jax.random.randint(kt, (B, S), 0, V)

    def whole(x, w):
        logits = jnp.einsum("bsd,vd->bsv" if tied else "bsd,dv->bsv", x, w)
        if softcap is not None:
            logits = softcap * jnp.tanh(logits / softcap)
        return 3.0 * cross_entropy(logits, targets)

    ref, ref_grads = jax.value_and_grad(whole, argnums=(0, 1))(x, w)
    for chunks in (2, 3, 8):
        loss, grads = jax.value_and_grad(lambda x, w, n=chunks: 3.0 * chunked_cross_entropy(x, w, targets, n, tied,
                                                                                         softcap),
                                         argnums=(0, 1))(x, w)
        assert abs(float(loss) - float(ref)) <= 1e-5 * abs(float(ref)), (chunks, loss, ref)
        for got, want in zip(grads, ref_grads):
            assert relative(got, want) <= 1e-4, (chunks, relative(got, want))
        forward_only = jax.jit(lambda x, w, n=chunks: chunked_cross_entropy(x, w, targets, n, tied, softcap))(x, w)
        assert abs(3.0 * float(forward_only) - float(ref)) <= 1e-5 * abs(float(ref))


@pytest.mark.parametrize("family, layout", [
    pytest.param("llama", ["parallel.data=2", "parallel.fsdp=2", "parallel.tensor=2",
                           "parallel.sequence_parallel=true"], id="llama-data2-fsdp2-tensor2-sp"),
    pytest.param("llama", ["parallel.data=2", "parallel.context=2", "parallel.tensor=2"], id="llama-context2-tensor2"),
    pytest.param("gemma3", ["parallel.data=4", "parallel.tensor=2", "train.micro_batch_size=1"],
                 id="gemma3-tied-softcap-data4-tensor2-accumulation"),
    pytest.param("llama", ["parallel.data=2", "parallel.stage=2", "parallel.tensor=2", "parallel.virtual_stages=2",
                           "model.num_layers=4"], id="llama-stage2-virtual2-data2-tensor2"),
])
def test_chunked_training_matches_one_device_in_one_piece(family, layout, tmp_path):
    model = FAMILIES.get(family, [])
    ref = reference(BASE, model + [o for o in layout if o.startswith("model.")], tmp_path / "ref")
    assert_matches(fit(BASE, model + layout + ["train.loss_chunks=4"], 8, tmp_path / "run"), ref, steps=2)
