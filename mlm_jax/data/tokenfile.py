"""Prepared token directories (written by `python -m mlm_jax.data.prepare`), their splits, windows and blends.

A directory holds `tokens.bin` (every document's tokens then its eod, as one flat uint16 or uint32 array),
`docs.npy` (int64 start offset of each document), `index.json` (counts, dtype, tokenizer, sources) and, for
fine-tuning data, `mask.bin` (uint8 per token: 1 on each token a model is trained to produce).
Tokens are memory-mapped, so opening a directory costs the same whatever its size.
"""

import json
import math
from fractions import Fraction
from pathlib import Path

import numpy as np

from mlm_jax.data.documents import FIELDS, document_fields
from mlm_jax.data.packing import Documents

FORMAT_VERSION = 1
INDEX_FILE = "index.json"
TOKENS_FILE = "tokens.bin"
DOCS_FILE = "docs.npy"
MASK_FILE = "mask.bin"  # fine-tuning data: uint8, 1 on each token a model is trained to produce


def token_dtype(vocab_size: int) -> np.dtype:
    """Two bytes a token whenever the ids fit: half the disk and page cache of uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


class TokenDir:
    """A prepared directory, opened read-only."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.index = _read_index(self.path)
        dtype, num_tokens = np.dtype(self.index["dtype"]), self.index["num_tokens"]
        tokens_path = self.path / TOKENS_FILE
        size = tokens_path.stat().st_size if tokens_path.is_file() else "no"
        if size != num_tokens * dtype.itemsize:
            raise ValueError(f"{tokens_path} holds {size} bytes but {INDEX_FILE} says {num_tokens} {dtype} tokens "
                             f"({num_tokens * dtype.itemsize} bytes): prepare the directory again")
        self.tokens = np.memmap(tokens_path, dtype=dtype, mode="r", shape=(num_tokens,))
        try:
            self.doc_offsets = np.load(self.path / self.index["doc_offsets"], mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as e:
            raise ValueError(f"{self.path}: cannot read document offsets ({e})") from None
        offsets = self.doc_offsets
        if (offsets.shape != (self.index["num_documents"],) or offsets.dtype != np.int64 or offsets[0] != 0
                or offsets[-1] >= num_tokens):
            raise ValueError(f"{self.path / self.index['doc_offsets']} does not match {INDEX_FILE}: "
                             "prepare the directory again")
        self.mask = None
        if "loss_mask" in self.index:
            mask_path = self.path / self.index["loss_mask"]
            if not mask_path.is_file() or mask_path.stat().st_size != num_tokens:
                raise ValueError(f"{mask_path} does not hold one byte per token: prepare the directory again")
            self.mask = np.memmap(mask_path, dtype=np.uint8, mode="r", shape=(num_tokens,))

    @property
    def fingerprint(self) -> str:
        return self.index["tokenizer"]["fingerprint"]

    @property
    def vocab_size(self) -> int:
        return self.index["tokenizer"]["vocab_size"]

    @property
    def eod_id(self) -> int:
        return self.index["tokenizer"]["eod_id"]


def _read_index(path: Path) -> dict:
    index_path = path / INDEX_FILE
    if not index_path.is_file():
        raise ValueError(f"{path} is not a prepared token directory (no {INDEX_FILE}): "
                         "make one with python -m mlm_jax.data.prepare")
    try:
        index = json.loads(index_path.read_text())
        ok = (index["format"] == FORMAT_VERSION and index["dtype"] in ("uint16", "uint32")
              and all(isinstance(index[k], int) and index[k] > 0 for k in ("num_tokens", "num_documents"))
              and isinstance(index["doc_offsets"], str)
              and all(k in index["tokenizer"] for k in ("fingerprint", "vocab_size", "eod_id")))
    except (OSError, ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise ValueError(f"{index_path} is unreadable, corrupt, or of another format version than "
                         f"{FORMAT_VERSION}: prepare the directory again")
    return index


def split_by_document(tokdir: TokenDir, validation_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation): the last ceil(fraction · documents) documents are validation.

    A cut at a document boundary keeps both halves contiguous memmap views (no copy); shuffle documents
    before preparing if their order in the inputs is not already arbitrary.
    """
    if not 0.0 < validation_fraction < 1.0:
        raise ValueError(f"validation_fraction must be in (0, 1), got {validation_fraction}")
    num_docs = len(tokdir.doc_offsets)
    num_validation = math.ceil(Fraction(str(validation_fraction)) * num_docs)  # exact: 0.1 · 30 is 3, not 3.0000…4
    if num_validation >= num_docs:
        raise ValueError(f"{tokdir.path} has {num_docs} documents: validation_fraction={validation_fraction} "
                         "leaves none for training")
    cut = int(tokdir.doc_offsets[num_docs - num_validation])
    return tokdir.tokens[:cut], tokdir.tokens[cut:]


def split_documents(tokdir: TokenDir, validation_fraction: float) -> tuple[Documents, Documents]:
    """`split_by_document`'s two parts as whole documents, with their loss masks (for packing)."""
    train, validation = split_by_document(tokdir, validation_fraction)
    cut, offsets = len(train), np.asarray(tokdir.doc_offsets)
    mask = tokdir.mask
    return (Documents(train, offsets[offsets < cut], None if mask is None else mask[:cut], f"{tokdir.path} (train)"),
            Documents(validation, offsets[offsets >= cut] - cut, None if mask is None else mask[cut:],
                      f"{tokdir.path} (validation)"))


def check_tokenizer(tokdir: TokenDir, expected_fingerprint: str) -> None:
    if tokdir.fingerprint != expected_fingerprint:
        tok = tokdir.index["tokenizer"]
        raise ValueError(f"{tokdir.path} was tokenized with {tok.get('path') or tok.get('kind')} "
                         f"({tokdir.fingerprint}), not the run's tokenizer ({expected_fingerprint}): "
                         "prepare it again with the run's tokenizer")


def check_vocab(tokdir: TokenDir, model_vocab_size: int) -> None:
    if tokdir.vocab_size > model_vocab_size:
        raise ValueError(f"{tokdir.path} uses token ids up to {tokdir.vocab_size - 1}, beyond the model's "
                         f"vocab_size={model_vocab_size}: raise it to at least {tokdir.vocab_size}")


def check_seq_len(tokens: np.ndarray, seq_len: int, name: str) -> None:
    if len(tokens) < seq_len + 1:
        raise ValueError(f"{name} has {len(tokens)} tokens, fewer than one window of seq_len + 1 = {seq_len + 1}")


class TokenWindows:
    """Non-overlapping windows of seq_len + 1 tokens over a flat token array (the +1 is the shifted target). With
    `eod_id`, the documents in a window stay apart (`fields`, `data.documents`)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, eod_id: int | None = None):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.eod_id = eod_id
        self.keys = ("inputs", "targets") + (FIELDS if eod_id is not None else ())
        self.num_windows = max(0, (len(tokens) - 1) // seq_len)
        if self.num_windows < 1:
            raise ValueError(
                f"{len(tokens)} tokens do not make one window of seq_len={seq_len} (need {seq_len + 1})"
            )

    def pairs(self, window_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets), int32 of shape (len(window_ids), seq_len): window[:-1] and window[1:]."""
        starts = np.asarray(window_ids, dtype=np.int64) * self.seq_len
        windows = self.tokens[starts[:, None] + np.arange(self.seq_len + 1)].astype(np.int32)
        return np.ascontiguousarray(windows[:, :-1]), np.ascontiguousarray(windows[:, 1:])

    def fields(self, window_ids: np.ndarray) -> dict[str, np.ndarray]:
        """The batch fields of `keys`."""
        inputs, targets = self.pairs(window_ids)
        out = {"inputs": inputs, "targets": targets}
        return out if self.eod_id is None else {**out, **document_fields(inputs, self.eod_id)}


class BlendedTokens:
    """Windows from several token arrays (or rows of packed examples, `packing.PackedRows`), source k taking the
    fraction weights[k] of every prefix of window ids.

    Window id g goes to the source a fixed periodic schedule names (see `_schedule`); the j-th window of
    source k is window j of its own seeded permutation, re-drawn each time the source wraps. So windows are
    a pure function of (sources, weights, seq_len, seed, g), like `StepLoader`'s samples, and any id is valid.
    """

    _MAX_PERIOD = 1 << 16

    def __init__(self, sources: list, weights: list[float], seq_len: int, seed: int, eod_id: int | None = None):
        if len(sources) != len(weights) or not sources:
            raise ValueError(f"need one weight per source, got {len(sources)} sources and {len(weights)} weights")
        if not all(math.isfinite(w) and w > 0 for w in weights):
            raise ValueError(f"weights must be positive and finite, got {list(weights)}")
        for k, tokens in enumerate(sources):
            if isinstance(tokens, np.ndarray):
                check_seq_len(tokens, seq_len, f"blend source {k}")
        self.seq_len = seq_len
        self.seed = seed
        self._windows = [TokenWindows(s, seq_len, eod_id) if isinstance(s, np.ndarray) else s for s in sources]
        self.keys = self._windows[0].keys
        self.num_windows = sum(w.num_windows for w in self._windows)  # distinct windows; ids beyond wrap
        self.quotas = _quotas(weights, self._MAX_PERIOD)
        priority = np.random.default_rng([seed]).permutation(len(sources))
        self._source_of, self._rank = _schedule(self.quotas, priority.tolist())
        self._perms = [(-1, np.empty(0, np.int64))] * len(sources)  # (epoch, perm), replaced whole per source

    def source_of(self, window_ids: np.ndarray) -> np.ndarray:
        return self._source_of[np.asarray(window_ids, dtype=np.int64) % len(self._source_of)]

    def pairs(self, window_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets), int32 of shape (len(window_ids), seq_len), as `TokenWindows.pairs`."""
        out = self._read(window_ids, lambda windows, ids: dict(zip(("inputs", "targets"), windows.pairs(ids))))
        return out["inputs"], out["targets"]

    def fields(self, window_ids: np.ndarray) -> dict[str, np.ndarray]:
        """The batch fields of `keys`, as `TokenWindows.fields`."""
        return self._read(window_ids, lambda windows, ids: windows.fields(ids))

    def _read(self, window_ids: np.ndarray, read) -> dict[str, np.ndarray]:
        ids = np.asarray(window_ids, dtype=np.int64)
        cycles, phases = np.divmod(ids, len(self._source_of))
        sources = self._source_of[phases]
        local = cycles * np.asarray(self.quotas, dtype=np.int64)[sources] + self._rank[phases]
        out = {}
        for k in np.unique(sources):
            sel = sources == k
            for key, value in read(self._windows[k], self._shuffled(int(k), local[sel])).items():
                if key not in out:
                    out[key] = np.empty((len(ids), self.seq_len), value.dtype)
                out[key][sel] = value
        return out

    def _shuffled(self, k: int, local: np.ndarray) -> np.ndarray:
        epochs, positions = np.divmod(local, self._windows[k].num_windows)
        out = np.empty_like(local)
        for epoch in np.unique(epochs):
            cached_epoch, perm = self._perms[k]
            if cached_epoch != epoch:
                perm = np.random.default_rng([self.seed, k, int(epoch)]).permutation(self._windows[k].num_windows)
                self._perms[k] = (int(epoch), perm)
            out[epochs == epoch] = perm[positions[epochs == epoch]]
        return out


def _quotas(weights: list[float], max_period: int) -> list[int]:
    """Windows per source in one period: exact for simple ratios (0.7/0.3 -> 7, 3; 1:2 -> 1, 2), else the
    weights rounded to 1/max_period (at least one window each)."""
    fractions = [Fraction(float(w)).limit_denominator(max_period) for w in weights]
    if all(fractions):
        shares = [f / sum(fractions) for f in fractions]
        period = math.lcm(*(s.denominator for s in shares))
        if period <= max_period:
            return [int(s * period) for s in shares]
    total = sum(weights)
    return [max(1, round(w / total * max_period)) for w in weights]


def _schedule(quotas: list[int], priority: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(source of each slot, its rank among that source's slots) over one period of sum(quotas) slots.

    Earliest-deadline-first on Tijdeman's chairman assignment (1980): with m sources and shares p_k, every
    prefix of n slots gives source k within 1 - 1/(2m - 2) of n·p_k, so under one window. Slot n may go to
    k once n·p_k - c_k >= 1/(2m-2) (c_k its slots so far); its deadline is the last slot n at which it is still
    within 1 - 1/(2m-2) of n·p_k. Integer arithmetic, ties to the seeded priority, so the schedule is
    reproducible; after one period every c_k equals its quota, so it repeats exactly.
    """
    period, m = sum(quotas), len(quotas)
    if m == 1:
        return np.zeros(period, np.int32), np.arange(period, dtype=np.int64)
    u = 2 * m - 2
    counts = [0] * m
    source_of = np.empty(period, np.int32)
    rank = np.empty(period, np.int64)
    for n in range(1, period + 1):
        best, best_deadline = -1, 0
        for k in priority:
            if u * (n * quotas[k] - counts[k] * period) >= period:
                deadline = (counts[k] * u + u - 1) * period // (u * quotas[k])
                if best < 0 or deadline < best_deadline:
                    best, best_deadline = k, deadline
        assert best >= 0, "Tijdeman: some source is always eligible"
        source_of[n - 1], rank[n - 1] = best, counts[best]
        counts[best] += 1
    assert counts == quotas
    return source_of, rank
