"""`load_pretrained(path)`: a trained or converted model, ready to call, without building a Trainer; and
`load_tokenizer(path)`, the tokenizer that goes with it."""
from __future__ import annotations

import dataclasses
import json
import os

import jax
from flax import nnx

from mlm_jax.checkpoint import weights as store
from mlm_jax.checkpoint.weights import ConvertError
from mlm_jax.config import DTYPES, Config, ParallelConfig
from mlm_jax.data.tokenizer import ByteTokenizer, HFTokenizer
from mlm_jax.model.transformer import Transformer, model_spec
from mlm_jax.parallel import sharding as shd
from mlm_jax.setup import setup


def load_pretrained(path: str, *, dtype: str | None = None, tensor: int = 1) -> Transformer:
    """The model of the newest checkpoint at `path` (a converted dir, a run's output dir or a checkpoints dir),
    callable as `model(tokens_BS) -> logits_BSV`: whole on the default device, or with `tensor` > 1 split over that
    many local devices by the rules table (Megatron's tensor parallelism, as in training), which `mlm_jax.generate`
    and `mlm_jax.eval` then run on. Its kernels are those the run's checks choose for these devices
    (`mlm_jax.setup`).

    The architecture comes from the checkpoint itself; `dtype` overrides its compute dtype (e.g. 'float32').
    """
    c = store.open_checkpoint(str(path))
    m = c.model
    if dtype is not None:
        if dtype not in DTYPES:
            raise ConvertError(f"dtype={dtype!r}: expected one of {', '.join(DTYPES)}")
        m = dataclasses.replace(m, dtype=dtype)
    devices = jax.local_devices()
    if not (isinstance(tensor, int) and 1 <= tensor <= len(devices)):
        raise ConvertError(f"tensor={tensor!r}: expected an integer from 1 to the {len(devices)} local devices")
    su = setup(Config(model=m, parallel=ParallelConfig(data=1, tensor=tensor)), devices[:tensor])
    spec = model_spec(m, su.plan.kernels)
    shardings = None
    if tensor > 1:
        shardings = shd.named(su.mesh, shd.param_specs(spec.names, spec.shapes, su.mesh, su.rules))
    return nnx.merge(spec.graphdef, store.restore_weights(c, spec.shapes, devices[0], shardings))


@dataclasses.dataclass(frozen=True)
class Pretrained:
    """What generation and evaluation need to know of a checkpoint besides its weights."""

    tokenizer: ByteTokenizer | HFTokenizer
    eos_ids: tuple[int, ...]  # the tokens that end a generation
    context: int  # the longest sequence the model was trained for (prompt and new tokens together)


def load_tokenizer(path: str, tokenizer: str | None = None) -> Pretrained:
    """The tokenizer of the checkpoint at `path`, checked against its model: `tokenizer` (a tokenizer.json, or
    `byte`) if given, else the `tokenizer.json` that `convert from-hf` kept beside the checkpoints, else the one
    the run trained with (`data.tokenizer`). A tokenizer with ids past the model's vocabulary is refused."""
    c = store.open_checkpoint(str(path))
    home = os.path.dirname(c.directory)  # the converted or run dir holding `checkpoints/`
    hf = c.meta.get("hf")  # present in a converted checkpoint
    if tokenizer is None:
        if os.path.isfile(os.path.join(home, "tokenizer.json")):
            tokenizer = os.path.join(home, "tokenizer.json")
        elif hf is not None:
            raise ConvertError(f"{home}: no tokenizer.json beside the checkpoint (convert from-hf copies the source "
                               f"folder's): name one with --tokenizer")
        else:
            tokenizer = c.meta["config"].get("data", {}).get("tokenizer", "byte")
    eos = (hf or {}).get("eos_token_id")
    generation = os.path.join(home, "generation_config.json")
    if os.path.isfile(generation):
        with open(generation) as f:
            eos = json.load(f).get("eos_token_id", eos)
    eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
    try:
        tok = ByteTokenizer() if tokenizer == "byte" else HFTokenizer(tokenizer, eod_id=eos[0] if eos else None)
    except (OSError, ValueError, ImportError) as e:
        raise ConvertError(f"tokenizer {tokenizer}: {e}") from None
    vocab = c.model.vocab_size
    if tok.vocab_size > vocab:
        raise ConvertError(f"tokenizer {tokenizer} has {tok.vocab_size} ids, more than the checkpoint's "
                           f"model.vocab_size={vocab}: it does not belong to this model")
    eos = eos or (tok.eod_id,)
    train = c.meta["config"].get("train", {})
    context = int((hf or {}).get("max_position_embeddings") or train.get("seq_len") or 0)
    return Pretrained(tok, eos, context)
