"""The run's train and validation data from `data.*`: prepared token directories, blended, or the embedded corpus, as
windows of the token stream (documents kept apart where `data.document_masking` says) or rows of packed examples."""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from mlm_jax.config import ConfigError, DataConfig
from mlm_jax.data.corpus import load_stdlib_corpus
from mlm_jax.data.packing import Documents, PackedRows
from mlm_jax.data.tokenfile import (BlendedTokens, TokenDir, TokenWindows, check_seq_len, check_tokenizer,
                                    check_vocab, split_documents)
from mlm_jax.data.tokenizer import ByteTokenizer, load_tokenizer


@dataclass(frozen=True)
class Datasets:
    train: TokenWindows | BlendedTokens | PackedRows  # windows the loader reads by id (`fields`, `keys`)
    validation: TokenWindows | BlendedTokens | PackedRows
    description: str
    eod_id: int  # the token that ends every document


def build_datasets(d: DataConfig, seq_len: int, vocab_size: int, seed: int) -> Datasets:
    """Every mismatch between the data and the run raises ConfigError naming the key."""
    if d.packing and not d.masks_documents:
        raise ConfigError("data.packing=true keeps packed examples apart, which data.document_masking=false would "
                          "not: set data.document_masking=true")
    if not d.paths:
        if ByteTokenizer.vocab_size > vocab_size:
            raise ConfigError(f"model.vocab_size={vocab_size} is smaller than the byte tokenizer's "
                              f"{ByteTokenizer.vocab_size} tokens")
        if d.tokenizer != "byte":
            raise ConfigError(f"data.tokenizer={d.tokenizer!r}: the embedded corpus is byte-tokenized; "
                              f"set data.paths to prepared directories")
        eod = ByteTokenizer.eod_id
        try:
            corpus = load_stdlib_corpus(d.validation_fraction, d.max_bytes)
            check_seq_len(corpus.train, seq_len, "the embedded corpus")
            if d.packing:
                train, validation = (_packed(Documents(t, _starts(t, eod), None, f"the embedded corpus ({part})"),
                                             d, seq_len, seed, eod)
                                     for t, part in ((corpus.train, "train"), (corpus.validation, "validation")))
                return Datasets(train, validation, f"{corpus.description}, {_packed_text([train])}", eod)
        except ValueError as e:
            raise ConfigError(f"data: {e}") from None
        masked = eod if d.masks_documents else None
        return Datasets(TokenWindows(corpus.train, seq_len, masked), TokenWindows(corpus.validation, seq_len, masked),
                        corpus.description, eod)
    try:
        tokenizer = load_tokenizer(d.tokenizer)
    except (OSError, ValueError, ImportError) as e:
        raise ConfigError(f"data.tokenizer={d.tokenizer}: {e}") from None
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(f"data.tokenizer={d.tokenizer} has {tokenizer.vocab_size} tokens, more than "
                          f"model.vocab_size={vocab_size}")
    eod, tokdirs = tokenizer.eod_id, []
    for path in d.paths:
        if not os.path.isdir(path):
            raise ConfigError(f"data.paths: {path} is not a directory")
        try:
            tokdir = TokenDir(path)
            check_tokenizer(tokdir, tokenizer.fingerprint)
            check_vocab(tokdir, vocab_size)
        except ValueError as e:
            raise ConfigError(f"data.paths: {e}") from None
        tokdirs.append(tokdir)
    packing = d.packing if d.packing is not None else any(t.mask is not None for t in tokdirs)
    if not packing and (sft := [t.path for t in tokdirs if t.mask is not None]):
        raise ConfigError(f"data.packing=false with fine-tuning data ({sft[0]} holds a loss mask, which windows of "
                          f"the token stream do not read): leave data.packing unset")
    trains, vals = [], []
    for tokdir in tokdirs:
        try:
            train, val = split_documents(tokdir, d.validation_fraction)
            if packing:
                trains.append(_packed(train, d, seq_len, seed, eod))
                vals.append(_packed(val, d, seq_len, seed, eod))
            else:
                check_seq_len(train.tokens, seq_len, f"{tokdir.path} (train split)")
                check_seq_len(val.tokens, seq_len, f"{tokdir.path} (validation split)")
                trains.append(train.tokens)
                vals.append(val.tokens)
        except ValueError as e:
            raise ConfigError(f"data.paths: {e}") from None
    sizes = [float(t.lengths.sum() if packing else len(t)) for t in trains]
    weights = d.weights or sizes
    described = ", ".join(f"{t.path} ({int(n):,} train tokens, weight {w:g})"
                          for t, n, w in zip(tokdirs, sizes, weights))
    description = f"{len(d.paths)} prepared dir(s): {described}" + (f", {_packed_text(trains)}" if packing else "")
    masked = eod if d.masks_documents else None
    return Datasets(BlendedTokens(trains, weights, seq_len, seed, masked), BlendedTokens(vals, weights, seq_len, seed,
                                                                                         masked), description, eod)


def _starts(tokens: np.ndarray, eod: int) -> np.ndarray:
    """The documents' starts in a token stream whose documents each end with `eod`."""
    ends = np.flatnonzero(np.asarray(tokens) == eod) + 1
    return np.concatenate([[0], ends[:-1] if len(ends) and ends[-1] == len(tokens) else ends])


def _packed(documents: Documents, d: DataConfig, seq_len: int, seed: int, eod: int) -> PackedRows:
    return PackedRows(documents, seq_len, seed, eod, truncate=d.long_examples == "truncate")


def _packed_text(rows: list[PackedRows]) -> str:
    examples = sum(len(r.lengths) for r in rows)
    return (f"packed: {examples:,} examples into {sum(r.num_windows for r in rows):,} rows, "
            f"efficiency {100 * sum(r.efficiency * r.num_windows for r in rows) / sum(r.num_windows for r in rows):.1f}%"
            f" (example tokens / row tokens)")
