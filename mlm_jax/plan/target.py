"""The devices a layout is compiled for: this machine's own GPUs where it has N of the kind planned for; else N GPUs
of that kind described to XLA (`jax.experimental.topologies`, no GPU attached; needs the CUDA plugin,
`pip install -e '.[gpu]'`, which installs on a machine without a GPU too), so that the program, its fusions, kernels
(cuDNN attention included) and buffers are the GPU's (a few kernels check the GPU they run on and compile only with
one: cuDNN attention over heads wider than 128, Mosaic GPU's grouped matmul); or, where the plugin is missing, N CPU
devices, whose program differs (XLA's attention for cuDNN's, other fusions) and whose figures the planner marks as
such."""
from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass

import jax
from jax.experimental import topologies

from mlm_jax.config import ConfigError
from mlm_jax.plan.hardware import Gpu


@dataclass(frozen=True)
class Target:
    """What a plan compiles for: `count` GPUs of kind `gpu` in nodes of `gpus_per_node`, or CPU devices with `cpu`;
    a process builds its devices once (`devices`), so that planning processes can each build their own."""

    gpu: Gpu
    count: int
    gpus_per_node: int = 8
    cpu: bool = False

    def devices(self) -> list:
        return _devices(self)


@functools.cache
def _devices(target: Target) -> list:
    return compile_devices(target.gpu, target.count, target.gpus_per_node, target.cpu)


def gpu_target_available() -> bool:
    """Whether a CUDA plugin is installed (`pip install -e '.[gpu]'`, with or without a GPU)."""
    spec = importlib.util.find_spec("jax_plugins")
    return spec is not None and any(
        importlib.util.find_spec(f"jax_plugins.{name}") is not None for name in ("xla_cuda13", "xla_cuda12"))


def compile_devices(gpu: Gpu, count: int, gpus_per_node: int, cpu: bool = False) -> list:
    """`count` devices to compile for: this process's GPUs of that kind if it has `count`, else `gpu`s in nodes of
    `gpus_per_node` (the CUDA plugin's deviceless target), or, with `cpu` or without the plugin, the first `count`
    CPU devices."""
    if not cpu and len(local := _local_gpus(gpu)) >= count:
        return local[:count]
    if not cpu and gpu_target_available():
        nodes = max(1, count // gpus_per_node)
        topology = f"1x{nodes}x{count // nodes}"
        return list(topologies.get_topology_desc(platform="cuda", topology=topology,
                                                 target_config=gpu.target_config()).devices)
    cpus = jax.devices("cpu")
    if len(cpus) < count:
        raise ConfigError(f"--gpus {count}: this process has {len(cpus)} CPU devices to compile for; run "
                          f"`python -m mlm_jax.plan`, which makes one per GPU, or install the CUDA plugin "
                          f"(pip install -e '.[gpu]') to compile for the GPUs themselves")
    return cpus[:count]


def _local_gpus(gpu: Gpu) -> list:
    """This process's GPUs of `gpu`'s kind (none where its backend is absent or not started)."""
    try:
        devices = jax.devices("gpu")
    except RuntimeError:
        return []
    return [d for d in devices if gpu.name.lower() in d.device_kind.lower()]
