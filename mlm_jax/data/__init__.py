"""Data: the embedded stdlib corpus, the byte tokenizer and the step-indexed loader."""

from mlm_jax.data.corpus import Corpus, load_stdlib_corpus
from mlm_jax.data.loader import Prefetcher, StepLoader, TokenWindows, eval_batches, global_batch, local_row_range
from mlm_jax.data.tokenizer import ByteTokenizer

__all__ = [
    "ByteTokenizer",
    "Corpus",
    "Prefetcher",
    "StepLoader",
    "TokenWindows",
    "eval_batches",
    "global_batch",
    "load_stdlib_corpus",
    "local_row_range",
]
