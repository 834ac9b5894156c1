"""What the Hugging Face interop tests share: random transformers models saved as safetensors, their logits and
ours on the same tokens, the tensors of a saved folder, and the converter CLI. Import after importorskip(torch)."""
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import torch
from safetensors.torch import load_file

from mlm_jax.convert.__main__ import main
from mlm_jax.infer.pretrained import load_pretrained

VOCAB = 512  # every tiny test model's vocabulary
TOKENS_BS = np.random.default_rng(0).integers(0, VOCAB, (2, 24))


def save_random(model, path, dtype=torch.float32, max_shard_size="5GB"):
    """`model` with every weight (norm scales and biases too) perturbed, so a swapped tensor shows, saved to
    `path`; returned in eval mode."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.to(dtype).save_pretrained(path, safe_serialization=True, max_shard_size=max_shard_size)
    return model.eval()


def hf_logits(model):
    with torch.no_grad():
        return model(torch.from_numpy(TOKENS_BS)).logits.float().numpy()


def our_logits(path):
    return np.asarray(load_pretrained(path, dtype="float32")(jnp.asarray(TOKENS_BS)))


def hf_tensors(path):
    tensors = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def convert(*args):
    assert main([str(a) for a in args]) == 0


def assert_round_trip(tmp_path, config_type, keys, dtype="bfloat16", *to_hf_args):
    """`from-hf` then `to-hf` of the folder `tmp_path/hf`: the same tensors (names, dtypes, values), and a config
    of `config_type` whose `keys` equal the original's."""
    import transformers
    convert("from-hf", tmp_path / "hf", tmp_path / "ours")
    convert("to-hf", tmp_path / "ours" / "checkpoints", tmp_path / "back", "--dtype", dtype, *to_hf_args)
    original, back = hf_tensors(tmp_path / "hf"), hf_tensors(tmp_path / "back")
    assert sorted(back) == sorted(original)
    assert all(back[k].dtype == original[k].dtype and torch.equal(back[k], original[k]) for k in original)
    before, after = (transformers.AutoConfig.from_pretrained(tmp_path / d) for d in ("hf", "back"))
    assert type(after) is config_type
    assert {k: getattr(after, k, None) for k in keys} == {k: getattr(before, k, None) for k in keys}
