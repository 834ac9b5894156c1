"""The GPUs the planner prices layouts for: published figures (dense bf16 FLOP/s, HBM size and bandwidth, NVLink
and network bandwidth per GPU), each overridable on the command line, and the description XLA compiles a GPU
program from without a GPU (`target_config`)."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from mlm_jax.train.metrics import PEAK_FLOPS  # the peaks MFU is reported against

GIB = 2**30


@dataclass(frozen=True)
class Gpu:
    """One GPU kind. Bandwidths in bytes/s per GPU, one direction; latencies in seconds per collective step."""

    name: str
    memory_bytes: int  # HBM the driver reports
    peak_flops: float  # dense bf16
    hbm_bandwidth: float
    nvlink_bandwidth: float
    network_bandwidth: float
    cores: int
    capability: tuple[int, int]
    nvlink_latency: float = 5e-6
    network_latency: float = 15e-6

    @property
    def capacity(self) -> int:
        """What a run may use: XLA's allocator takes `XLA_PYTHON_CLIENT_MEM_FRACTION` (0.75 by default) of the
        memory, as the trainer's memory report counts it."""
        return int(self.memory_bytes * float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75")))

    def target_config(self) -> str:
        """XLA's `GpuTargetConfigProto` (text) for compiling to this GPU without one attached."""
        major, minor = self.capability
        return (f"gpu_device_info {{ threads_per_block_limit: 1024 threads_per_warp: 32 "
                f"shared_memory_per_block: 49152 shared_memory_per_core: 233472 threads_per_core_limit: 2048 "
                f"core_count: {self.cores} fpus_per_core: 128 block_dim_limit_x: 2147483647 "
                f"block_dim_limit_y: 65535 block_dim_limit_z: 65535 memory_bandwidth: {int(self.hbm_bandwidth)} "
                f"l2_cache_size: 52428800 clock_rate_ghz: 1.98 device_memory_size: {self.memory_bytes} "
                f"shared_memory_per_block_optin: 232448 cuda_compute_capability {{ major: {major} minor: {minor} }} "
                f"registers_per_core_limit: 65536 registers_per_block_limit: 65536 }} platform_name: \"CUDA\" "
                f"dnn_version_info {{ major: 9 minor: 10 }} device_description_str: \"NVIDIA {self.name}\"")


GPUS = {
    # H100 SXM: 989 TFLOP/s bf16 dense, 80 GB HBM3 at 3.35 TB/s, NVLink 4 900 GB/s both ways, 400 Gb/s NDR per GPU
    "h100": Gpu("H100", 85_051_572_224, PEAK_FLOPS["H100"], 3.35e12, 450e9, 50e9, 132, (9, 0)),
    # H200 SXM: the H100's compute with 141 GB HBM3e at 4.8 TB/s
    "h200": Gpu("H200", 150_121_545_728, PEAK_FLOPS["H200"], 4.8e12, 450e9, 50e9, 132, (9, 0)),
    # B200: 2.25 PFLOP/s bf16 dense, 180 GB HBM3e at 8 TB/s, NVLink 5 1.8 TB/s both ways
    "b200": Gpu("B200", 193_273_528_320, PEAK_FLOPS["B200"], 8e12, 900e9, 50e9, 148, (10, 0)),
}


def gpu(name: str, **overrides) -> Gpu:
    """`GPUS[name]` with the given fields replaced (None leaves a field as published)."""
    return dataclasses.replace(GPUS[name], **{k: v for k, v in overrides.items() if v is not None})
