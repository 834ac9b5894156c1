"""Data: the embedded stdlib corpus, tokenizers, prepared token directories and their windows, all free of jax.

The step-indexed loader (jax) is `mlm_jax.data.loader`, imported by its users, so preparing data never loads jax.
`python -m mlm_jax.data.prepare` makes token directories; it is not imported here, so running it as a module does
not load it twice.
"""

from mlm_jax.data.corpus import Corpus, load_stdlib_corpus
from mlm_jax.data.tokenfile import (
    BlendedTokens,
    TokenDir,
    TokenWindows,
    check_seq_len,
    check_tokenizer,
    check_vocab,
    split_by_document,
)
from mlm_jax.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = [
    "BlendedTokens",
    "ByteTokenizer",
    "Corpus",
    "HFTokenizer",
    "TokenDir",
    "TokenWindows",
    "check_seq_len",
    "check_tokenizer",
    "check_vocab",
    "load_stdlib_corpus",
    "load_tokenizer",
    "split_by_document",
]
