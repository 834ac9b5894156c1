"""Token directories: `python -m mlm_jax.data.prepare`, reading them back, splits, checks and blends."""
import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mlm_jax.data import (
    BlendedTokens,
    ByteTokenizer,
    HFTokenizer,
    TokenDir,
    check_seq_len,
    check_tokenizer,
    check_vocab,
    split_by_document,
)
from mlm_jax.data import prepare as prepare_mod
from mlm_jax.data.prepare import PrepareError, prepare

REPO = Path(__file__).resolve().parents[1]
EOD = ByteTokenizer.eod_id
DOCS = ["def f(x):\n    return x\n", "héllo wörld ✓", "a\n\nb", "last one"]


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def hf_tokenizer_file(path: Path, num_words: int, eos: str | None = "</s>") -> Path:
    """A word-level tokenizer.json: ids 0 <unk>, 1 eos (if any), then w0, w1, ... up to num_words words."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<unk>": 0, **({eos: 1} if eos else {}), **{f"w{i}": i + 2 for i in range(num_words)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece()  # joins words with spaces
    tok.save(str(path))
    return path


def run_cli(*args, cwd, blocked_module=None):
    """The real CLI in a subprocess; `blocked_module` makes that optional package unimportable."""
    block = f"sys.modules[{blocked_module!r}] = None; " if blocked_module else ""
    code = f"import sys; {block}from mlm_jax.data.prepare import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=dict(os.environ),
                          capture_output=True, text=True, timeout=120)


def documents(tokdir: TokenDir) -> list[np.ndarray]:
    ends = [*tokdir.doc_offsets[1:], len(tokdir.tokens)]
    return [np.asarray(tokdir.tokens[a:b]) for a, b in zip(tokdir.doc_offsets, ends)]


# -- prepare ---------------------------------------------------------------------------------------------------------


def test_txt_and_jsonl_round_trip_through_the_byte_tokenizer(tmp_path):
    (tmp_path / "a.txt").write_text(DOCS[0])
    # blank lines and empty texts are not documents; other keys are ignored
    write_jsonl(tmp_path / "b.jsonl", [{"body": DOCS[1], "id": 1}, {"body": ""}, {"body": DOCS[2]}])
    (tmp_path / "b.jsonl").write_text((tmp_path / "b.jsonl").read_text() + "\n  \n")
    (tmp_path / "c.txt").write_text(DOCS[3])
    inputs = [tmp_path / n for n in ("a.txt", "b.jsonl", "c.txt")]
    index = prepare([str(p) for p in inputs], "byte", str(tmp_path / "out"), text_field="body")

    tokdir = TokenDir(tmp_path / "out")
    assert tokdir.index == index == json.loads((tmp_path / "out" / "index.json").read_text())
    docs = documents(tokdir)
    assert [ByteTokenizer().decode(d) for d in docs] == DOCS
    assert all(d[-1] == EOD and EOD not in d[:-1] for d in docs)
    assert index["num_documents"] == 4 and index["num_tokens"] == sum(len(d.encode()) + 1 for d in DOCS)
    assert (index["format"], index["dtype"], index["doc_offsets"]) == (1, "uint16", "docs.npy")
    assert index["tokenizer"] == {"kind": "byte", "path": None, "fingerprint": "byte-v1", "vocab_size": 257,
                                  "eod_id": EOD}
    assert index["sources"] == [{"path": str(p.resolve()), "bytes": p.stat().st_size} for p in inputs]
    assert sorted(os.listdir(tmp_path / "out")) == ["docs.npy", "index.json", "tokens.bin"]


def test_parquet_rows_are_documents(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": list(range(4)), "content": DOCS}), tmp_path / "d.parquet", row_group_size=3)
    prepare([str(tmp_path / "d.parquet")], "byte", str(tmp_path / "out"), text_field="content")
    assert [ByteTokenizer().decode(d) for d in documents(TokenDir(tmp_path / "out"))] == DOCS
    with pytest.raises(PrepareError, match=r"d.parquet: no column 'text' \(has id, content"):
        prepare([str(tmp_path / "d.parquet")], "byte", str(tmp_path / "out2"))
    with pytest.raises(PrepareError, match="column 'id' holds int64, not strings"):
        prepare([str(tmp_path / "d.parquet")], "byte", str(tmp_path / "out2"), text_field="id")


@pytest.mark.parametrize("num_words, dtype", [(100, np.uint16), (65534, np.uint16), (65535, np.uint32)])
def test_hf_tokenizer_ids_are_uint16_up_to_65536_tokens_else_uint32(tmp_path, num_words, dtype):
    tok_path = hf_tokenizer_file(tmp_path / "tokenizer.json", num_words)
    texts = [f"w0 w{num_words - 1} w5", "w7 unknown w3"]
    write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in texts])
    index = prepare([str(tmp_path / "d.jsonl")], str(tok_path), str(tmp_path / "out"))

    tokdir = TokenDir(tmp_path / "out")
    top = num_words + 1
    assert tokdir.tokens.dtype == dtype and index["tokenizer"]["vocab_size"] == num_words + 2
    np.testing.assert_array_equal(tokdir.tokens, [2, top, 7, 1, 9, 0, 5, 1])
    assert tokdir.eod_id == 1 and tokdir.vocab_size == num_words + 2
    assert tokdir.fingerprint == "sha256:" + hashlib.sha256(tok_path.read_bytes()).hexdigest()
    assert index["tokenizer"]["kind"] == "huggingface" and index["tokenizer"]["path"] == str(tok_path.resolve())
    assert HFTokenizer(tok_path).decode(documents(tokdir)[0][:-1]) == texts[0]


def test_eod_token_overrides_the_eos_guess(tmp_path):
    tok_path = hf_tokenizer_file(tmp_path / "tokenizer.json", 10, eos=None)
    (tmp_path / "a.txt").write_text("w1 w2")
    with pytest.raises(PrepareError, match="--eod-token"):
        prepare([str(tmp_path / "a.txt")], str(tok_path), str(tmp_path / "out"))
    prepare([str(tmp_path / "a.txt")], str(tmp_path), str(tmp_path / "out"), eod_token="w9")  # a dir holding one
    np.testing.assert_array_equal(TokenDir(tmp_path / "out").tokens, [3, 4, 11])


@pytest.mark.parametrize("tokenizer", ["byte", "hf"])
def test_workers_do_not_change_the_output(tmp_path, monkeypatch, tokenizer):
    monkeypatch.setattr(prepare_mod, "_CHUNK_CHARS", 50)  # many chunks, so the pool really interleaves
    rng = np.random.default_rng(0)
    records = [{"text": " ".join(f"w{i}" for i in rng.integers(0, 30, rng.integers(1, 40)))} for _ in range(300)]
    write_jsonl(tmp_path / "d.jsonl", records)
    tok = "byte" if tokenizer == "byte" else str(hf_tokenizer_file(tmp_path / "tokenizer.json", 30))
    outputs = []
    for workers in (1, 2, 3):
        prepare([str(tmp_path / "d.jsonl")], tok, str(tmp_path / f"out{workers}"), workers=workers)
        outputs.append({n: (tmp_path / f"out{workers}" / n).read_bytes()
                        for n in ("tokens.bin", "docs.npy", "index.json")})
    assert outputs[0] == outputs[1] == outputs[2]
    assert TokenDir(tmp_path / "out1").index["num_documents"] == 300


def test_output_appears_only_when_complete_and_a_failure_leaves_nothing(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "b.txt").write_text("second")
    out = tmp_path / "new" / "parents" / "out"
    monkeypatch.setattr(prepare_mod, "_CHUNK_CHARS", 1)
    real_encode, calls = prepare_mod._encode, []

    def encode_then_fail(tokenizer, texts):
        calls.append(texts)
        assert not out.exists()  # the output is built elsewhere while the run goes on
        if len(calls) == 2:
            raise RuntimeError("killed mid-way")
        return real_encode(tokenizer, texts)

    monkeypatch.setattr(prepare_mod, "_encode", encode_then_fail)
    with pytest.raises(RuntimeError, match="killed mid-way"):
        prepare([str(tmp_path / "a.txt"), str(tmp_path / "b.txt")], "byte", str(out))
    assert len(calls) == 2 and sorted(os.listdir(tmp_path)) == ["a.txt", "b.txt"]


def test_a_failed_force_run_keeps_the_previous_output(tmp_path):
    (tmp_path / "a.txt").write_text("kept")
    write_jsonl(tmp_path / "bad.jsonl", [{"text": "fine"}, {"other": "no text field"}])
    prepare([str(tmp_path / "a.txt")], "byte", str(tmp_path / "out"))
    before = (tmp_path / "out" / "tokens.bin").read_bytes()
    with pytest.raises(PrepareError, match=r"bad.jsonl:2: no 'text' field"):
        prepare([str(tmp_path / "bad.jsonl")], "byte", str(tmp_path / "out"), force=True)
    assert (tmp_path / "out" / "tokens.bin").read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["a.txt", "bad.jsonl", "out"]
    prepare([str(tmp_path / "a.txt"), str(tmp_path / "a.txt")], "byte", str(tmp_path / "out"), force=True)
    assert TokenDir(tmp_path / "out").index["num_documents"] == 2


def test_force_replaces_only_a_prepared_or_empty_directory(tmp_path):
    (tmp_path / "a.txt").write_text("x")
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "notes.txt").write_text("keep me")
    with pytest.raises(PrepareError, match="not a prepared token directory"):
        prepare([str(tmp_path / "a.txt")], "byte", str(tmp_path / "precious"), force=True)
    assert (tmp_path / "precious" / "notes.txt").read_text() == "keep me"
    (tmp_path / "empty").mkdir()
    prepare([str(tmp_path / "a.txt")], "byte", str(tmp_path / "empty"), force=True)
    assert TokenDir(tmp_path / "empty").index["num_tokens"] == 2


def test_cli_prepares_and_reports_progress_on_stderr(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    result = run_cli("--input", "a.txt", "--tokenizer", "byte", "--output", "out", "--workers", "2", cwd=tmp_path)
    assert result.returncode == 0 and result.stdout == ""
    assert "1 documents, 6 tokens" in result.stderr and "MB/s" in result.stderr
    assert TokenDir(tmp_path / "out").index["num_tokens"] == 6


def test_preparing_data_does_not_load_jax(tmp_path):
    code = "import sys, mlm_jax.data.prepare, mlm_jax.data.tokenfile; assert 'jax' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def case(case_id, args, expected, blocked_module=None):
    return pytest.param(args, expected, blocked_module, id=case_id)


ERROR_CASES = [
    # id, arguments (run in a tmp dir holding the files of `error_inputs`), substrings of the error line
    case("missing-input", ["--input", "nope.txt"], ["--input nope.txt", "no such file"]),
    case("unknown-extension", ["--input", "d.csv"], ["--input d.csv", "'.csv'", ".txt, .jsonl, .parquet"]),
    case("empty-txt", ["--input", "empty.txt"], ["no text in empty.txt"]),
    case("jsonl-of-empty-texts", ["--input", "blank.jsonl"], ["no text in blank.jsonl"]),
    case("jsonl-missing-field", ["--input", "ok.txt", "nofield.jsonl"], ["nofield.jsonl:3", "no 'text' field"]),
    case("jsonl-other-field", ["--input", "ok.jsonl", "--text-field", "body"], ["ok.jsonl:1", "no 'body' field"]),
    case("jsonl-not-json", ["--input", "broken.jsonl"], ["broken.jsonl:2", "not valid JSON"]),
    case("jsonl-text-not-string", ["--input", "number.jsonl"], ["number.jsonl:1", "'text' is int"]),
    case("txt-not-utf8", ["--input", "latin1.txt"], ["latin1.txt", "not UTF-8"]),
    case("missing-tokenizer", ["--input", "ok.txt", "--tokenizer", "none.json"], ["--tokenizer none.json",
                                                                                   "cannot read"]),
    case("corrupt-tokenizer", ["--input", "ok.txt", "--tokenizer", "garbage.json"],
         ["--tokenizer garbage.json", "not a valid tokenizer.json"]),
    case("eod-token-with-byte", ["--input", "ok.txt", "--eod-token", "</s>"], ["--eod-token"]),
    case("output-exists", ["--input", "ok.txt", "--output", "existing"], ["--output existing", "--force"]),
    case("bad-workers", ["--input", "ok.txt", "--workers", "0"], ["--workers"]),
    case("missing-argument", ["--tokenizer", "byte"], ["--input"]),
    case("no-pyarrow", ["--input", "ok.parquet"], ["pyarrow", "pip install pyarrow"], blocked_module="pyarrow"),
    case("no-tokenizers", ["--input", "ok.txt", "--tokenizer", "garbage.json"], ["pip install tokenizers"],
         blocked_module="tokenizers"),
]


@pytest.fixture
def error_inputs(tmp_path):
    files = {"d.csv": "a,b\n", "empty.txt": "", "blank.jsonl": '{"text": ""}\n\n', "ok.txt": "fine",
             "nofield.jsonl": '{"text": "a"}\n{"text": "b"}\n{"txt": "c"}\n', "ok.jsonl": '{"text": "a"}\n',
             "broken.jsonl": '{"text": "a"}\n{"text": \n', "number.jsonl": '{"text": 3}\n',
             "garbage.json": "{not json", "ok.parquet": "never read: pyarrow is missing"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    (tmp_path / "existing").mkdir()
    return tmp_path


@pytest.mark.parametrize("args, expected, blocked_module", ERROR_CASES)
def test_bad_input_is_one_error_line_exit_code_2_and_nothing_written(error_inputs, args, expected, blocked_module):
    before = sorted(os.listdir(error_inputs))
    defaults = {"--tokenizer": "byte", "--output": "out"}
    args = args + [x for flag, value in defaults.items() if flag not in args for x in (flag, value)]
    result = run_cli(*args, cwd=error_inputs, blocked_module=blocked_module)
    err = result.stderr
    assert "Traceback" not in err, err
    assert err.startswith("error: ") and err.strip().count("\n") == 0, err
    assert all(s in err for s in expected), err
    assert result.returncode == 2
    assert sorted(os.listdir(error_inputs)) == before


# -- reading back ----------------------------------------------------------------------------------------------------


@pytest.fixture
def byte_dir(tmp_path):
    """40 documents of 1 to 40 repeated letters."""
    write_jsonl(tmp_path / "d.jsonl", [{"text": chr(97 + i % 26) * (i + 1)} for i in range(40)])
    prepare([str(tmp_path / "d.jsonl")], "byte", str(tmp_path / "out"))
    return TokenDir(tmp_path / "out")


def test_token_dir_memory_maps_the_tokens_read_only(byte_dir):
    assert isinstance(byte_dir.tokens, np.memmap) and not byte_dir.tokens.flags.writeable
    assert (byte_dir.fingerprint, byte_dir.vocab_size, byte_dir.eod_id) == ("byte-v1", 257, EOD)
    assert len(byte_dir.tokens) == sum(i + 2 for i in range(40)) and len(byte_dir.doc_offsets) == 40
    assert all(d[0] == 97 + i % 26 and len(d) == i + 2 for i, d in enumerate(documents(byte_dir)))


def test_token_dir_rejects_a_missing_corrupt_or_mismatched_directory(byte_dir, tmp_path):
    with pytest.raises(ValueError, match="not a prepared token directory"):
        TokenDir(tmp_path)
    path = byte_dir.path
    index = json.loads((path / "index.json").read_text())
    (path / "index.json").write_text(json.dumps({**index, "num_tokens": index["num_tokens"] + 1}))
    with pytest.raises(ValueError, match="tokens.bin holds"):
        TokenDir(path)
    (path / "index.json").write_text(json.dumps({**index, "num_documents": 39}))
    with pytest.raises(ValueError, match="docs.npy does not match"):
        TokenDir(path)
    (path / "index.json").write_text(json.dumps(index))
    (path / "tokens.bin").unlink()
    with pytest.raises(ValueError, match="tokens.bin holds no bytes"):
        TokenDir(path)
    (path / "index.json").write_text(json.dumps({**index, "format": 99}))
    with pytest.raises(ValueError, match="corrupt, or of another format"):
        TokenDir(path)
    (path / "index.json").write_text("{trunc")
    with pytest.raises(ValueError, match="corrupt"):
        TokenDir(path)


def test_split_is_by_whole_documents_deterministic_disjoint_and_copy_free(byte_dir):
    train, validation = split_by_document(byte_dir, 0.1)
    assert len(train) + len(validation) == len(byte_dir.tokens)
    np.testing.assert_array_equal(np.concatenate([train, validation]), byte_dir.tokens)
    assert len(validation) == sum(i + 2 for i in range(36, 40))  # ceil(0.1 · 40) = 4 whole documents, the last
    assert train[-1] == EOD and validation[-1] == EOD
    assert np.shares_memory(train, byte_dir.tokens) and np.shares_memory(validation, byte_dir.tokens)
    again = split_by_document(TokenDir(byte_dir.path), 0.1)
    assert all(np.array_equal(a, b) for a, b in zip((train, validation), again))
    assert len(split_by_document(byte_dir, 0.001)[1]) == 41  # at least one document
    with pytest.raises(ValueError, match="leaves none for training"):
        split_by_document(byte_dir, 0.99)


def test_checks_name_the_mismatch(byte_dir):
    check_tokenizer(byte_dir, ByteTokenizer().fingerprint)
    with pytest.raises(ValueError, match="not the run's tokenizer"):
        check_tokenizer(byte_dir, "sha256:abc")
    check_vocab(byte_dir, 257)
    with pytest.raises(ValueError, match="vocab_size=256: raise it to at least 257"):
        check_vocab(byte_dir, 256)
    check_seq_len(byte_dir.tokens, len(byte_dir.tokens) - 1, "out")
    with pytest.raises(ValueError, match="out has 860 tokens, fewer than one window of seq_len \\+ 1 = 861"):
        check_seq_len(byte_dir.tokens, 860, "out")


# -- blends ----------------------------------------------------------------------------------------------------------


def blend_sources(sizes):
    """Source k holds tokens 1000·k + 0, 1, 2, ...: every token says which source and position it came from."""
    return [np.arange(n, dtype=np.uint32) + 1000 * k for k, n in enumerate(sizes)]


@pytest.mark.parametrize("weights", [[0.7, 0.3], [1, 2, 3], [0.5, 0.25, 0.125, 0.125], [1 / 3] * 3,
                                     [5, 1, 1, 1, 1, 1, 1], [math.pi, math.e, 1.0]])
def test_blend_proportions_follow_the_weights_within_one_window_over_every_prefix(weights):
    blend = BlendedTokens(blend_sources([90] * len(weights)), weights, seq_len=8, seed=0)
    ids = np.arange(5000)
    counts = np.cumsum(blend.source_of(ids)[:, None] == np.arange(len(weights)), axis=0)
    expected = (ids + 1)[:, None] * np.asarray(weights) / sum(weights)
    assert np.abs(counts - expected).max() < 1
    inputs, targets = blend.pairs(ids[:500])
    np.testing.assert_array_equal(inputs[:, 0] // 1000, blend.source_of(ids[:500]))  # the named source's tokens
    np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])


def test_blend_is_a_pure_function_of_seed_and_window_id():
    sources, weights = blend_sources([100, 300]), [0.25, 0.75]
    a, b = BlendedTokens(sources, weights, 8, seed=3), BlendedTokens(sources, weights, 8, seed=3)
    ids = np.random.default_rng(0).integers(0, 10**9, 64)
    np.testing.assert_array_equal(a.pairs(ids)[0], b.pairs(ids)[0])
    np.testing.assert_array_equal(a.pairs(ids[::-1])[0], b.pairs(ids)[0][::-1])  # order and batching do not matter
    np.testing.assert_array_equal(a.pairs(ids[5:6])[0], b.pairs(ids)[0][5:6])
    assert not np.array_equal(BlendedTokens(sources, weights, 8, seed=4).pairs(ids)[0], a.pairs(ids)[0])


def test_blend_wraps_each_source_through_its_own_permutation():
    blend = BlendedTokens(blend_sources([41, 161]), [1, 1], seq_len=8, seed=0)  # 5 and 20 windows
    ids = np.arange(200)
    firsts = blend.pairs(ids)[0][:, 0]
    small = firsts[firsts < 1000]
    epochs = small.reshape(-1, 5)  # every 5 windows of source 0 visit all 5, in a fresh order
    assert all(sorted(e) == [0, 8, 16, 24, 32] for e in epochs)
    assert len({tuple(e) for e in epochs}) > 1
    assert blend.num_windows == 25


def test_blend_rejects_bad_weights_and_short_sources():
    with pytest.raises(ValueError, match="one weight per source"):
        BlendedTokens(blend_sources([20]), [1, 1], 8, 0)
    with pytest.raises(ValueError, match="positive and finite"):
        BlendedTokens(blend_sources([20, 20]), [1, 0], 8, 0)
    with pytest.raises(ValueError, match="blend source 1 has 8 tokens, fewer than one window"):
        BlendedTokens(blend_sources([20, 8]), [1, 1], 8, 0)
