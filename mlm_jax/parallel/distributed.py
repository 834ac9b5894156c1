"""Multi-process start-up: `jax.distributed.initialize` from explicit flags or from a SLURM / Open MPI launch.

Must run before anything touches a jax backend. Explicit flags win; without them, a process that srun or mpirun
started as one of several tasks lets jax read its place from the environment (jax's own cluster detection: srun
one task per GPU, or pass `local_device_ids` to give a task more GPUs). The heartbeat timeout bounds how long
the others wait when a process dies: the coordination service notices the missing heartbeats and ends every
process, where a collective would otherwise wait for the dead peer forever.
"""
from __future__ import annotations

import os
import re
import socket
import sys
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

from mlm_jax.config import ConfigError

HEARTBEAT_TIMEOUT_S = 30  # jax's default is 100 s; heartbeats come from a background thread, so compiles
#                           and checkpoint writes do not delay them
_HOST_PORT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})")


def cluster_env() -> str | None:
    """'slurm' or 'ompi' when this process is one task of several started by srun or mpirun, else None."""
    if _int_env("SLURM_NTASKS") > 1 and "SLURM_STEP_NODELIST" in os.environ:
        return "slurm"
    if _int_env("OMPI_COMM_WORLD_SIZE") > 1:
        return "ompi"
    return None


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               local_device_ids: str | None = None, heartbeat_timeout_s: int | None = None) -> bool:
    """Joins the other processes; False (nothing done) for a single-process run.

    `coordinator`, `num_processes` and `process_id` come together or not at all; `local_device_ids` is a
    comma-separated list of the local GPU ids this process uses; `heartbeat_timeout_s` defaults to
    HEARTBEAT_TIMEOUT_S.
    """
    given = {"--coordinator": coordinator, "--num-processes": num_processes, "--process-id": process_id}
    missing = [flag for flag, v in given.items() if v is None]
    if 0 < len(missing) < 3:
        raise ConfigError(f"{', '.join(missing)} missing: --coordinator, --num-processes and --process-id go together")
    heartbeat_timeout_s = HEARTBEAT_TIMEOUT_S if heartbeat_timeout_s is None else heartbeat_timeout_s
    if heartbeat_timeout_s < 1:
        raise ConfigError(f"--heartbeat-timeout {heartbeat_timeout_s}: must be at least 1 second")
    if missing and cluster_env() is None:
        if local_device_ids is not None:
            raise ConfigError("--local-device-ids needs a multi-process launch (--coordinator ... or srun/mpirun)")
        return False
    if coordinator is not None:
        _check_flags(coordinator, num_processes, process_id)
    ids = _device_ids(local_device_ids) if local_device_ids is not None else None
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives across processes
    try:
        jax.distributed.initialize(coordinator, num_processes, process_id, local_device_ids=ids,
                                   heartbeat_timeout_seconds=heartbeat_timeout_s)
    except (RuntimeError, ValueError) as e:
        where = f"coordinator {coordinator}" if coordinator else f"{cluster_env()} environment"
        raise ConfigError(f"cannot join the other processes ({where}): {_first_line(e)}") from None
    return True


def shared_time() -> float:
    """Process 0's clock (seconds since the epoch), so every process names the same default output directory."""
    now = time.time()
    if jax.process_count() == 1:
        return now
    return float(multihost_utils.broadcast_one_to_all(np.int32(now)))


def any_process(flag: bool) -> bool:
    """Whether `flag` is set on any process; every process must call it (a small all-gather and a host sync)."""
    if jax.process_count() == 1:
        return flag
    return bool(multihost_utils.process_allgather(np.int32(flag)).any())


def each_process(value: float) -> np.ndarray:
    """`value` of every process, in process order; every process must call it (a small all-gather)."""
    if jax.process_count() == 1:
        return np.asarray([value], np.float64)
    return np.asarray(multihost_utils.process_allgather(np.float32(value))).reshape(-1).astype(np.float64)


def host_names() -> list[str]:
    """Each process's host name, in process order; every process must call it."""
    name = socket.gethostname().encode()[:64]
    if jax.process_count() == 1:
        return [name.decode()]
    padded = np.frombuffer(name.ljust(64, b"\0"), np.uint8)
    rows = np.asarray(multihost_utils.process_allgather(padded)).reshape(-1, 64)
    return [bytes(row).rstrip(b"\0").decode(errors="replace") for row in rows]


def leave(code: int) -> None:
    """Ends a failed process of a multi-process run at once, skipping jax's shutdown barrier (after a refused
    config, once every process has refused it, or 30 s).

    That barrier would wait, for minutes, for processes that are themselves stuck in a collective waiting on
    this one; gone, this process is noticed by the others within the heartbeat timeout.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    if code == 2:  # a refused config, which every process refuses: let all say so before the coordinator goes
        _meet("mlm_jax_config_refused", timeout_s=30)
    os._exit(code)


def _meet(name: str, timeout_s: int) -> None:
    """Waits (at most `timeout_s`) for every process at the coordination service's barrier `name`. The client is
    jax-internal (`jax._src.distributed`, in jax 0.10 and 0.11); without it, or on a timeout, this returns."""
    try:
        from jax._src import distributed as jax_distributed
        jax_distributed.global_state.client.wait_at_barrier(name, timeout_s * 1000)
    except Exception:  # noqa: BLE001  (a peer that never refuses, or another jax: leave anyway)
        pass


def _check_flags(coordinator: str, num_processes: int, process_id: int) -> None:
    match = _HOST_PORT.fullmatch(coordinator)
    if not match or not 0 < int(match[2]) < 65536:
        raise ConfigError(f"--coordinator {coordinator}: expected HOST:PORT with a port in 1..65535")
    if num_processes < 1:
        raise ConfigError(f"--num-processes {num_processes}: must be at least 1")
    if not 0 <= process_id < num_processes:
        raise ConfigError(f"--process-id {process_id} is out of range for --num-processes {num_processes} "
                          f"(0..{num_processes - 1})")


def _device_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",")]
    except ValueError:
        ids = []
    if not ids or min(ids) < 0 or len(set(ids)) != len(ids):
        raise ConfigError(f"--local-device-ids {text}: expected distinct device numbers such as 0,1,2,3")
    return ids


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__


def _int_env(name: str) -> int:
    try:
        return int(os.environ.get(name, "0"))
    except ValueError:
        return 0
