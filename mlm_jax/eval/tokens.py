"""Text to ids and back as lm-eval's `hf` model sees them through a transformers fast tokenizer over the same
tokenizer.json, so that scores match it token for token.

An encoding adds the special tokens the tokenizer.json's post-processor adds (transformers 5 keeps it, whatever
tokenizer_config.json says of `add_bos_token`). What transformers takes from the tokenizer_config.json beside it
(and, in a folder without `added_tokens_decoder` there, from special_tokens_map.json): the BOS and EOS, and the named
special tokens that decoding with `skip_special_tokens` drops along with those the tokenizer.json marks special.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from mlm_jax.infer.pretrained import Pretrained
from mlm_jax.data.tokenizer import HFTokenizer

NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def _read(path: Path) -> dict:
    if not path.is_file():
        return {}
    with open(path) as f:
        return json.load(f)


def _content(token) -> str | None:
    """A token as a config names it: a string, or an AddedToken's dict."""
    return token.get("content") if isinstance(token, dict) else token


def tokenizer_config(directory: Path) -> dict:
    """tokenizer_config.json with special_tokens_map.json's tokens over it, as transformers reads a folder."""
    config = _read(directory / "tokenizer_config.json")
    if "added_tokens_decoder" not in config:
        config.update(_read(directory / "special_tokens_map.json"))
    return config


class Codec:
    """Encodes and decodes for the harness: `eot_id` ends generations, `prefix_id` (the BOS, else the EOS) stands
    for an empty context and starts rolling windows."""

    def __init__(self, pretrained: Pretrained):
        tok = pretrained.tokenizer
        self.hf = tok if isinstance(tok, HFTokenizer) else None
        self.byte = tok if self.hf is None else None
        config = tokenizer_config(tok.path.parent) if self.hf is not None else {}
        self.bos = _content(config.get("bos_token"))
        bos_id, eos_id = self._id(self.bos), self._id(_content(config.get("eos_token")))
        self.eot_id = eos_id if eos_id is not None else pretrained.eos_ids[0]
        self.prefix_id = bos_id if bos_id is not None else self.eot_id
        extra = config.get("additional_special_tokens") or config.get("extra_special_tokens") or []
        extra = list(extra.values()) if isinstance(extra, dict) else extra
        named = [_content(config.get(k)) for k in NAMED_TOKENS] + [_content(t) for t in extra]
        self.special_ids = {i for i in map(self._id, named) if i is not None}

    def _id(self, token: str | None) -> int | None:
        return None if token is None or self.hf is None else self.hf.token_to_id(token)

    def encode(self, text: str, add_special: bool) -> list[int]:
        if self.hf is None:
            return self.byte.encode(text).tolist()
        return self.hf.encode(text, add_special_tokens=add_special).tolist()

    def encode_prompt(self, text: str) -> list[int]:
        """A generation prompt: the special tokens added unless the text already starts with the BOS."""
        return self.encode(text, add_special=not (self.bos is not None and text.startswith(self.bos)))

    def decode(self, ids, skip_special: bool) -> str:
        ids = [int(i) for i in np.asarray(ids).reshape(-1)]
        if self.hf is None:
            return self.byte.decode(ids)
        if skip_special:
            ids = [i for i in ids if i not in self.special_ids]
        return self.hf.decode(ids, skip_special_tokens=skip_special)
