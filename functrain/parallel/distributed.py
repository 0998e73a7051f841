"""Multi-process JAX: joining a job from the environment, and a local launcher for N CPU processes.

``initialize_from_env()`` runs at the start of every command, before any JAX computation:

- ``FUNCTRAIN_COORDINATOR`` / ``FUNCTRAIN_NUM_PROCESSES`` / ``FUNCTRAIN_PROCESS_ID`` (set by
  :func:`launch_local`): gloo CPU collectives and ``jax.distributed.initialize(address, n, id)``;
- a Slurm job with several tasks, or a multi-host Cloud TPU slice: ``jax.distributed.initialize()``,
  which reads the cluster's own environment;
- otherwise a single process, nothing to do.

``launch_local(argv, processes, port)`` is what ``functrain train CONFIG --processes N`` runs: N copies of
``python -m functrain ARGV`` on this machine, wired to one coordinator, as a stand-in for a multi-host job.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from functrain.errors import PLANNED_EXITS, ConfigError
from functrain.parallel.launch_flags import without_flags

ENV_COORDINATOR = "FUNCTRAIN_COORDINATOR"
ENV_NUM_PROCESSES = "FUNCTRAIN_NUM_PROCESSES"
ENV_PROCESS_ID = "FUNCTRAIN_PROCESS_ID"

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


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _check_port(port: int) -> None:
    """Raise a one-line ConfigError when ``port`` cannot be bound on this machine."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            raise ConfigError(
                f"port {port} for the process coordinator is in use; choose another port "
                f"(e.g. {_free_port()}) or leave it unset to pick a free one"
            ) from None


def strip_processes_flag(argv: list[str]) -> list[str]:
    """``argv`` without ``--processes N`` / ``--processes=N`` / ``--port P`` (the launcher's own flags)."""
    return without_flags(argv, ("--processes", "--port"))


def _tail(path: Path, lines: int = 20) -> str:
    text = path.read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:])


def _stop(procs: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    """Terminate the processes still running; kill what has not exited after ``grace_s``."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def launch_local(argv: list[str], processes: int, port: int | None = None) -> int:
    """Run ``python -m functrain ARGV`` as ``processes`` cooperating processes on this machine.

    Process 0's output goes to this terminal; the others' to temporary files, whose tail is printed if
    one of them fails. When a process fails, the others are stopped. Returns the worst exit code of the
    processes that ended on their own (0 when all succeeded).
    """
    if processes < 1:
        raise ConfigError(f"--processes={processes}: need at least 1 process")
    argv = strip_processes_flag(list(argv))
    if port is None:
        port = _free_port()
    else:
        _check_port(port)
    procs: list[subprocess.Popen] = []
    logs: list[Path | None] = []

    def forward(signum: int, frame: object) -> None:
        # A preemption notice for the launcher is one for the job: every process saves and exits.
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    previous_handler = signal.signal(signal.SIGTERM, forward)
    with tempfile.TemporaryDirectory(prefix="functrain-procs-") as log_dir:
        try:
            for process_id in range(processes):
                env = dict(os.environ)
                env.update(
                    {
                        ENV_COORDINATOR: f"127.0.0.1:{port}",
                        ENV_NUM_PROCESSES: str(processes),
                        ENV_PROCESS_ID: str(process_id),
                    }
                )
                command = [sys.executable, "-m", "functrain", *argv]
                if process_id == 0:
                    procs.append(subprocess.Popen(command, env=env))
                    logs.append(None)
                else:
                    log = Path(log_dir) / f"process_{process_id}.log"
                    with open(log, "wb") as out:
                        procs.append(subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT))
                    logs.append(log)
            return supervise(procs, logs)
        finally:
            signal.signal(signal.SIGTERM, previous_handler)
            _stop(procs)


def supervise(procs: list[subprocess.Popen], logs: list[Path | None]) -> int:
    """Wait for every process; on the first failure stop the rest and print the failing one's output.

    ``logs[i]`` is the file holding process ``i``'s output, or None when it writes to this terminal.
    Returns the worst exit code of the processes that ended on their own (a signal ``s`` counts as 128+s).
    """
    finished: dict[int, int] = {}
    while len(finished) < len(procs):
        for index, proc in enumerate(procs):
            code = proc.poll()
            if code is None or index in finished:
                continue
            finished[index] = code
            if code not in PLANNED_EXITS:  # a crash: the others would wait for it in a collective
                log_path = logs[index]
                if log_path is not None:
                    print(
                        f"--- process {index} exited with status {code}; its last output:\n{_tail(log_path)}",
                        file=sys.stderr,
                    )
                _stop(procs)
                # Processes stopped by us report the signal, not a problem of their own.
                for other, other_proc in enumerate(procs):
                    finished.setdefault(
                        other,
                        0 if other_proc.returncode in (-signal.SIGTERM, -signal.SIGKILL) else other_proc.returncode,
                    )
                break
        time.sleep(0.1)
    codes = [code if code >= 0 else 128 - code for code in finished.values()]
    return max(codes)
