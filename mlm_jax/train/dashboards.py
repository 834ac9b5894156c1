"""Where a run's logged records go besides metrics.jsonl: TensorBoard (`<output_dir>/tensorboard`, by default) and
Weights & Biases (`log.wandb_project`). Both take the records the loop has already fetched to the host (no extra
wait for the device), are written by process 0 only, and last one `fit` (closed at its end, however it ends)."""
from __future__ import annotations

import os
import sys
import uuid

from mlm_jax.config import Config, to_yaml


def scalars(record: dict) -> dict[str, float]:
    """A record's numbers as named scalars, a per-layer list (MoE statistics) as `name/<i>`, one per MoE layer; the
    step, text and nulls (a value the backend lacks, such as MFU on a CPU, or a non-finite one, which
    `skipped_steps` counts) left out."""
    out = {}
    for name, value in record.items():
        if name == "step" or isinstance(value, str) or value is None:
            continue
        if isinstance(value, list):
            out.update({f"{name}/{i}": float(v) for i, v in enumerate(value) if isinstance(v, (int, float))})
        else:
            out[name] = float(value)
    return out


def _summary_writer():
    """tensorboardX's writer (checked with the config; `log.tensorboard=false` runs without it), imported without
    torch: tensorboardX imports torch where it is installed, about 3 s of a run's start-up, only to accept its
    tensors, and the records hold floats. A module set to None in `sys.modules` fails to import, which tensorboardX
    expects of a machine without torch; a torch the process has already imported is left as it is."""
    hide = "torch" not in sys.modules
    if hide:
        sys.modules["torch"] = None
    try:
        from tensorboardX import SummaryWriter
    finally:
        if hide:
            del sys.modules["torch"]
    return SummaryWriter


class TensorBoard:
    """Event files that `tensorboard --logdir <output_dir>` shows: every logged record's scalars, and the resolved
    config as text."""

    def __init__(self, cfg: Config):
        self.directory = os.path.join(cfg.train.output_dir, "tensorboard")
        self.writer = _summary_writer()(self.directory)
        self.writer.add_text("config", "\n".join("    " + line for line in to_yaml(cfg).splitlines()))

    def write(self, record: dict) -> None:
        for name, value in scalars(record).items():
            self.writer.add_scalar(name, value, record["step"])

    def close(self) -> None:
        self.writer.close()


class WandB:
    """A Weights & Biases run in `log.wandb_project`, named after the output directory (`WANDB_NAME` overrides),
    its config the resolved one; `WANDB_MODE=offline` writes it under `<output_dir>/wandb` for `wandb sync`. The
    run's id is kept in `<output_dir>/wandb_id`, so that a resumed run (or the next `fit`) continues the same
    W&B run."""

    def __init__(self, cfg: Config):
        import wandb  # an optional dependency (the `wandb` extra), checked with the config

        id_path = os.path.join(cfg.train.output_dir, "wandb_id")
        if os.path.exists(id_path):
            with open(id_path) as f:
                run_id = f.read().strip()
        else:
            run_id = uuid.uuid4().hex[:12]
            with open(id_path, "w") as f:
                f.write(run_id + "\n")
        self.run = wandb.init(project=cfg.log.wandb_project, dir=cfg.train.output_dir, config=cfg.to_dict(),
                              id=run_id, resume="allow", name=os.environ.get("WANDB_NAME") or os.path.basename(
                                  os.path.abspath(cfg.train.output_dir)))

    def write(self, record: dict) -> None:
        self.run.log(scalars(record), step=record["step"])

    def close(self) -> None:
        self.run.finish()


def dashboards(cfg: Config) -> list:
    """The run's dashboards by its config: TensorBoard unless `log.tensorboard=false`, W&B with `log.wandb_project`."""
    out = [TensorBoard(cfg)] if cfg.log.tensorboard else []
    if cfg.log.wandb_project:
        out.append(WandB(cfg))
    return out
