"""Whole examples packed into rows, for fine-tuning: each row holds seq_len + 1 tokens (its inputs and their
targets), filled with whole documents (best-fit decreasing over shuffled buffers of them, deterministic in the seed),
each its own segment (`data.documents`), the rest padding that no loss reads. An example longer than a row is
refused, or cut to a row, as `data.long_examples` says; none is ever split over rows.

A row is then what a window of the token stream is to pretraining: the loader reads rows by step and seed, so
resuming needs only the step. Shapes: R rows read, S sequence.
"""
from __future__ import annotations

import bisect

import numpy as np

from mlm_jax.data.documents import FIELDS

BUFFER = 4096  # documents packed together: larger fills rows better and takes longer to pack


class Documents:
    """A directory split's documents: tokens (each document ending with its end-of-document token), their starts,
    and the loss mask (1 on each token trained as a target; None: every token)."""

    def __init__(self, tokens: np.ndarray, starts: np.ndarray, mask: np.ndarray | None, name: str):
        self.tokens, self.starts, self.mask, self.name = tokens, np.asarray(starts, np.int64), mask, name

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(np.append(self.starts, len(self.tokens)))


class PackedRows:
    """`documents` packed into rows of `seq_len` + 1 tokens; `pairs` and `fields` read rows by id, as
    `tokenfile.TokenWindows` reads windows."""

    keys = ("inputs", "targets") + FIELDS

    def __init__(self, documents: Documents, seq_len: int, seed: int, eod_id: int, truncate: bool = False):
        self.documents, self.seq_len, self.eod_id = documents, seq_len, eod_id
        room = seq_len + 1
        lengths = documents.lengths
        longest = int(lengths.max()) if len(lengths) else 0
        if longest > room and not truncate:
            raise ValueError(f"{documents.name}: {int((lengths > room).sum())} example(s) are longer than a row of "
                             f"train.seq_len + 1 = {room} tokens (the longest {longest}): set data.long_examples="
                             f"truncate to cut them, or raise train.seq_len")
        self.lengths = np.minimum(lengths, room)
        order = np.random.default_rng([seed]).permutation(len(lengths))
        rows: list[list[int]] = []
        for start in range(0, len(order), BUFFER):
            rows += _best_fit(order[start:start + BUFFER], self.lengths, room)
        if not rows:
            raise ValueError(f"{documents.name}: no example to pack")
        self.row_docs = np.concatenate([np.asarray(r, np.int64) for r in rows])
        self.row_starts = np.cumsum([0] + [len(r) for r in rows])
        self.num_windows = len(rows)
        self.efficiency = float(self.lengths.sum() / (self.num_windows * room))

    def pairs(self, row_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        out = self.fields(row_ids)
        return out["inputs"], out["targets"]

    def fields(self, row_ids: np.ndarray) -> dict[str, np.ndarray]:
        """Rows as the loader's batch fields: each document its own segment, positions from its start, the loss
        mask on the targets that stay within a document and that its mask trains on."""
        S, room = self.seq_len, self.seq_len + 1
        rows = len(row_ids)
        tokens = np.full((rows, room), self.eod_id, np.int32)
        segments = np.zeros((rows, room), np.int32)
        positions = np.zeros((rows, room), np.int32)
        trained = np.zeros((rows, room), np.float32)  # at token t: the target t is trained on (of t - 1's input)
        docs, doc_mask = self.documents, self.documents.mask
        for r, row in enumerate(np.asarray(row_ids, np.int64)):
            at = 0
            members = self.row_docs[self.row_starts[row]:self.row_starts[row + 1]]
            for i, d in enumerate(members):
                n, begin = int(self.lengths[d]), int(docs.starts[d])
                tokens[r, at:at + n] = docs.tokens[begin:begin + n]
                segments[r, at:at + n] = i
                positions[r, at:at + n] = np.arange(n)
                trained[r, at + 1:at + n] = 1 if doc_mask is None else doc_mask[begin + 1:begin + n]
                at += n
            segments[r, at:] = len(members)  # padding: a segment of its own
        return {"inputs": tokens[:, :S], "targets": tokens[:, 1:], "segment_ids": segments[:, :S],
                "positions": positions[:, :S], "loss_mask": trained[:, 1:]}


def _best_fit(docs: np.ndarray, lengths: np.ndarray, room: int) -> list[list[int]]:
    """Rows of `docs`, longest first, each into the row with the least room that holds it (a new row if none)."""
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row), sorted
    for d in sorted(docs.tolist(), key=lambda d: (-lengths[d], d)):
        n = int(lengths[d])
        i = bisect.bisect_left(free, (n, -1))
        if i < len(free):
            left, row = free.pop(i)
        else:
            left, row = room, len(rows)
            rows.append([])
        rows[row].append(d)
        if left - n > 0:
            bisect.insort(free, (left - n, row))
    return rows
