"""Byte-level tokenizer: needs no vocabulary file, so the embedded corpus trains with zero downloads."""

import numpy as np


class ByteTokenizer:
    """Ids 0..255 are UTF-8 bytes; 256 marks the end of a document."""

    eod_id = 256
    vocab_size = 257

    @property
    def fingerprint(self) -> str:
        """Stored with prepared data so a mismatch with the configured tokenizer can be caught."""
        return "byte-v1"

    def encode(self, text: str) -> np.ndarray:
        return self.encode_bytes(text.encode("utf-8"))

    def encode_bytes(self, data: bytes) -> np.ndarray:
        """Raw bytes need no decoding, so files in any encoding tokenize losslessly."""
        return np.frombuffer(data, dtype=np.uint8).astype(np.uint16)

    def decode(self, ids) -> str:
        """Drops eod and out-of-range ids; a sampled cut in the middle of a character becomes U+FFFD."""
        ids = np.asarray(ids).reshape(-1)
        data = ids[(ids >= 0) & (ids < 256)].astype(np.uint8).tobytes()
        return data.decode("utf-8", errors="replace")
