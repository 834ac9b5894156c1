"""The embedded default corpus: the Python standard library's own sources.

Real text that every Python install already has, so training works with no dataset and no download.
site-packages is skipped so the corpus does not depend on what happens to be installed.
"""

import dataclasses
import hashlib
import os
import sys
import sysconfig
import tempfile
import zipfile
import zlib
from pathlib import Path

import numpy as np

from mlm_jax.data.tokenizer import ByteTokenizer

_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_CACHE_FORMAT = 1


@dataclasses.dataclass(frozen=True)
class Corpus:
    train: np.ndarray  # uint16 tokens, each file followed by eod
    validation: np.ndarray
    num_files: int
    description: str


def load_stdlib_corpus(validation_fraction: float, max_bytes: int | None = None) -> Corpus:
    """Tokenized stdlib sources, split train/validation by file.

    `max_bytes` caps the bytes read: whole files in sorted order while they fit. The result is cached
    (see `_cache_dir`), since reading some 1,800 files costs more than loading one array.
    """
    if not 0.0 < validation_fraction < 1.0:
        raise ValueError(f"validation_fraction must be in (0, 1), got {validation_fraction}")
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    cache_path = _cache_path(stdlib, validation_fraction, max_bytes)
    cached = _read_cache(cache_path)
    if cached is not None:
        train, validation, num_files = cached
    else:
        train, validation, num_files = _tokenize(stdlib, validation_fraction, max_bytes)
        _write_cache(cache_path, train, validation, num_files)
    description = (
        f"Python {_python_version()} stdlib ({stdlib}): {num_files} files, "
        f"{train.size:,} train / {validation.size:,} validation tokens"
    )
    return Corpus(train=train, validation=validation, num_files=num_files, description=description)


def is_validation_file(relative_path: str, validation_fraction: float) -> bool:
    """A stable hash of the path (not Python's salted hash()) keeps the split identical across runs."""
    return zlib.crc32(relative_path.encode("utf-8")) % 10_000 < validation_fraction * 10_000


def _source_files(stdlib: Path) -> list[str]:
    """Relative posix paths of the .py files, sorted so the token stream is deterministic."""
    found = []
    for root, dirs, files in os.walk(stdlib):
        dirs[:] = [d for d in dirs if d not in _SKIPPED_DIRS]
        rel_root = Path(root).relative_to(stdlib)
        found.extend((rel_root / f).as_posix() for f in files if f.endswith(".py"))
    return sorted(found)


def _tokenize(stdlib: Path, validation_fraction: float, max_bytes: int | None):
    tokenizer = ByteTokenizer()
    eod = np.array([tokenizer.eod_id], dtype=np.uint16)
    splits = {False: [], True: []}
    num_files = total_bytes = 0
    for rel in _source_files(stdlib):
        data = (stdlib / rel).read_bytes()
        if max_bytes is not None and total_bytes + len(data) > max_bytes:
            break
        total_bytes += len(data)
        num_files += 1
        splits[is_validation_file(rel, validation_fraction)] += [tokenizer.encode_bytes(data), eod]
    num_validation = len(splits[True]) // 2
    if num_validation == 0:
        raise ValueError(
            f"the stdlib corpus has no validation file ({num_files} files read, "
            f"validation_fraction={validation_fraction}, max_bytes={max_bytes}): raise validation_fraction or max_bytes"
        )
    if num_validation == num_files:
        raise ValueError(
            f"the stdlib corpus has no training file ({num_files} files read, "
            f"validation_fraction={validation_fraction}, max_bytes={max_bytes})"
        )
    return np.concatenate(splits[False]), np.concatenate(splits[True]), num_files


def _python_version() -> str:
    return ".".join(map(str, sys.version_info[:3]))


def _cache_dir() -> Path:
    return Path(os.environ.get("MLM_JAX_CACHE") or Path.home() / ".cache" / "mlm_jax")


def _cache_path(stdlib: Path, validation_fraction: float, max_bytes: int | None) -> Path:
    key = repr((_CACHE_FORMAT, ByteTokenizer().fingerprint, sys.version, str(stdlib), validation_fraction, max_bytes))
    digest = hashlib.sha1(key.encode()).hexdigest()[:10]
    return _cache_dir() / f"stdlib-py{_python_version()}-val{validation_fraction}-max{max_bytes}-{digest}.npz"


def _read_cache(path: Path):
    """None when missing or unreadable; a bad cache file is rebuilt rather than trusted."""
    try:
        with np.load(path, allow_pickle=False) as f:
            return f["train"], f["validation"], int(f["num_files"])
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
        return None


def _write_cache(path: Path, train: np.ndarray, validation: np.ndarray, num_files: int) -> None:
    """tmp file + os.replace, so a killed process never leaves a half-written cache; unwritable dirs are skipped."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    except OSError:
        return
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, train=train, validation=validation, num_files=np.int64(num_files))
        os.replace(tmp, path)
    except OSError:
        pass
    finally:
        Path(tmp).unlink(missing_ok=True)
