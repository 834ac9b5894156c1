"""Data: the embedded stdlib corpus, tokenizers, prepared token directories and the step-indexed loader.

`python -m mlm_jax.data.prepare` makes token directories; it is not imported here, so running it as a module
does not load it twice.
"""

from mlm_jax.data.corpus import Corpus, load_stdlib_corpus
from mlm_jax.data.tokenfile import (
    BlendedTokens,
    TokenDir,
    check_seq_len,
    check_tokenizer,
    check_vocab,
    split_by_document,
)
from mlm_jax.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

_LOADER_NAMES = frozenset({"Prefetcher", "StepLoader", "TokenWindows", "eval_batches", "global_batch",
                           "local_row_range"})

__all__ = [
    "BlendedTokens",
    "ByteTokenizer",
    "Corpus",
    "HFTokenizer",
    "Prefetcher",
    "StepLoader",
    "TokenDir",
    "TokenWindows",
    "check_seq_len",
    "check_tokenizer",
    "check_vocab",
    "eval_batches",
    "global_batch",
    "load_stdlib_corpus",
    "load_tokenizer",
    "local_row_range",
    "split_by_document",
]


def __getattr__(name):
    if name in _LOADER_NAMES:  # keeps data preparation free of jax: the loader loads on first use
        from mlm_jax.data import loader
        return getattr(loader, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
