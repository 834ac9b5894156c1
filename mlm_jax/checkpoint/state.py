"""Sharded, async, atomic checkpoints through orbax, restorable onto any mesh.

A checkpoint `<dir>/<step>/` holds `params` (fp32 master weights), `train` (optimizer state, step and skipped-step
counters), both in the canonical layout (logical shapes, no mesh), and `meta` (JSON: the step, the data position,
the seed that fixes initialisation and data order, and the resolved config). A weights-only checkpoint (a converted
model) has no `train` item. Restoring reads into shardings of the *current*
mesh, so any layout resumes any other. orbax writes into a temporary directory and renames it when complete, so
a process killed mid-save leaves nothing that `latest` would pick up. A checkpoint that is complete but unreadable
(a damaged disk) is skipped on resume and moved aside, never deleted, so that the run writes that step afresh.
"""
from __future__ import annotations

import os
import time
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
from etils import epath

from mlm_jax.config import ConfigError
from mlm_jax.ops import fp8

FORMAT = 1


class TrainState(NamedTuple):
    """What a checkpoint holds of a run, and what the train step carries from one step to the next."""

    step: jax.Array  # int32 scalar: steps taken, skipped ones included (the data position)
    params: Any  # nested dict of fp32 master weights
    opt_state: optax.OptState
    skipped_steps: jax.Array  # int32 scalar: updates dropped for a non-finite loss or gradient


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message is one line."""


def _train_items(state: TrainState) -> dict:
    return {"opt_state": state.opt_state, "step": state.step, "skipped_steps": state.skipped_steps}


def _manager(directory: str, keep: int | None, create: bool) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=create, enable_async_checkpointing=True)
    return ocp.CheckpointManager(os.path.abspath(directory), options=options)


class Checkpointer:
    """Saves every `every` steps (0 = only when asked) and keeps the newest `keep`."""

    def __init__(self, directory: str, every: int, keep: int):
        self.directory, self.every = os.path.abspath(directory), every
        try:
            self.manager = _manager(self.directory, keep, create=True)
        except OSError as e:
            raise ConfigError(f"checkpoint.dir={directory}: cannot create ({e.strerror or e})") from None

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def save(self, state: TrainState, meta: dict) -> None:
        """Starts an async save of `state` at its step (no-op if that step is already saved)."""
        step = int(meta["step"])
        if step in self.manager.all_steps():
            return
        try:
            self.manager.save(step, args=ocp.args.Composite(
                params=ocp.args.StandardSave(state.params), train=ocp.args.StandardSave(_train_items(state)),
                meta=ocp.args.JsonSave({"format": FORMAT, **meta})), force=True)
        except OSError as e:
            raise CheckpointError(f"saving step {step} to {self.directory} failed: {e.strerror or e}; "
                                  f"earlier checkpoints are intact") from None

    def wait(self) -> None:
        try:
            self.manager.wait_until_finished()
        except OSError as e:
            raise CheckpointError(f"saving to {self.directory} failed: {e.strerror or e}; "
                                  f"earlier checkpoints are intact") from None

    def close(self) -> None:
        self.wait()
        self.manager.close()


def checkpoint_steps(directory: str) -> list[int]:
    """Complete checkpoints in `directory`, oldest first (temporary, half-written ones are not listed).

    Read from the directory listing, not through a CheckpointManager, whose creation is a barrier across
    processes: the processes of one run look before any of them creates the directory, or after, not in step.
    """
    return sorted(ocp.utils.checkpoint_steps(directory)) if os.path.isdir(directory) else []


def locate(path: str) -> tuple[str, list[int]]:
    """`path` is a checkpoint directory (`.../checkpoints`), one step in it (`.../checkpoints/120`) or a directory
    holding `checkpoints/` (a run's output or a converted model)."""
    path = os.path.abspath(path)
    if steps := checkpoint_steps(path):
        return path, steps
    parent, name = os.path.split(path)
    if name.isdigit() and int(name) in checkpoint_steps(parent):
        return parent, [int(name)]
    if steps := checkpoint_steps(os.path.join(path, "checkpoints")):
        return os.path.join(path, "checkpoints"), steps
    return path, []


def _without_histories(tree: dict) -> dict:
    return {k: _without_histories(v) if isinstance(v, dict) else v for k, v in tree.items() if k != fp8.HISTORY}


def _with_empty_histories(params: dict, abstract: dict) -> dict:
    """`params` with the zero (empty) history of each one `abstract` has and `params` lacks, in its sharding."""
    def fill(p, a):
        if isinstance(a, dict):
            return {k: fill((p or {}).get(k), v) for k, v in a.items()}
        if p is not None:
            return p
        return jax.make_array_from_callback(a.shape, a.sharding, lambda index: np.zeros(a.shape, a.dtype)[index])
    return fill(params, abstract)


def _first_line(e: Exception) -> str:
    return next((line.strip()[:200] for line in str(e).splitlines() if line.strip()), type(e).__name__)


def _aside_path(directory: str, step: int) -> str:
    """`<step>.unreadable-<time>`: no digits-only name and no `_<digits>` suffix, so orbax never lists it as a step."""
    base = os.path.join(directory, f"{step}.unreadable-{time.strftime('%Y%m%d-%H%M%S')}")
    path, n = base, 1
    while os.path.exists(path):
        n += 1
        path = f"{base}-{n}"
    return path


def _move_aside(directory: str, failed: list[tuple[int, str]], restored: int) -> None:
    """Renames the unreadable checkpoints newer than `restored`, so that the next save at their step writes a complete
    checkpoint (a save at an existing step is skipped). Process 0 renames and reports; all processes read the same
    directory, so the others wait for it at a barrier (only on this path)."""
    if jax.process_index() == 0:
        for step, reason in failed:
            src, dst = os.path.join(directory, str(step)), _aside_path(directory, step)
            try:
                os.rename(src, dst)
            except OSError as e:
                raise CheckpointError(f"checkpoint {src} is unreadable ({reason}) and cannot be moved aside: "
                                      f"{e.strerror or e}") from None
            print(f"warning: checkpoint {src} is unreadable ({reason}); moved aside to {dst}; "
                  f"resuming from {directory}/{restored}")
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices("mlm_jax: unreadable checkpoints moved aside")


def _warn_unreadable(directory: str, failed: list[tuple[int, str]], used: int) -> None:
    """Printed by process 0 only: every process reads the same checkpoint and fails the same way."""
    if jax.process_index() == 0:
        for step, reason in failed:
            print(f"warning: checkpoint {directory}/{step} is unreadable ({reason}); using {directory}/{used}")


def read_meta(manager: ocp.CheckpointManager, step: int) -> dict:
    """The `meta` JSON of a checkpoint alone: cheap, and no array is read."""
    return dict(manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta)


def _leaf_shapes(tree, histories: bool = True) -> dict[str, tuple[int, ...]]:
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        names = [str(getattr(k, "key", k)) for k in path]
        if histories or fp8.HISTORY not in names:
            out[".".join(names)] = tuple(leaf.shape)
    return out


def mismatch(directory: str, step: int, abstract_params, histories: bool = True) -> str | None:
    """How the weights stored at `<directory>/<step>` differ in names or shapes from `abstract_params` (fp8
    histories left out unless `histories`), read from the checkpoint's metadata (no array is read); None where they
    fit. Raises where the metadata is unreadable."""
    stored = _leaf_shapes(ocp.StandardCheckpointHandler().metadata(epath.Path(directory) / str(step) / "params"),
                          histories)
    wanted = _leaf_shapes(abstract_params, histories)
    if missing := [k for k in wanted if k not in stored]:
        return f"{missing[0]} is not there" + (f" ({len(missing) - 1} more)" if len(missing) > 1 else "")
    if extra := [k for k in stored if k not in wanted]:
        return f"{extra[0]} is there and not in this model" + (f" ({len(extra) - 1} more)" if len(extra) > 1 else "")
    if differ := [k for k in wanted if stored[k] != wanted[k]]:
        k = differ[0]
        return f"{k} is {stored[k]} there and {wanted[k]} here" + (
            f" ({len(differ) - 1} more)" if len(differ) > 1 else "")
    return None


class _Unreadable(Exception):
    """A checkpoint's meta or array metadata could not be read; the message is the first line of why."""


def _checked_meta(manager: ocp.CheckpointManager, directory: str, step: int, abstract_params, check,
                  histories: bool = True) -> dict:
    """The meta of `<directory>/<step>` once `check(step, meta, mismatch)` has seen it and its weights' shapes fit
    `abstract_params` (`mismatch`); no array is read. Raises `_Unreadable` where the meta or metadata is."""
    try:
        meta = read_meta(manager, step)
        differs = mismatch(directory, step, abstract_params, histories)
    except Exception as e:  # noqa: BLE001 - any failure to read means: unreadable
        raise _Unreadable(_first_line(e)) from None
    if check is not None:
        check(step, meta, differs)
    if differs is not None:
        raise CheckpointError(f"{directory}/{step} holds weights of other shapes: {differs}")
    return meta


def restore(directory: str, steps: list[int], abstract_state: TrainState, check=None,
            move_aside: bool = False) -> tuple[TrainState, dict]:
    """The newest readable checkpoint among `steps`, resharded onto `abstract_state`'s shardings.

    `check(step, meta, mismatch)` sees a checkpoint's meta and how its weights' shapes differ from
    `abstract_state`'s (`mismatch`, None where they fit) before any of its arrays is read, and may raise: nothing
    has been written or moved then. An unreadable checkpoint is skipped for the previous one; once one is restored, the
    newer unreadable ones are reported and, with `move_aside` (the run's own directory), renamed to
    `<step>.unreadable-<time>` (kept, never deleted), so that this run's next save at their step is written.
    """
    manager = _manager(directory, None, create=False)
    failed: list[tuple[int, str]] = []
    try:
        for step in sorted(steps, reverse=True):
            try:
                meta = _checked_meta(manager, directory, step, abstract_state.params, check)
            except _Unreadable as e:  # fall back to the previous one
                failed.append((step, str(e)))
                continue
            if not os.path.isdir(os.path.join(directory, str(step), "train")):
                raise ConfigError(f"checkpoint.resume: {directory}/{step} holds weights only (a converted model, no "
                                  f"optimizer state): start a run from it with checkpoint.init_from={directory}/{step} "
                                  f"and another train.output_dir")
            try:
                out = manager.restore(step, args=ocp.args.Composite(
                    params=ocp.args.StandardRestore(abstract_state.params),
                    train=ocp.args.StandardRestore(_train_items(abstract_state))))
            except Exception as e:  # noqa: BLE001
                failed.append((step, _first_line(e)))
                continue
            t: dict[str, Any] = out.train
            state = TrainState(step=t["step"], params=out.params, opt_state=t["opt_state"],
                               skipped_steps=t["skipped_steps"])
            break
        else:
            raise CheckpointError(f"no readable checkpoint in {directory} (tried steps {sorted(steps)}; "
                                  f"step {failed[0][0]}: {failed[0][1]})")
    finally:
        manager.close()
    if failed:
        (_move_aside if move_aside else _warn_unreadable)(directory, failed, step)
    return state, meta


def restore_params(path: str, abstract_params, check=None) -> tuple[Any, dict]:
    """Weights only (for `checkpoint.init_from`): the newest readable checkpoint at `path`; `check` as in
    `restore`, the shapes compared without fp8 histories.

    An unreadable one is reported and skipped but left where it is: `path` is another run's directory, which
    this run does not write to (and whose own resume moves it aside).
    """
    directory, steps = locate(path)
    if not steps:
        raise ConfigError(f"checkpoint.init_from={path}: no checkpoint found there")
    # A run with fp8 delayed scaling starting from weights that have no histories (another precision's run, a
    # converted model): the weights are read alone and the histories start empty, as in a fresh run.
    weights = _without_histories(abstract_params)
    trees = [abstract_params] if weights == abstract_params else [abstract_params, weights]
    manager = _manager(directory, None, create=False)
    failed: list[tuple[int, str]] = []
    try:
        for step in sorted(steps, reverse=True):
            try:
                meta = _checked_meta(manager, directory, step, abstract_params, check, histories=False)
            except _Unreadable as e:
                failed.append((step, str(e)))
                continue
            errors = []
            for tree in trees:
                try:
                    out = manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(tree)))
                    break
                except Exception as e:  # noqa: BLE001
                    errors.append(e)
            else:
                failed.append((step, _first_line(errors[0])))
                continue
            _warn_unreadable(directory, failed, step)
            return _with_empty_histories(out.params, abstract_params), meta
    finally:
        manager.close()
    raise CheckpointError(f"checkpoint.init_from={path}: no readable checkpoint (step {failed[0][0]}: "
                          f"{failed[0][1]})")
