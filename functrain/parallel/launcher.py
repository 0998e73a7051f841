"""``functrain train CONFIG --processes N``: N copies of ``python -m functrain ARGV`` on this machine, wired to one
coordinator through the environment (read by :func:`functrain.parallel.distributed.initialize_from_env`), as a
stand-in for a multi-host job.

Without JAX: the launcher only starts and watches its processes, and importing JAX would add a second to its start
(and to the job's).
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

from functrain.errors import PLANNED_EXITS, ConfigError
from functrain.parallel.launch_flags import without_flags

ENV_COORDINATOR = "FUNCTRAIN_COORDINATOR"
ENV_NUM_PROCESSES = "FUNCTRAIN_NUM_PROCESSES"
ENV_PROCESS_ID = "FUNCTRAIN_PROCESS_ID"


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
