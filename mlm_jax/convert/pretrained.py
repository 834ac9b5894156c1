"""`load_pretrained(path)`: a trained or converted model, ready to call, without building a Trainer."""
from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from mlm_jax.config import DTYPES
from mlm_jax.convert import ConvertError, store
from mlm_jax.layers.transformer import Transformer
from mlm_jax.train.state import model_spec


def load_pretrained(path: str, *, dtype: str | None = None) -> Transformer:
    """The model of the newest checkpoint at `path` (a converted dir, a run's output dir or a checkpoints dir),
    whole on the default device, callable as `model(tokens_BS) -> logits_BSV`.

    The architecture comes from the checkpoint itself; `dtype` overrides its compute dtype (e.g. 'float32').
    """
    c = store.open_checkpoint(str(path))
    m = c.model
    if dtype is not None:
        if dtype not in DTYPES:
            raise ConvertError(f"dtype={dtype!r}: expected one of {', '.join(DTYPES)}")
        m = dataclasses.replace(m, dtype=dtype)
    spec = model_spec(m)
    return nnx.merge(spec.graphdef, store.restore_weights(c, spec.shapes, jax.devices()[0]))
