"""Multi-process JAX: joining a job from the environment, and collectives over its processes.

``initialize_from_env()`` runs at the start of every command, before any JAX computation:

- ``FUNCTRAIN_COORDINATOR`` / ``FUNCTRAIN_NUM_PROCESSES`` / ``FUNCTRAIN_PROCESS_ID`` (set by
  :func:`launch_local`): gloo CPU collectives and ``jax.distributed.initialize(address, n, id)``;
- a Slurm job with several tasks, or a multi-host Cloud TPU slice: ``jax.distributed.initialize()``,
  which reads the cluster's own environment;
- otherwise a single process, nothing to do.

The local launcher that sets those variables is :mod:`functrain.parallel.launcher`.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.experimental import multihost_utils

from functrain.errors import ConfigError
from functrain.parallel.launcher import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID

_initialized = False


def _cluster_detected() -> bool:
    """True inside a multi-task Slurm job or on one host of a multi-host Cloud TPU slice."""
    if int(os.environ.get("SLURM_NTASKS", "1") or 1) > 1:
        return True
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    return len([host for host in hosts.split(",") if host.strip()]) > 1


def initialize_from_env() -> bool:
    """Join a multi-process job described by the environment; True when this is one.

    Safe to call more than once. Must run before any JAX computation (device queries included).
    """
    global _initialized
    if _initialized:
        return True
    coordinator = os.environ.get(ENV_COORDINATOR)
    if coordinator:
        try:
            num_processes = int(os.environ[ENV_NUM_PROCESSES])
            process_id = int(os.environ[ENV_PROCESS_ID])
        except (KeyError, ValueError):
            raise ConfigError(
                f"{ENV_COORDINATOR} is set, so {ENV_NUM_PROCESSES} and {ENV_PROCESS_ID} must be "
                f"integers too; set them or unset {ENV_COORDINATOR}"
            ) from None
        # CPU devices of different processes talk through gloo (the local launcher is a CPU stand-in
        # for a multi-host job); on GPU/TPU the backend's own collectives are used regardless.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator, num_processes, process_id)
    elif _cluster_detected():
        jax.distributed.initialize()
    else:
        return False
    _initialized = True
    return True


def is_primary() -> bool:
    """True in process 0, the one that writes logs and metrics."""
    return jax.process_index() == 0


# Agreement between processes: decisions that lead into collectives (a save, a restore, a stop) must be the
# same on every process, so each is taken from one collective rather than from each process's own view.


def any_process(flags: list[bool]) -> list[bool]:
    """Each flag OR-ed over all processes (one all-gather; no collective with one process)."""
    votes = all_rows(np.asarray(flags, np.int32)[None])  # [processes, flags]
    return [bool(vote) for vote in votes.max(axis=0)]  # max of 0/1: OR


def all_rows(local: np.ndarray) -> np.ndarray:
    """Every process's ``local`` rows (each process the same number), in process order: the whole batch's, which
    each process's data slice is a block of (one all-gather; ``local`` itself with one process)."""
    if jax.process_count() == 1:
        return local
    gathered = np.asarray(multihost_utils.process_allgather(np.asarray(local)))
    return gathered.reshape(-1, *np.shape(local)[1:])


def every_process(flag: bool) -> bool:
    """True when ``flag`` holds on every process."""
    return not any_process([not flag])[0]


def primary_view(flag: bool) -> bool:
    """Process 0's ``flag``, on every process (e.g. what it sees in a directory listing that can race a
    rename)."""
    if jax.process_count() == 1:
        return flag
    return bool(multihost_utils.broadcast_one_to_all(np.int32(flag)))
