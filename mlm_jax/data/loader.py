"""Stateless, step-indexed loader: the batch of a step is a pure function of (tokens, seed, step).

So resuming needs only the step, and every process can compute exactly the rows its devices hold.

Shapes: B global batch, S sequence length, R rows of the global batch read by this process.
"""

import queue
import threading
from collections.abc import Iterator

import jax
import numpy as np

from mlm_jax.data.tokenfile import BlendedTokens, TokenWindows


class StepLoader:
    """Sample i of the run is window perm_e[i % n], e = i // n, with perm_e seeded by (seed, e).

    Each epoch visits every window once in a fresh order; the global batch of step s is
    samples [s·B, (s+1)·B).
    """

    def __init__(self, tokens, seq_len: int, global_batch_size: int, seed: int, eod_id: int | None = None):
        """`tokens`: a token array (windows of it; with `eod_id` its documents kept apart, `data.documents`), a
        `BlendedTokens`, or rows of packed examples (`packing.PackedRows`)."""
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size must be >= 1, got {global_batch_size}")
        # A blend is already shuffled and holds its weights within every step, so it is read in order.
        self.blend = tokens if isinstance(tokens, BlendedTokens) else None
        if getattr(tokens, "seq_len", seq_len) != seq_len:
            raise ValueError(f"the windows have seq_len={tokens.seq_len}, the loader {seq_len}")
        self.windows = tokens if hasattr(tokens, "fields") else TokenWindows(tokens, seq_len, eod_id)
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.seed = seed
        self._epoch_perm = (-1, np.empty(0, np.int64))  # replaced whole, so readers on any thread see a pair

    def _permutation(self, epoch: int) -> np.ndarray:
        cached_epoch, perm = self._epoch_perm
        if cached_epoch != epoch:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.windows.num_windows)
            self._epoch_perm = (epoch, perm)
        return perm

    def rows(self, step: int, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows [start, stop) of the global batch of `step`: (inputs_RS, targets_RS), int32."""
        return self.windows.pairs(self._window_ids(step, start, stop))

    def fields(self, step: int, start: int, stop: int) -> dict[str, np.ndarray]:
        """`rows` with every field of the batch (`keys`)."""
        return self.windows.fields(self._window_ids(step, start, stop))

    @property
    def keys(self) -> tuple[str, ...]:
        """The arrays of every batch: inputs and targets, and the documents' fields where they are kept apart."""
        return self.windows.keys

    def _window_ids(self, step: int, start: int, stop: int) -> np.ndarray:
        B = self.global_batch_size
        if step < 0 or not 0 <= start <= stop <= B:
            raise ValueError(f"need step >= 0 and 0 <= start <= stop <= {B}, got {step=}, {start=}, {stop=}")
        samples = step * B + np.arange(start, stop, dtype=np.int64)
        if self.blend is not None:
            return samples
        epochs, positions = np.divmod(samples, self.windows.num_windows)
        window_ids = np.empty_like(samples)
        for epoch in np.unique(epochs):
            in_epoch = epochs == epoch
            window_ids[in_epoch] = self._permutation(int(epoch))[positions[in_epoch]]
        return window_ids


def local_row_range(sharding: jax.sharding.Sharding, global_shape: tuple[int, ...]) -> tuple[int, int]:
    """The [start, stop) rows of dim 0 that this process's devices hold."""
    n = global_shape[0]
    spans = sorted({idx[0].indices(n)[:2] for idx in sharding.addressable_devices_indices_map(global_shape).values()})
    start, stop = spans[0]
    for lo, hi in spans[1:]:
        assert lo <= stop, f"this process's rows are not one contiguous range: {spans}"
        stop = max(stop, hi)
    return start, stop


def _local_rows(loader: StepLoader, step: int, sharding: jax.sharding.Sharding) -> dict[str, np.ndarray]:
    return loader.fields(step, *local_row_range(sharding, (loader.global_batch_size, loader.seq_len)))


def _assemble(loader: StepLoader, sharding: jax.sharding.Sharding, rows: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    shape_BS = (loader.global_batch_size, loader.seq_len)
    return {k: jax.make_array_from_process_local_data(sharding, v, shape_BS) for k, v in rows.items()}


def global_batch(loader: StepLoader, step: int, sharding: jax.sharding.Sharding) -> dict[str, jax.Array]:
    """`loader.keys`: global (B, S) arrays, built from only the rows this process's devices hold."""
    return _assemble(loader, sharding, _local_rows(loader, step, sharding))


class Prefetcher:
    """Reads the host rows of the next steps on a background thread, off the training step's critical path.

    `get` must be called with consecutive steps to benefit; any other step is computed directly and
    prefetching restarts after it. jax.Arrays are created on the calling thread.
    """

    _DEPTH = 2

    def __init__(self, loader: StepLoader, sharding: jax.sharding.Sharding, first_step: int):
        self._loader = loader
        self._sharding = sharding
        self._start(first_step)

    def _start(self, first_step: int) -> None:
        self._next_step = first_step
        self._queue = queue.Queue(maxsize=self._DEPTH)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._work, args=(first_step, self._queue, self._stop), daemon=True, name="mlm_jax-prefetch"
        )
        self._thread.start()

    def _work(self, step: int, out: queue.Queue, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                item = (step, _local_rows(self._loader, step, self._sharding))
            except Exception as e:  # re-raised by get() on the caller's thread
                item = (step, e)
            while not stop.is_set():
                try:
                    out.put(item, timeout=0.1)
                    break
                except queue.Full:
                    pass
            if isinstance(item[1], Exception):
                return
            step += 1

    def get(self, step: int) -> dict[str, jax.Array]:
        if step != self._next_step:
            self.close()
            self._start(step + 1)
            return global_batch(self._loader, step, self._sharding)
        got_step, rows = self._queue.get()
        assert got_step == step, (got_step, step)
        if isinstance(rows, Exception):
            self.close()
            self._start(step)  # the worker stopped; a retry of this step starts a fresh one
            raise rows
        self._next_step = step + 1
        return _assemble(self._loader, self._sharding, rows)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> "Prefetcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def eval_batches(
    tokens, seq_len: int, batch_size: int, num_batches: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The first num_batches·batch_size windows in order (wrapping if fewer): every evaluation sees the same data."""
    return _eval_reads(tokens, seq_len, batch_size, num_batches, None, "pairs")


def eval_fields(tokens, seq_len: int, batch_size: int, num_batches: int,
                eod_id: int | None = None) -> Iterator[dict[str, np.ndarray]]:
    """`eval_batches` with every field of the batch (`StepLoader.keys`)."""
    return _eval_reads(tokens, seq_len, batch_size, num_batches, eod_id, "fields")


def _eval_reads(tokens, seq_len, batch_size, num_batches, eod_id, how):
    windows = tokens if hasattr(tokens, "fields") else TokenWindows(tokens, seq_len, eod_id)
    ids = np.arange(num_batches * batch_size, dtype=np.int64) % windows.num_windows
    return (getattr(windows, how)(ids[b * batch_size : (b + 1) * batch_size]) for b in range(num_batches))
