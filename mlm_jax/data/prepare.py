"""`python -m mlm_jax.data.prepare --input FILES... --tokenizer byte|tokenizer.json --output DIR`

Tokenizes .txt (a document per file), .jsonl (a record per line), .parquet (a record per row) and Hugging Face
`datasets` saved on disk (`save_to_disk` folders) into a prepared token directory (format in `tokenfile.py`). A
record is plain text (`--text-field`), a chat (`{"messages": [{"role", "content"}, ...]}`, rendered with the
tokenizer's chat template) or a prompt and its completion (`{"prompt", "completion"}`); fine-tuning records store a
loss mask beside the tokens (`data/examples.py`). The output appears whole or not at all: it is built in a hidden
sibling directory and renamed into place, so a killed run leaves no half-written DIR.
"""

import argparse
import collections
import dataclasses
import itertools
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

from mlm_jax.data.examples import FORMATS, ChatTemplate, ExampleError, check_messages, prompt_completion, record_format
from mlm_jax.data.tokenfile import DOCS_FILE, FORMAT_VERSION, INDEX_FILE, MASK_FILE, TOKENS_FILE, token_dtype
from mlm_jax.data.tokenizer import load_tokenizer

EXTENSIONS = (".txt", ".jsonl", ".parquet")
DATASET_FILES = ("dataset_info.json", "state.json")  # what `datasets.Dataset.save_to_disk` writes
_CHUNK_CHARS = 1 << 20  # text per tokenization task: large enough to amortize inter-process transfer


class PrepareError(Exception):
    """A user mistake: reported as one `error: ...` line and exit code 2."""


def prepare(inputs: list[str], tokenizer: str, output: str, text_field: str = "text", workers: int = 1,
            eod_token: str | None = None, force: bool = False, fmt: str = "auto") -> dict:
    """Writes the prepared directory `output` and returns its index. `fmt`: what a record is (`examples.FORMATS`;
    auto goes by each record's fields)."""
    paths = [_check_input(p) for p in inputs]
    out = Path(output)
    _check_output(out, force)
    if workers < 1:
        raise PrepareError(f"--workers must be >= 1, got {workers}")
    if fmt not in FORMATS:
        raise PrepareError(f"--format {fmt}: expected one of {', '.join(FORMATS)}")
    try:
        tok = load_tokenizer(tokenizer, eod_token)
    except OSError as e:
        raise PrepareError(f"--tokenizer {tokenizer}: cannot read {e.filename} ({e.strerror})") from None
    except (ValueError, ImportError) as e:
        raise PrepareError(f"--tokenizer {tokenizer}: {e}") from None
    if any(p.suffix == ".parquet" for p in paths):
        _pyarrow()
    template = _Template(tokenizer)
    progress = _Progress()

    def fill(tmp: Path) -> dict:
        dtype = token_dtype(tok.vocab_size)
        starts, num_tokens, masked = [], 0, False
        try:
            with open(tmp / TOKENS_FILE, "wb") as f, open(tmp / MASK_FILE, "wb") as m:
                for tokens, lengths, text_bytes, mask in _tokenize(_chunks(paths, text_field, fmt),
                                                                   _Encoder(tok, template), workers):
                    starts.append(num_tokens + np.cumsum(lengths) - lengths)
                    num_tokens += len(tokens)
                    f.write(tokens.tobytes())
                    m.write(mask.tobytes())
                    masked = masked or not mask.all()
                    progress.update(len(lengths), len(tokens), text_bytes)
        finally:
            progress.close()
        offsets = np.concatenate(starts) if starts else np.empty(0, np.int64)
        if num_tokens == len(offsets):
            raise PrepareError(f"no text in {', '.join(inputs)}: every input is empty")
        if not masked:  # plain text: every token is a target, nothing to store
            (tmp / MASK_FILE).unlink()
        np.save(tmp / DOCS_FILE, offsets)
        index = {
            "format": FORMAT_VERSION,
            "dtype": dtype.name,
            "num_tokens": num_tokens,
            "num_documents": len(offsets),
            "doc_offsets": DOCS_FILE,
            "tokenizer": tok.describe(),
            "sources": [{"path": str(p.resolve()), "bytes": _size(p)} for p in paths],
        }
        if masked:
            index["loss_mask"] = MASK_FILE
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return index

    index = _write_atomically(out, fill)
    progress.finish(out, index)
    return index


def _check_input(name: str) -> Path:
    path = Path(name)
    if path.is_dir() and any((path / f).is_file() for f in DATASET_FILES):
        return path  # a Hugging Face dataset saved with save_to_disk
    if not path.is_file():
        raise PrepareError(f"--input {name}: no such file (or a folder a Hugging Face dataset was saved to)")
    if path.suffix not in EXTENSIONS:
        raise PrepareError(f"--input {name}: unknown extension {path.suffix or '(none)'!r}, "
                           f"expected {', '.join(EXTENSIONS)} or a saved Hugging Face dataset folder")
    return path


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size


class _Template:
    """The tokenizer's chat template, loaded when the first chat record asks for it (plain text needs none)."""

    def __init__(self, tokenizer: str):
        self.tokenizer, self.template = tokenizer, None

    def get(self) -> ChatTemplate:
        if self.template is None:
            if self.tokenizer == "byte":
                raise PrepareError("chat records need a tokenizer with a chat template (a tokenizer.json beside a "
                                   "tokenizer_config.json), not --tokenizer byte")
            try:
                self.template = ChatTemplate(self.tokenizer)
            except ExampleError as e:
                raise PrepareError(f"--tokenizer {self.tokenizer}: {e}") from None
        return self.template


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


def _records(path: Path, text_field: str, fmt: str) -> Iterator[tuple[str, dict]]:
    """(where, record) of one input, in order: a .txt file is one record of its whole text."""
    try:
        if path.is_dir():
            yield from _dataset_records(path)
        elif path.suffix == ".txt":
            yield from _txt_records(path, text_field)
        elif path.suffix == ".jsonl":
            yield from _jsonl_records(path)
        else:
            yield from _parquet_records(path, text_field, fmt)
    except OSError as e:
        raise PrepareError(f"{path}: cannot read ({e.strerror or e})") from None


def _txt_records(path: Path, text_field: str) -> Iterator[tuple[str, dict]]:
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise PrepareError(f"{path}: not UTF-8 text (byte {e.start})") from None
    yield str(path), {text_field: text}


def _jsonl_records(path: Path) -> Iterator[tuple[str, dict]]:
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
                raise PrepareError(f"{path}:{line_no}: not valid JSON ({getattr(e, 'msg', e)})") from None
            if not isinstance(record, dict):
                raise PrepareError(f"{path}:{line_no}: expected a JSON object, got {type(record).__name__}")
            yield f"{path}:{line_no}", record


def _parquet_records(path: Path, text_field: str, fmt: str) -> Iterator[tuple[str, dict]]:
    pa = _pyarrow()
    try:
        file = pa.parquet.ParquetFile(path)
        names = file.schema_arrow.names
        if record_format(dict.fromkeys(names), text_field, fmt) == "text":  # the text column, checked up front
            if text_field not in names:
                raise PrepareError(f"{path}: no column {text_field!r} (has {', '.join(names)}; choose one with "
                                   "--text-field)")
            column = file.schema_arrow.field(text_field)
            if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
                raise PrepareError(f"{path}: column {text_field!r} holds {column.type}, not strings")
        row = 0
        for batch in file.iter_batches():
            for record in batch.to_pylist():
                yield f"{path}: row {row}", record
                row += 1
    except pa.ArrowException as e:
        raise PrepareError(f"{path}: cannot read parquet ({e})") from None


def _dataset_records(path: Path) -> Iterator[tuple[str, dict]]:
    try:
        import datasets
    except ImportError:
        raise PrepareError(f"{path}: a saved Hugging Face dataset needs the `datasets` package: "
                           "pip install 'mlm_jax[data]'") from None
    try:
        data = datasets.load_from_disk(str(path))
    except (OSError, ValueError, FileNotFoundError) as e:
        raise PrepareError(f"{path}: cannot load the saved dataset ({str(e).splitlines()[0]})") from None
    if isinstance(data, datasets.DatasetDict):
        raise PrepareError(f"{path}: holds the splits {', '.join(data)}: give one split's folder ({path}/<split>)")
    for row, record in enumerate(data):
        yield f"{path}: row {row}", record


def _item(where: str, record: dict, text_field: str, fmt: str):
    """A record as ("text", text), ("chat", messages) or ("prompt_completion", (prompt, completion)), checked; None
    for empty text (skipped, as before)."""
    kind = record_format(record, text_field, fmt)
    try:
        if kind == "chat":
            if "messages" not in record:
                raise ExampleError("no 'messages' field")
            check_messages(record["messages"])
            return where, "chat", record["messages"]
        if kind == "prompt_completion":
            if "prompt" not in record or "completion" not in record:
                raise ExampleError("needs 'prompt' and 'completion' fields")
            return where, kind, (record["prompt"], record["completion"])
    except ExampleError as e:
        raise PrepareError(f"{where}: {e}") from None
    if text_field not in record:
        raise PrepareError(f"{where}: no {text_field!r} field (choose one with --text-field), nor 'messages' (a chat) "
                           "or 'prompt' and 'completion'")
    text = record[text_field]
    if text is None:
        raise PrepareError(f"{where}: {text_field!r} is null")
    if not isinstance(text, str):
        raise PrepareError(f"{where}: {text_field!r} is {type(text).__name__}, not a string")
    return (where, "text", text) if text else None


def _chunks(paths: list[Path], text_field: str, fmt: str) -> Iterator[list[tuple]]:
    chunk, chars = [], 0
    for path in paths:
        for where, record in _records(path, text_field, fmt):
            item = _item(where, record, text_field, fmt)
            if item is None:
                continue
            chunk.append(item)
            chars += len(json.dumps(item[2])) if item[1] != "text" else len(item[2])
            if chars >= _CHUNK_CHARS:
                yield chunk
                chunk, chars = [], 0
    if chunk:
        yield chunk


def _example(tokenizer, template: ChatTemplate | None, kind: str, value) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, loss mask) of one item, its end-of-document token included: plain text trains on every token, a
    chat on the assistant's (not on the end-of-document token after it), a completion on itself and its end."""
    eod = np.array([tokenizer.eod_id])
    if kind == "text":
        ids = np.concatenate([tokenizer.encode_batch([value])[0], eod])
        return ids, np.ones(len(ids), np.uint8)
    if kind == "prompt_completion":
        return prompt_completion(tokenizer, *value)
    ids, mask = template.example(value)
    return np.concatenate([ids, eod]), np.concatenate([mask, [0]]).astype(np.uint8)


@dataclasses.dataclass
class _Encoder:
    """The tokenizer and the chat template (loaded when a chat record first needs it) a chunk is encoded with."""

    tokenizer: object
    template: _Template | ChatTemplate


def _encode(encoder: _Encoder, items: list[tuple]):
    """(tokens with eod after each document, document lengths with eod, UTF-8 bytes of the text, loss mask)."""
    tokenizer, template = encoder.tokenizer, encoder.template
    dtype = token_dtype(tokenizer.vocab_size)
    texts = [value for _, kind, value in items if kind == "text"]
    encoded = iter(tokenizer.encode_batch(texts))  # plain text in one batch: the tokenizer's own parallelism
    parts, masks, text_bytes = [], [], 0
    for where, kind, value in items:
        if kind == "text":
            ids = next(encoded)
            parts.append(np.concatenate([ids.astype(dtype), np.array([tokenizer.eod_id], dtype)]))
            masks.append(np.ones(len(ids) + 1, np.uint8))
            text_bytes += len(value.encode("utf-8"))
            continue
        try:
            chat = template.get() if isinstance(template, _Template) and kind == "chat" else template
            ids, mask = _example(tokenizer, chat, kind, value)
        except ExampleError as e:
            raise PrepareError(f"{where}: {e}") from None
        if ids.max() >= tokenizer.vocab_size:
            raise PrepareError(f"{where}: the chat template produced token {int(ids.max())}, beyond the tokenizer's "
                               f"{tokenizer.vocab_size} ids")
        parts.append(ids.astype(dtype))
        masks.append(mask)
        text_bytes += len(json.dumps(value).encode("utf-8"))
    return (np.concatenate(parts), np.array([len(p) for p in parts], np.int64), text_bytes, np.concatenate(masks))


_worker_encoder = None  # set once per pool process, so the tokenizer crosses the process boundary once


def _init_worker(encoder: _Encoder) -> None:
    global _worker_encoder
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the pool is the parallelism; N x all-core threads would thrash
    _worker_encoder = encoder


def _encode_in_worker(items: list[tuple]):
    return _encode(_worker_encoder, items)


def _tokenize(chunks: Iterator[list[tuple]], encoder: _Encoder, workers: int):
    """Encoded chunks in input order, whatever `workers`; at most 2·workers chunks in flight bound memory. The
    workers get the chat template loaded, where the first chunk needs it."""
    if workers == 1:
        yield from (_encode(encoder, items) for items in chunks)
        return
    chunks = iter(chunks)
    first = next(chunks, None)
    if first is None:
        return
    if any(kind == "chat" for _, kind, _ in first):
        encoder = _Encoder(encoder.tokenizer, encoder.template.get())
    # spawn, not fork: forking a process where jax has started its threads can deadlock
    with multiprocessing.get_context("spawn").Pool(workers, initializer=_init_worker, initargs=(encoder,)) as pool:
        pending = collections.deque()
        for items in itertools.chain([first], chunks):
            pending.append(pool.apply_async(_encode_in_worker, (items,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()  # a worker's refusal is raised here
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
    parser.add_argument("--input", nargs="+", required=True, metavar="FILE",
                        help=".txt, .jsonl, .parquet or a folder a Hugging Face dataset was saved to")
    parser.add_argument("--tokenizer", required=True, help="`byte`, or a Hugging Face tokenizer.json")
    parser.add_argument("--output", required=True, metavar="DIR")
    parser.add_argument("--text-field", default="text", help="the text's key (.jsonl) or column (.parquet)")
    parser.add_argument("--format", default="auto", choices=FORMATS,
                        help="what a record is: text, chat (messages) or prompt_completion; auto goes by its fields")
    parser.add_argument("--eod-token", help="end-of-document token of a tokenizer.json (default: its eos token)")
    parser.add_argument("--workers", type=int, default=1,
                        help="tokenizing processes; the output is the same (a tokenizer.json uses all cores in one)")
    parser.add_argument("--force", action="store_true", help="replace an existing prepared DIR")
    try:
        args = parser.parse_args(argv)
        prepare(args.input, args.tokenizer, args.output, args.text_field, args.workers, args.eod_token, args.force,
                args.format)
    except PrepareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
