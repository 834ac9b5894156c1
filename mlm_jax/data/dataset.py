"""The run's train and validation data from `data.*`: prepared token directories, blended, or the embedded corpus."""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from mlm_jax.config import ConfigError, DataConfig
from mlm_jax.data.corpus import load_stdlib_corpus
from mlm_jax.data.tokenfile import (BlendedTokens, TokenDir, check_seq_len, check_tokenizer, check_vocab,
                                    split_by_document)
from mlm_jax.data.tokenizer import ByteTokenizer, load_tokenizer


@dataclass(frozen=True)
class Datasets:
    train: np.ndarray | BlendedTokens
    validation: np.ndarray | BlendedTokens
    description: str
    eod_id: int  # the token that ends every document


def build_datasets(d: DataConfig, seq_len: int, vocab_size: int, seed: int) -> Datasets:
    """Every mismatch between the data and the run raises ConfigError naming the key."""
    if not d.paths:
        if ByteTokenizer.vocab_size > vocab_size:
            raise ConfigError(f"model.vocab_size={vocab_size} is smaller than the byte tokenizer's "
                              f"{ByteTokenizer.vocab_size} tokens")
        if d.tokenizer != "byte":
            raise ConfigError(f"data.tokenizer={d.tokenizer!r}: the embedded corpus is byte-tokenized; "
                              f"set data.paths to prepared directories")
        try:
            corpus = load_stdlib_corpus(d.validation_fraction, d.max_bytes)
            check_seq_len(corpus.train, seq_len, "the embedded corpus")
        except ValueError as e:
            raise ConfigError(f"data: {e}") from None
        return Datasets(corpus.train, corpus.validation, corpus.description, ByteTokenizer.eod_id)
    try:
        tokenizer = load_tokenizer(d.tokenizer)
    except (OSError, ValueError, ImportError) as e:
        raise ConfigError(f"data.tokenizer={d.tokenizer}: {e}") from None
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(f"data.tokenizer={d.tokenizer} has {tokenizer.vocab_size} tokens, more than "
                          f"model.vocab_size={vocab_size}")
    fingerprint = tokenizer.fingerprint
    trains, vals = [], []
    for path in d.paths:
        if not os.path.isdir(path):
            raise ConfigError(f"data.paths: {path} is not a directory")
        try:
            tokdir = TokenDir(path)
            check_tokenizer(tokdir, fingerprint)
            check_vocab(tokdir, vocab_size)
            train, val = split_by_document(tokdir, d.validation_fraction)
            check_seq_len(train, seq_len, f"{path} (train split)")
            check_seq_len(val, seq_len, f"{path} (validation split)")
        except ValueError as e:
            raise ConfigError(f"data.paths: {e}") from None
        trains.append(train)
        vals.append(val)
    weights = d.weights or [float(len(t)) for t in trains]
    described = ", ".join(f"{p} ({len(t):,} train tokens, weight {w:g})" for p, t, w in zip(d.paths, trains, weights))
    return Datasets(BlendedTokens(trains, weights, seq_len, seed), BlendedTokens(vals, weights, seq_len, seed),
                    f"{len(d.paths)} prepared dir(s): {described}", tokenizer.eod_id)
