"""Sharded, async, atomic checkpoints through orbax, restorable onto any mesh.

A checkpoint `<dir>/<step>/` holds `params` (fp32 master weights), `train` (optimizer state, step and skipped-step
counters), both in the canonical layout (logical shapes, no mesh), and `meta` (JSON: the step, the data position,
the seed that fixes initialisation and data order, and the resolved config). A weights-only checkpoint (a converted
model) has no `train` item. Restoring reads into shardings of the *current*
mesh, so any layout resumes any other. orbax writes into a temporary directory and renames it when complete, so
a process killed mid-save leaves nothing that `latest` would pick up.
"""
from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp

from mlm_jax.config import ConfigError
from mlm_jax.train.state import TrainState

FORMAT = 1


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
    """Complete checkpoints in `directory`, oldest first (temporary, half-written ones are not listed)."""
    if not os.path.isdir(directory):
        return []
    manager = _manager(directory, None, create=False)
    try:
        return sorted(manager.all_steps())
    finally:
        manager.close()


def locate(path: str) -> tuple[str, list[int]]:
    """`path` is a checkpoint directory (`.../checkpoints`) or one step in it (`.../checkpoints/120`)."""
    path = os.path.abspath(path)
    steps = checkpoint_steps(path)
    if steps:
        return path, steps
    parent, name = os.path.split(path)
    if name.isdigit() and int(name) in checkpoint_steps(parent):
        return parent, [int(name)]
    return path, []


def _warn_unreadable(directory: str, step: int, e: Exception) -> None:
    """Printed by process 0 only: every process reads the same checkpoint and fails the same way."""
    if jax.process_index() == 0:
        reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        print(f"warning: checkpoint {directory}/{step} is unreadable ({reason}); trying the previous one")


def restore(directory: str, steps: list[int], abstract_state: TrainState) -> tuple[TrainState, dict]:
    """The newest readable checkpoint among `steps`, resharded onto `abstract_state`'s shardings.

    An unreadable checkpoint is reported and the previous one is tried.
    """
    manager = _manager(directory, None, create=False)
    try:
        for step in sorted(steps, reverse=True):
            try:
                out = manager.restore(step, args=ocp.args.Composite(
                    params=ocp.args.StandardRestore(abstract_state.params),
                    train=ocp.args.StandardRestore(_train_items(abstract_state)), meta=ocp.args.JsonRestore()))
            except Exception as e:  # noqa: BLE001 - any failure to read means: fall back to the previous one
                _warn_unreadable(directory, step, e)
                continue
            t: dict[str, Any] = out.train
            return TrainState(step=t["step"], params=out.params, opt_state=t["opt_state"],
                              skipped_steps=t["skipped_steps"]), dict(out.meta)
    finally:
        manager.close()
    raise CheckpointError(f"no readable checkpoint in {directory} (tried steps {sorted(steps)})")


def restore_params(path: str, abstract_params) -> tuple[Any, dict]:
    """Weights only (for `checkpoint.init_from`): the newest readable checkpoint at `path`."""
    directory, steps = locate(path)
    if not steps:
        raise CheckpointError(f"checkpoint.init_from={path}: no checkpoint found there")
    manager = _manager(directory, None, create=False)
    try:
        for step in sorted(steps, reverse=True):
            try:
                out = manager.restore(step, args=ocp.args.Composite(
                    params=ocp.args.StandardRestore(abstract_params), meta=ocp.args.JsonRestore()))
                return out.params, dict(out.meta)
            except Exception as e:  # noqa: BLE001
                _warn_unreadable(directory, step, e)
    finally:
        manager.close()
    raise CheckpointError(f"checkpoint.init_from={path}: no readable checkpoint")

