import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from mlm_jax.data import ByteTokenizer, TokenWindows, load_stdlib_corpus
from mlm_jax.data.corpus import is_validation_file
from mlm_jax.data.loader import Prefetcher, StepLoader, eval_batches, global_batch

SEQ_LEN = 16
BATCH = 8


def make_loader(num_tokens: int = 1000, seed: int = 0) -> StepLoader:
    tokens = np.arange(num_tokens, dtype=np.uint16) % 251
    return StepLoader(tokens, SEQ_LEN, BATCH, seed)


def test_tokenizer_round_trips_unicode_and_drops_eod():
    tok = ByteTokenizer()
    text = "def f(x):\n    return x  # héllo ✓\n"
    ids = tok.encode(text)
    assert ids.dtype == np.uint16 and ids.max() < 256
    assert tok.decode(ids) == text
    assert tok.decode(np.concatenate([ids, [tok.eod_id, 9999]])) == text
    assert (tok.eod_id, tok.vocab_size) == (256, 257)
    assert tok.fingerprint == ByteTokenizer().fingerprint


def test_tokenizer_replaces_a_cut_character():
    tok = ByteTokenizer()
    assert tok.decode(tok.encode("✓")[:2]) == "\ufffd"


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MLM_JAX_CACHE", str(tmp_path))
    return tmp_path


def test_stdlib_corpus_split_is_by_file_deterministic_and_cached(cache_dir):
    cold = load_stdlib_corpus(0.1, max_bytes=2_000_000)
    assert list(cache_dir.glob("*.npz")) and not list(cache_dir.glob("*.tmp"))
    warm = load_stdlib_corpus(0.1, max_bytes=2_000_000)
    np.testing.assert_array_equal(cold.train, warm.train)
    np.testing.assert_array_equal(cold.validation, warm.validation)
    assert cold.train.dtype == cold.validation.dtype == np.uint16
    eod = ByteTokenizer.eod_id
    train_files = np.count_nonzero(cold.train == eod)
    validation_files = np.count_nonzero(cold.validation == eod)
    assert train_files + validation_files == cold.num_files
    assert cold.train[-1] == cold.validation[-1] == eod
    assert 0 < validation_files < train_files
    assert cold.train.size + cold.validation.size - cold.num_files <= 2_000_000


def test_stdlib_corpus_splits_are_disjoint(cache_dir):
    corpus = load_stdlib_corpus(0.1, max_bytes=2_000_000)
    eod = ByteTokenizer.eod_id

    def documents(tokens):
        return {doc.tobytes() for doc in np.split(tokens, np.flatnonzero(tokens == eod) + 1) if doc.size}

    assert not documents(corpus.train) & documents(corpus.validation)


def test_validation_membership_uses_a_stable_hash():
    paths = [f"pkg/module_{i}.py" for i in range(2000)]
    chosen = [p for p in paths if is_validation_file(p, 0.1)]
    assert 100 < len(chosen) < 300
    assert chosen == [p for p in paths if is_validation_file(p, 0.1)]
    assert not any(is_validation_file(p, 0.0) for p in paths)


def test_stdlib_corpus_rejects_an_empty_validation_split(cache_dir):
    with pytest.raises(ValueError, match="no validation file"):
        load_stdlib_corpus(0.0001, max_bytes=20_000)
    with pytest.raises(ValueError, match="validation_fraction"):
        load_stdlib_corpus(1.5)


def test_token_windows_do_not_overlap_and_carry_the_shifted_target():
    windows = TokenWindows(np.arange(50, dtype=np.uint16), seq_len=8)
    assert windows.num_windows == 6
    inputs, targets = windows.pairs(np.array([0, 5]))
    np.testing.assert_array_equal(inputs, [np.arange(0, 8), np.arange(40, 48)])
    np.testing.assert_array_equal(targets, [np.arange(1, 9), np.arange(41, 49)])


def test_too_few_tokens_for_one_window_is_an_error():
    with pytest.raises(ValueError, match="one window"):
        StepLoader(np.zeros(SEQ_LEN, np.uint16), SEQ_LEN, BATCH, seed=0)


def test_step_batches_are_deterministic_and_resumable():
    fresh = make_loader().rows(7, 0, BATCH)
    warmed = make_loader()
    for step in range(7):
        warmed.rows(step, 0, BATCH)
    resumed = warmed.rows(7, 0, BATCH)
    for a, b in zip(fresh, resumed):
        np.testing.assert_array_equal(a, b)
        assert a.dtype == np.int32 and a.shape == (BATCH, SEQ_LEN)


def test_different_steps_and_seeds_give_different_batches():
    loader = make_loader()
    assert not np.array_equal(loader.rows(0, 0, BATCH)[0], loader.rows(1, 0, BATCH)[0])
    assert not np.array_equal(loader.rows(0, 0, BATCH)[0], make_loader(seed=1).rows(0, 0, BATCH)[0])


def test_each_epoch_visits_every_window_once_in_a_new_order():
    loader = make_loader(num_tokens=SEQ_LEN * 4 * BATCH + 1)  # exactly 4 steps per epoch
    epochs = [np.concatenate([loader.rows(s, 0, BATCH)[0][:, 0] for s in range(e * 4, e * 4 + 4)]) for e in range(2)]
    all_window_starts = np.arange(loader.windows.num_windows) * SEQ_LEN % 251
    for firsts in epochs:
        np.testing.assert_array_equal(np.sort(firsts), np.sort(all_window_starts))
    assert not np.array_equal(epochs[0], epochs[1])


def test_batch_straddling_an_epoch_boundary_is_consistent():
    loader = make_loader(num_tokens=SEQ_LEN * 13 + 1)  # 13 windows: step 1 spans epochs 0 and 1
    full = loader.rows(1, 0, BATCH)
    split = [make_loader(num_tokens=SEQ_LEN * 13 + 1).rows(1, a, b) for a, b in [(0, 5), (5, 8)]]
    np.testing.assert_array_equal(full[0], np.concatenate([split[0][0], split[1][0]]))


def test_row_ranges_are_slices_of_the_global_batch():
    loader = make_loader()
    inputs, targets = loader.rows(3, 0, BATCH)
    part_inputs, part_targets = loader.rows(3, 2, 6)
    np.testing.assert_array_equal(part_inputs, inputs[2:6])
    np.testing.assert_array_equal(part_targets, targets[2:6])


def test_targets_are_inputs_shifted_by_one():
    inputs, targets = make_loader().rows(2, 0, BATCH)
    np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])
    np.testing.assert_array_equal((inputs + 1) % 251, targets)


@pytest.mark.parametrize("spec", [P("data"), P()], ids=["data_sharded", "replicated"])
def test_global_batch_matches_host_rows(spec):
    sharding = NamedSharding(jax.make_mesh((8,), ("data",)), spec)
    loader = make_loader()
    batch = global_batch(loader, 5, sharding)
    inputs, targets = loader.rows(5, 0, BATCH)
    assert batch["inputs"].sharding == sharding and batch["inputs"].shape == (BATCH, SEQ_LEN)
    np.testing.assert_array_equal(np.asarray(batch["inputs"]), inputs)
    np.testing.assert_array_equal(np.asarray(batch["targets"]), targets)


def test_prefetcher_matches_direct_batches_for_consecutive_steps_and_a_jump():
    sharding = NamedSharding(jax.make_mesh((8,), ("data",)), P("data"))
    loader = make_loader()
    with Prefetcher(loader, sharding, first_step=3) as prefetcher:
        for step in [3, 4, 5, 20, 21, 2]:
            got = prefetcher.get(step)
            want = loader.rows(step, 0, BATCH)
            np.testing.assert_array_equal(np.asarray(got["inputs"]), want[0])
            np.testing.assert_array_equal(np.asarray(got["targets"]), want[1])


def test_eval_batches_are_deterministic_and_wrap_around():
    tokens = np.arange(SEQ_LEN * 3 + 1, dtype=np.uint16)  # 3 windows
    first = list(eval_batches(tokens, SEQ_LEN, batch_size=2, num_batches=3))
    second = list(eval_batches(tokens, SEQ_LEN, batch_size=2, num_batches=3))
    assert len(first) == 3
    for (a_in, a_tg), (b_in, b_tg) in zip(first, second):
        np.testing.assert_array_equal(a_in, b_in)
        np.testing.assert_array_equal(a_tg, b_tg)
    window_starts = [int(x) for inputs, _ in first for x in inputs[:, 0]]
    assert window_starts == [0, 16, 32, 0, 16, 32]
