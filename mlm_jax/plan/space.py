"""The layouts a config may take on N GPUs: every split of the devices over the mesh axes that the model's shapes
allow, each with its pipeline schedule and virtual stages, then, per split, the settings that trade memory for time
(micro batch, recompute, loss chunks, ZeRO-1) in the order the planner tries them: fastest first, so that the
first one that fits is the split's best."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from mlm_jax.config import Config

REMATS = ("none", "dots", "full")  # model.remat in the order tried: more recompute, less memory, more time


@dataclass(frozen=True)
class Split:
    """Mesh degrees (product N) and the pipeline's shape; `overrides` as `key=value` strings."""

    degrees: tuple[tuple[str, int], ...]
    virtual: int = 1
    schedule: str = "1f1b"
    sequence_parallel: bool = False

    @property
    def overrides(self) -> list[str]:
        out = [f"parallel.{a}={n}" for a, n in self.degrees]
        out += [f"parallel.virtual_stages={self.virtual}", f"parallel.pipeline_schedule={self.schedule}",
                f"parallel.sequence_parallel={str(self.sequence_parallel).lower()}"]
        return out

    def value(self, key: str):
        """A `parallel.*` key's value in this split."""
        names = {"virtual_stages": self.virtual, "pipeline_schedule": self.schedule,
                 "sequence_parallel": self.sequence_parallel}
        return names[key] if key in names else dict(self.degrees)[key]

    def describe(self) -> str:
        d = dict(self.degrees)
        text = " ".join(f"{a}{n}" for a, n in self.degrees if n > 1) or "1 GPU"
        if d.get("stage", 1) > 1:
            text += f" {self.schedule} V{self.virtual}"
        return text + (" SP" if self.sequence_parallel else "")


@dataclass(frozen=True)
class Setting:
    """The memory-for-time choices inside a split."""

    micro_batch: int
    remat: str
    loss_chunks: int = 1
    shard_optimizer: bool = False

    @property
    def overrides(self) -> list[str]:
        return [f"train.micro_batch_size={self.micro_batch}", "train.num_microbatches=null",
                f"model.remat={self.remat}", f"train.loss_chunks={self.loss_chunks}",
                f"parallel.shard_optimizer={str(self.shard_optimizer).lower()}"]

    def describe(self) -> str:
        extra = (f" loss/{self.loss_chunks}" if self.loss_chunks > 1 else "") + (" zero1" if self.shard_optimizer else "")
        return f"mb{self.micro_batch} remat={self.remat}{extra}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


SPLIT_KEYS = {"stage", "data", "fsdp", "context", "expert", "tensor", "virtual_stages", "pipeline_schedule",
              "sequence_parallel"}
SETTING_KEYS = {"train.micro_batch_size", "train.num_microbatches", "model.remat", "train.loss_chunks",
                "parallel.shard_optimizer"}


def fixed(overrides: list[str]) -> dict[str, str]:
    """The keys of the layout the user set on the command line (`parallel.tensor=2`, `model.remat=full`, ...): the
    search keeps them as given."""
    pairs = dict(o.partition("=")[::2] for o in overrides)
    out = {k.removeprefix("parallel."): v for k, v in pairs.items()
           if k.startswith("parallel.") and k.removeprefix("parallel.") in SPLIT_KEYS}
    return out | {k: v for k, v in pairs.items() if k in SETTING_KEYS}


def splits(cfg: Config, gpus: int, gpus_per_node: int, keep: dict[str, str] | None = None) -> list[Split]:
    """Every split of `gpus` over stage, data, fsdp, context, expert and tensor that the shapes could allow: tensor
    within a node and dividing the heads, expert only for an MoE model and dividing its experts, context only for
    sequences it can cut, stages at most the layers; those that agree with `keep` (`fixed`). The rest of the rules
    are `validation`'s (the planner reports its refusal of a split, one line each)."""
    m, t = cfg.model, cfg.train
    out = []
    for tensor in _divisors(min(gpus, gpus_per_node)):
        if m.num_heads % tensor:
            continue
        for expert in _divisors(gpus // tensor) if m.moe.enabled else [1]:
            if m.moe.enabled and m.moe.num_experts % expert:
                continue
            for context in _divisors(gpus // (tensor * expert)):
                if context > 1 and (m.sliding_window is not None or t.seq_len % (2 * context)):
                    continue
                for stage in _divisors(gpus // (tensor * expert * context)):
                    if stage > m.num_layers:
                        continue
                    rest = gpus // (tensor * expert * context * stage)
                    for fsdp in _divisors(rest):
                        degrees = (("stage", stage), ("data", rest // fsdp), ("fsdp", fsdp), ("context", context),
                                   ("expert", expert), ("tensor", tensor))
                        pipes = ([(1, "1f1b")] if stage == 1 else
                                 [(v, s) for v, s in itertools.product((1, 2), ("1f1b", "zb1"))
                                  if m.num_layers % (stage * v) == 0])
                        for (virtual, schedule), sp in itertools.product(pipes, (tensor > 1,)):
                            out.append(Split(degrees, virtual, schedule, sp))
    keep = {k: v for k, v in (keep or {}).items() if k in SPLIT_KEYS}
    return [s for s in out if all(str(s.value(k)).lower() == want.lower() for k, want in keep.items())]


def settings(cfg: Config, split: Split, remats: tuple[str, ...] = REMATS,
             keep: dict[str, str] | None = None) -> list[Setting]:
    """A split's settings, fastest first: the largest micro batch the batch allows (pipelines: at least one
    microbatch per stage), no recompute before some, the loss in one piece before chunks; ZeRO-1 where the weights
    are replicated over data-parallel ranks; those that agree with `keep` (`fixed`)."""
    d = dict(split.degrees)
    t = cfg.train
    rows = t.global_batch_size // (d["data"] * d["fsdp"] * d["expert"]) if t.global_batch_size % (
        d["data"] * d["fsdp"] * d["expert"]) == 0 else 0
    micro = [b for b in sorted(_divisors(rows), reverse=True) if d["stage"] == 1 or rows // b >= d["stage"]]
    zero1 = [False, True] if d["data"] > 1 and d["fsdp"] == 1 else [False]
    chunks = [1] + ([4] if t.seq_len % (4 * d["context"]) == 0 else [])
    out = [Setting(b, r, c, z) for r in remats for b in micro for z in zero1 for c in chunks]
    keep = keep or {}

    def agrees(s: Setting) -> bool:
        given = {"train.micro_batch_size": s.micro_batch, "train.num_microbatches": rows // s.micro_batch,
                 "model.remat": s.remat, "train.loss_chunks": s.loss_chunks,
                 "parallel.shard_optimizer": s.shard_optimizer}
        return all(str(given[k]).lower() == v.lower() for k, v in keep.items() if k in given and v != "null")
    return [s for s in out if agrees(s)]
