"""What a run holds on each device: the weights and optimizer state by their shardings, and the compiled step's
whole footprint by XLA's memory analysis, against the device's capacity, so that a layout that cannot fit is
refused before its first step rather than failing inside it."""
from __future__ import annotations

import dataclasses
import math

import jax

from mlm_jax.config import ConfigError

GIB = 2**30


def per_device_bytes(tree) -> int:
    """Bytes of `tree`'s arrays on one device (the largest shard of each)."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def capacity(devices) -> int | None:
    """The memory each of `devices` lets a program use (the least of them), where the backend reports it."""
    limits = [s["bytes_limit"] for s in (d.memory_stats() for d in devices) if s and s.get("bytes_limit")]
    return min(limits) if limits else None


_REMEDY = ("shard the weights and optimizer state further (parallel.fsdp, parallel.tensor, parallel.shard_optimizer), "
           "recompute activations (model.remat) or lower train.micro_batch_size")


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Per device, in bytes: `total` is the compiled step's footprint (its inputs, the weights and optimizer state
    among them, its outputs less those that reuse an input's buffer, its temporaries and code)."""

    params: int
    optimizer: int
    temporaries: int
    total: int
    capacity: int | None

    def describe(self) -> str:
        of = f" of {self.capacity / GIB:.1f} GiB" if self.capacity else ""
        return (f"memory per device: parameters {self.params / GIB:.2f} GiB, optimizer state "
                f"{self.optimizer / GIB:.2f} GiB, step temporaries {self.temporaries / GIB:.2f} GiB; the step "
                f"{self.total / GIB:.2f} GiB{of}")

    def check(self) -> None:
        """Refuses (one line, with the figures) a step that needs more than a device has."""
        if self.capacity and self.total > self.capacity:
            raise ConfigError(f"the run does not fit: {self.describe()}: {_REMEDY}")


def compile_refusal(error: Exception, state, devices) -> ConfigError | None:
    """The refusal of a step whose compilation ran out of device memory (XLA's autotuner runs candidate kernels
    before any memory analysis exists, beside a resumed run's state), or None for another error."""
    text = str(error)
    if "RESOURCE_EXHAUSTED" not in text:
        return None
    cap = capacity(devices)
    of = f" of {cap / GIB:.1f} GiB" if cap else ""
    detail = next((line.strip() for line in text.splitlines() if "Out of memory" in line), text.splitlines()[0])
    return ConfigError(f"the run does not fit: compiling the step ran out of device memory ({detail}); "
                       f"parameters {per_device_bytes(state.params) / GIB:.2f} GiB and optimizer state "
                       f"{per_device_bytes(state.opt_state) / GIB:.2f} GiB per device{of}: {_REMEDY}")


def memory_report(compiled, state, capacity: int | None) -> MemoryReport:
    """The report of the train step `compiled` over `state` (arrays or shapes with their shardings) against a
    device's `capacity` in bytes: what a run prints at its start and what the layout planner ranks by."""
    m = compiled.memory_analysis()
    total = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
             + m.generated_code_size_in_bytes)
    return MemoryReport(params=per_device_bytes(state.params), optimizer=per_device_bytes(state.opt_state),
                        temporaries=m.temp_size_in_bytes, total=total, capacity=capacity)
