"""Tokenizers: byte-level (no vocabulary file, so the embedded corpus trains with zero downloads) or a local
Hugging Face `tokenizer.json` through the optional `tokenizers` package."""

import hashlib
from pathlib import Path

import numpy as np

# Names that tokenizer.json files commonly give their end-of-text token; the file itself does not say which it is.
EOD_TOKEN_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>")


class ByteTokenizer:
    """Ids 0..255 are UTF-8 bytes; 256 marks the end of a document."""

    eod_id = 256
    vocab_size = 257

    @property
    def fingerprint(self) -> str:
        """Stored with prepared data so a mismatch with the configured tokenizer can be caught."""
        return "byte-v1"

    def describe(self) -> dict:
        """The tokenizer entry of a prepared directory's index."""
        return {"kind": "byte", "path": None, "fingerprint": self.fingerprint, "vocab_size": self.vocab_size,
                "eod_id": self.eod_id}

    def encode(self, text: str, add_special_tokens: bool = False) -> np.ndarray:
        """Bytes only: the byte tokenizer has no special token to add."""
        return self.encode_bytes(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def encode_bytes(self, data: bytes) -> np.ndarray:
        """Raw bytes need no decoding, so files in any encoding tokenize losslessly."""
        return np.frombuffer(data, dtype=np.uint8).astype(np.uint16)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Drops eod and out-of-range ids; a sampled cut in the middle of a character becomes U+FFFD."""
        ids = np.asarray(ids).reshape(-1)
        data = ids[(ids >= 0) & (ids < 256)].astype(np.uint8).tobytes()
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """A local tokenizer.json. The fingerprint is the file's sha256, so any edit to the vocabulary is caught."""

    def __init__(self, path: str | Path, eod_token: str | None = None, eod_id: int | None = None):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ImportError("a tokenizer.json needs the `tokenizers` package: pip install tokenizers") from None
        self.path = Path(path).resolve()
        if self.path.is_dir():
            self.path = self.path / "tokenizer.json"
        data = self.path.read_bytes()
        try:
            self._tokenizer = Tokenizer.from_str(data.decode("utf-8"))
        except Exception as e:  # the Rust library raises a bare Exception for any malformed file
            raise ValueError(f"{self.path} is not a valid tokenizer.json ({e})") from None
        self.fingerprint = "sha256:" + hashlib.sha256(data).hexdigest()
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1  # ids the model's embedding must cover, holes included
        self.eod_id = self._eod_id(vocab, eod_token) if eod_id is None else eod_id  # a model's config may say

    def _eod_id(self, vocab: dict[str, int], eod_token: str | None) -> int:
        if eod_token is not None:
            if eod_token not in vocab:
                raise ValueError(f"--eod-token {eod_token!r} is not in the vocabulary of {self.path}")
            return vocab[eod_token]
        for name in EOD_TOKEN_NAMES:
            if name in vocab:
                return vocab[name]
        raise ValueError(f"{self.path} has none of the usual end-of-text tokens ({', '.join(EOD_TOKEN_NAMES)}): "
                         "name one with --eod-token")

    def describe(self) -> dict:
        return {"kind": "huggingface", "path": str(self.path), "fingerprint": self.fingerprint,
                "vocab_size": self.vocab_size, "eod_id": self.eod_id}

    def encode(self, text: str, add_special_tokens: bool = False) -> np.ndarray:
        """`add_special_tokens`: what the tokenizer's post-processor adds (a BOS, say), as a prompt is encoded."""
        return self.encode_batch([text], add_special_tokens)[0]

    def encode_batch(self, texts: list[str], add_special_tokens: bool = False) -> list[np.ndarray]:
        """By default no special tokens: in training data, documents are separated by eod alone."""
        encodings = self._tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)
        return [np.asarray(e.ids, dtype=np.uint32) for e in encodings]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tokenizer.decode([int(i) for i in np.asarray(ids).reshape(-1)],
                                      skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)


def load_tokenizer(spec: str, eod_token: str | None = None) -> ByteTokenizer | HFTokenizer:
    """`byte`, or the path of a tokenizer.json (or of a directory holding one)."""
    if spec == "byte":
        if eod_token is not None:
            raise ValueError("--eod-token applies to a tokenizer.json; the byte tokenizer's eod is fixed")
        return ByteTokenizer()
    return HFTokenizer(spec, eod_token)
