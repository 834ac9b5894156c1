"""Weights-only checkpoints in the trainer's orbax format (`params` + `meta`), written and read whole on one device.

Parameters are stored in their canonical logical shapes, so a checkpoint saved under any parallel layout restores
here onto a single device without knowing that layout.
"""
from __future__ import annotations

import os
from typing import Any, NamedTuple

import jax
import orbax.checkpoint as ocp

from mlm_jax.checkpoint import state as ckpt
from mlm_jax.config import ModelConfig, model_from_dict


class ConvertError(ValueError):
    """A source or checkpoint that cannot be converted or loaded (`mlm_jax.convert`, `load_pretrained`); the message
    is one line."""


class Checkpoint(NamedTuple):
    directory: str
    step: int
    meta: dict

    @property
    def model(self) -> ModelConfig:
        return model_from_dict(self.meta["config"]["model"])


def _manager(directory: str, create: bool = False) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(create=create, enable_async_checkpointing=False)
    return ocp.CheckpointManager(os.path.abspath(directory), options=options)


def save_weights(directory: str, params: Any, meta: dict) -> None:
    """`params` (nested dict of numpy arrays) and `meta` as checkpoint `<directory>/<meta['step']>`."""
    manager = _manager(directory, create=True)
    try:
        manager.save(int(meta["step"]), args=ocp.args.Composite(
            params=ocp.args.StandardSave(params), meta=ocp.args.JsonSave({"format": ckpt.FORMAT, **meta})))
        manager.wait_until_finished()
    finally:
        manager.close()


def open_checkpoint(path: str) -> Checkpoint:
    """The newest checkpoint at `path`: a checkpoints dir, one step in it, or a dir holding `checkpoints/`."""
    directory, steps = ckpt.locate(path)
    if not steps:
        raise ConvertError(f"{path}: no checkpoint there (expected a checkpoints dir, one step in it, "
                           f"or a dir holding checkpoints/)")
    step = max(steps)
    manager = _manager(directory)
    try:
        meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    except Exception as e:  # noqa: BLE001 - any failure to read is one line for the user
        raise ConvertError(f"{directory}/{step}: unreadable metadata ({str(e).splitlines()[0][:200]})") from None
    finally:
        manager.close()
    if meta.get("format") != ckpt.FORMAT or "model" not in meta.get("config", {}):
        raise ConvertError(f"{directory}/{step}: not an mlm_jax checkpoint of format {ckpt.FORMAT}")
    return Checkpoint(directory, step, dict(meta))


def restore_weights(c: Checkpoint, shapes: Any, device: jax.Device, shardings: Any = None) -> Any:
    """The checkpoint's `params`, whole on `device` or laid out by `shardings` (a tree like `shapes`, each
    parameter read straight into its shards); `shapes` is `model_spec(c.model).shapes`."""
    if shardings is None:
        shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(device), shapes)
    target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)
    manager = _manager(c.directory)
    try:
        return manager.restore(c.step, args=ocp.args.Composite(params=ocp.args.StandardRestore(target))).params
    except Exception as e:  # noqa: BLE001
        raise ConvertError(f"{c.directory}/{c.step}: unreadable parameters ({str(e).splitlines()[0][:200]})") from None
    finally:
        manager.close()
