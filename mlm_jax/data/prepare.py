"""`python -m mlm_jax.data.prepare --input FILES... --tokenizer byte|tokenizer.json --output DIR`

Tokenizes .txt (a document per file), .jsonl (a document per line) and .parquet (a document per row) into a
prepared token directory (format in `tokenfile.py`). The output appears whole or not at all: it is built
in a hidden sibling directory and renamed into place, so a killed run leaves no half-written DIR.
"""

import argparse
import collections
import json
import multiprocessing
import os
import shutil
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from mlm_jax.data.tokenfile import DOCS_FILE, FORMAT_VERSION, INDEX_FILE, TOKENS_FILE, token_dtype
from mlm_jax.data.tokenizer import load_tokenizer

EXTENSIONS = (".txt", ".jsonl", ".parquet")
_CHUNK_CHARS = 1 << 20  # text per tokenization task: large enough to amortize inter-process transfer


class PrepareError(Exception):
    """A user mistake: reported as one `error: ...` line and exit code 2."""


def prepare(inputs: list[str], tokenizer: str, output: str, text_field: str = "text", workers: int = 1,
            eod_token: str | None = None, force: bool = False) -> dict:
    """Writes the prepared directory `output` and returns its index."""
    paths = [_check_input(p) for p in inputs]
    out = Path(output)
    _check_output(out, force)
    if workers < 1:
        raise PrepareError(f"--workers must be >= 1, got {workers}")
    try:
        tok = load_tokenizer(tokenizer, eod_token)
    except OSError as e:
        raise PrepareError(f"--tokenizer {tokenizer}: cannot read {e.filename} ({e.strerror})") from None
    except (ValueError, ImportError) as e:
        raise PrepareError(f"--tokenizer {tokenizer}: {e}") from None
    if any(p.suffix == ".parquet" for p in paths):
        _pyarrow()
    progress = _Progress()

    def fill(tmp: Path) -> dict:
        dtype = token_dtype(tok.vocab_size)
        starts, num_tokens = [], 0
        try:
            with open(tmp / TOKENS_FILE, "wb") as f:
                for tokens, lengths, text_bytes in _tokenize(_chunks(paths, text_field), tok, workers):
                    starts.append(num_tokens + np.cumsum(lengths) - lengths)
                    num_tokens += len(tokens)
                    f.write(tokens.tobytes())
                    progress.update(len(lengths), len(tokens), text_bytes)
        finally:
            progress.close()
        offsets = np.concatenate(starts) if starts else np.empty(0, np.int64)
        if num_tokens == len(offsets):
            raise PrepareError(f"no text in {', '.join(inputs)}: every input is empty")
        np.save(tmp / DOCS_FILE, offsets)
        index = {
            "format": FORMAT_VERSION,
            "dtype": dtype.name,
            "num_tokens": num_tokens,
            "num_documents": len(offsets),
            "doc_offsets": DOCS_FILE,
            "tokenizer": tok.describe(),
            "sources": [{"path": str(p.resolve()), "bytes": p.stat().st_size} for p in paths],
        }
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return index

    index = _write_atomically(out, fill)
    progress.finish(out, index)
    return index


def _check_input(name: str) -> Path:
    path = Path(name)
    if not path.is_file():
        raise PrepareError(f"--input {name}: no such file")
    if path.suffix not in EXTENSIONS:
        raise PrepareError(f"--input {name}: unknown extension {path.suffix or '(none)'!r}, "
                           f"expected {', '.join(EXTENSIONS)}")
    return path


def _check_output(out: Path, force: bool) -> None:
    """--force replaces only a prepared or empty directory, so a typo cannot wipe an unrelated one."""
    if not out.exists():
        return
    if not force:
        raise PrepareError(f"--output {out} already exists: pass --force to replace it")
    if not ((out / INDEX_FILE).is_file() or (out.is_dir() and not any(out.iterdir()))):
        raise PrepareError(f"--output {out} exists and is not a prepared token directory: not replacing it")


def _pyarrow():
    try:
        import pyarrow.parquet
    except ImportError:
        raise PrepareError("reading .parquet needs the `pyarrow` package: pip install pyarrow") from None
    return pyarrow


def _write_atomically(out: Path, fill) -> dict:
    """fill(tmp) writes everything into a sibling of `out`, renamed to `out` only once complete."""
    new_parents = [p for p in reversed(out.parents) if not p.exists()]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        result = fill(tmp)
        if out.exists():  # --force, checked by _check_output
            old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
        return result
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for p in reversed(new_parents):
            p.rmdir()
        raise


def _documents(path: Path, text_field: str) -> Iterator[str]:
    """Non-empty documents of one input file, in file order."""
    try:
        if path.suffix == ".txt":
            yield from _txt_documents(path)
        elif path.suffix == ".jsonl":
            yield from _jsonl_documents(path, text_field)
        else:
            yield from _parquet_documents(path, text_field)
    except OSError as e:
        raise PrepareError(f"{path}: cannot read ({e.strerror or e})") from None


def _txt_documents(path: Path) -> Iterator[str]:
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise PrepareError(f"{path}: not UTF-8 text (byte {e.start})") from None
    if text:
        yield text


def _jsonl_documents(path: Path, text_field: str) -> Iterator[str]:
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
                raise PrepareError(f"{path}:{line_no}: not valid JSON ({getattr(e, 'msg', e)})") from None
            if not isinstance(record, dict) or text_field not in record:
                raise PrepareError(f"{path}:{line_no}: no {text_field!r} field (choose one with --text-field)")
            text = record[text_field]
            if not isinstance(text, str):
                raise PrepareError(f"{path}:{line_no}: {text_field!r} is {type(text).__name__}, not a string")
            if text:
                yield text


def _parquet_documents(path: Path, text_field: str) -> Iterator[str]:
    pa = _pyarrow()
    try:
        file = pa.parquet.ParquetFile(path)
        column = file.schema_arrow.field(text_field) if text_field in file.schema_arrow.names else None
        if column is None:
            raise PrepareError(f"{path}: no column {text_field!r} (has {', '.join(file.schema_arrow.names)}; "
                               "choose one with --text-field)")
        if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
            raise PrepareError(f"{path}: column {text_field!r} holds {column.type}, not strings")
        row = 0
        for batch in file.iter_batches(columns=[text_field]):
            for text in batch.column(0).to_pylist():
                if text is None:
                    raise PrepareError(f"{path}: row {row}: {text_field!r} is null")
                row += 1
                if text:
                    yield text
    except pa.ArrowException as e:
        raise PrepareError(f"{path}: cannot read parquet ({e})") from None


def _chunks(paths: list[Path], text_field: str) -> Iterator[list[str]]:
    chunk, chars = [], 0
    for path in paths:
        for text in _documents(path, text_field):
            chunk.append(text)
            chars += len(text)
            if chars >= _CHUNK_CHARS:
                yield chunk
                chunk, chars = [], 0
    if chunk:
        yield chunk


def _encode(tokenizer, texts: list[str]) -> tuple[np.ndarray, np.ndarray, int]:
    """(tokens with eod after each document, document lengths with eod, UTF-8 bytes of the text)."""
    dtype = token_dtype(tokenizer.vocab_size)
    eod = np.array([tokenizer.eod_id], dtype)
    docs = tokenizer.encode_batch(texts)
    tokens = np.concatenate([part for doc in docs for part in (doc.astype(dtype), eod)])
    return tokens, np.array([len(d) + 1 for d in docs], np.int64), sum(len(t.encode("utf-8")) for t in texts)


_worker_tokenizer = None  # set once per pool process, so the tokenizer crosses the process boundary once


def _init_worker(tokenizer) -> None:
    global _worker_tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the pool is the parallelism; N x all-core threads would thrash
    _worker_tokenizer = tokenizer


def _encode_in_worker(texts: list[str]):
    return _encode(_worker_tokenizer, texts)


def _tokenize(chunks: Iterator[list[str]], tokenizer, workers: int) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
    """Encoded chunks in input order, whatever `workers`; at most 2·workers chunks in flight bound memory."""
    if workers == 1:
        yield from (_encode(tokenizer, texts) for texts in chunks)
        return
    # spawn, not fork: forking a process where jax has started its threads can deadlock
    with multiprocessing.get_context("spawn").Pool(workers, initializer=_init_worker, initargs=(tokenizer,)) as pool:
        pending = collections.deque()
        for texts in chunks:
            pending.append(pool.apply_async(_encode_in_worker, (texts,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


class _Progress:
    """Documents, tokens and input MB/s on stderr: a rewritten line on a terminal, else a line every few seconds."""

    def __init__(self):
        self.tty = sys.stderr.isatty()
        self.interval = 0.2 if self.tty else 5.0
        self.start = self.last = time.monotonic()
        self.docs = self.tokens = self.bytes = 0
        self.drawn = False

    def _line(self) -> str:
        seconds = max(time.monotonic() - self.start, 1e-9)
        return (f"{self.docs:,} documents, {self.tokens:,} tokens, {self.bytes / 1e6:,.1f} MB "
                f"({self.bytes / 1e6 / seconds:,.1f} MB/s)")

    def update(self, docs: int, tokens: int, text_bytes: int) -> None:
        self.docs, self.tokens, self.bytes = self.docs + docs, self.tokens + tokens, self.bytes + text_bytes
        now = time.monotonic()
        if now - self.last >= self.interval:
            self.last = now
            print(("\r" if self.tty else "") + self._line(), end="" if self.tty else "\n", file=sys.stderr,
                  flush=True)
            self.drawn = True

    def close(self) -> None:
        """Ends a rewritten line, so whatever is printed next starts on its own line."""
        if self.tty and self.drawn:
            print(file=sys.stderr)

    def finish(self, out: Path, index: dict) -> None:
        print(f"{out}: {self._line()} in {time.monotonic() - self.start:.1f} s, {index['dtype']}", file=sys.stderr)


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise PrepareError(message)


def main(argv=None) -> int:
    parser = _Parser(prog="python -m mlm_jax.data.prepare",
                     description="Tokenize text files into a memory-mapped token directory for training.")
    parser.add_argument("--input", nargs="+", required=True, metavar="FILE", help=".txt, .jsonl or .parquet")
    parser.add_argument("--tokenizer", required=True, help="`byte`, or a Hugging Face tokenizer.json")
    parser.add_argument("--output", required=True, metavar="DIR")
    parser.add_argument("--text-field", default="text", help="the text's key (.jsonl) or column (.parquet)")
    parser.add_argument("--eod-token", help="end-of-document token of a tokenizer.json (default: its eos token)")
    parser.add_argument("--workers", type=int, default=1,
                        help="tokenizing processes; the output is the same (a tokenizer.json uses all cores in one)")
    parser.add_argument("--force", action="store_true", help="replace an existing prepared DIR")
    try:
        args = parser.parse_args(argv)
        prepare(args.input, args.tokenizer, args.output, args.text_field, args.workers, args.eod_token, args.force)
    except PrepareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
