"""Training on prepared token directories: blending, determinism, and every data mismatch as a one-line error."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from mlm_jax import Trainer, load_config
from mlm_jax.config import ConfigError
from mlm_jax.data.dataset import build_datasets
from mlm_jax.data.prepare import prepare

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """Two byte-tokenized directories: Python sources, and repetitive prose."""
    base = tmp_path_factory.mktemp("prepared")
    sources = []
    for f in sorted(os.listdir(os.path.dirname(json.__file__))):
        if f.endswith(".py"):
            p = base / f"{f}.txt"
            p.write_bytes(open(os.path.join(os.path.dirname(json.__file__), f), "rb").read())
            sources.append(str(p))
    prose = []
    for i in range(40):
        p = base / f"doc{i}.txt"
        p.write_text(f"Document {i}. " + "The quick brown fox jumps over the lazy dog. " * 20)
        prose.append(str(p))
    prepare(sources, "byte", str(base / "code"))
    prepare(prose, "byte", str(base / "prose"))
    return base


def data_overrides(prepared, *extra):
    return [f"data.paths=[{prepared / 'code'}, {prepared / 'prose'}]", "train.seq_len=32", *extra]


def test_blend_follows_the_weights_and_is_deterministic(prepared):
    cfg = load_config(None, data_overrides(prepared, "data.weights=[3, 1]"))
    a = build_datasets(cfg.data, 32, cfg.model.vocab_size, seed=0)
    b = build_datasets(cfg.data, 32, cfg.model.vocab_size, seed=0)
    ids = np.arange(400)
    np.testing.assert_array_equal(a.train.pairs(ids)[0], b.train.pairs(ids)[0])
    assert np.bincount(a.train.source_of(ids)).tolist() == [300, 100]


def test_training_on_prepared_dirs_runs_and_evaluates(prepared, tmp_path):
    cfg = load_config(None, data_overrides(prepared, "train.steps=3", "train.log_every=1", "train.eval_every=3",
                                           "train.global_batch_size=8", "log.progress=never",
                                           f"train.output_dir={tmp_path}"))
    records = Trainer(cfg).fit()
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]
    assert np.isfinite([r["eval_loss"] for r in records if "eval_loss" in r]).all()


@pytest.mark.parametrize("extra, message", [
    (["model.vocab_size=200"], "data.tokenizer=byte has 257 tokens, more than model.vocab_size=200"),
    (["train.seq_len=100000"], "fewer than one window of seq_len"),
    (["data.weights=[1]"], "one weight per entry"),
    (["data.tokenizer=/nonexistent/tokenizer.json"], "data.tokenizer=/nonexistent"),
], ids=["vocab", "seq-len", "weights", "tokenizer"])
def test_data_mismatches_are_config_errors(prepared, extra, message):
    with pytest.raises(ConfigError, match=message):
        cfg = load_config(None, data_overrides(prepared) + extra)
        build_datasets(cfg.data, cfg.train.seq_len, cfg.model.vocab_size, seed=0)


def test_missing_dir_is_a_one_line_cli_error(tmp_path):
    result = subprocess.run([sys.executable, "-m", "mlm_jax.train", f"data.paths=[{tmp_path / 'nope'}]"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.startswith("error: data.paths:"), result.stderr
    assert result.stderr.count("\n") == 1


def test_a_dir_prepared_with_another_tokenizer_is_rejected(prepared, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "</s>": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg = load_config(None, data_overrides(prepared, f"data.tokenizer={tmp_path / 'tokenizer.json'}"))
    with pytest.raises(ConfigError, match="not the run's tokenizer"):
        build_datasets(cfg.data, 32, cfg.model.vocab_size, seed=0)
