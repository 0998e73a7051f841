"""One job per run directory: ``RUN_DIR/run.lock`` names the owner and carries a heartbeat.

Two jobs writing one run directory duplicate every metrics line and move each other's checkpoints aside, so
``train`` takes the lock before it touches anything and a second ``train`` exits with one line naming the
owner. The lock is a JSON file created with ``O_EXCL`` (host, pid, process start time, start and heartbeat
times); a daemon thread refreshes the heartbeat. A lock is stale, and is taken over with a warning, when its
process is gone (same host: the pid no longer runs, or runs a different program started later) or its heartbeat
is older than ``STALE_AFTER_S`` (another host, which we cannot ask). Readers (``inspect``, ``plot``, export)
never take it. In a multi-process job only process 0 takes it, for the whole job.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import psutil

from functrain.core.backend import Backend
from functrain.errors import ConfigError
from functrain.guards.signals import forget_on_hard_exit, release_on_hard_exit

log = logging.getLogger("functrain")

LOCK_NAME = "run.lock"
HEARTBEAT_EVERY_S = 15.0
# A remote owner's heartbeat this old means its job is gone: long enough for a host that is swapping or
# writing a large checkpoint, short enough that a preempted job's successor is not kept waiting long.
STALE_AFTER_S = 120.0


def _process_start_time(pid: int) -> float | None:
    """When process ``pid`` started, or None when no such process runs."""
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    except psutil.AccessDenied:  # it runs, under another user
        return -1.0


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # half-written or foreign: judged by its age alone


def stale_reason(owner: dict[str, Any], path: Path, now: float | None = None) -> str | None:
    """Why the lock held by ``owner`` is stale, or None while its job may still be running."""
    now = time.time() if now is None else now
    if owner.get("host") == socket.gethostname() and isinstance(owner.get("pid"), int):
        started = _process_start_time(owner["pid"])
        if started is None:
            return f"process {owner['pid']} is gone"
        recorded = owner.get("process_start")
        if started > 0 and isinstance(recorded, (int, float)) and abs(started - recorded) > 1.0:
            return f"pid {owner['pid']} now belongs to another process"
        return None
    heartbeat = owner.get("heartbeat")
    if not isinstance(heartbeat, (int, float)):
        try:
            heartbeat = path.stat().st_mtime
        except FileNotFoundError:
            return "it was released"
    age = now - heartbeat
    return f"its heartbeat is {age:.0f} s old" if age > STALE_AFTER_S else None


def describe_owner(owner: dict[str, Any]) -> str:
    """``pid 123 on host h, started 2026-11-22 10:00:00 UTC`` (whatever the lock file tells)."""
    started = owner.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started)) if isinstance(started, (int, float)) else "?"
    return f"pid {owner.get('pid', '?')} on host {owner.get('host', '?')}, started {when}"


class RunLock:
    """Exclusive ownership of a run directory for one job (a context manager).

    ``acquire`` raises :class:`~functrain.errors.ConfigError` with one line naming the owner when another live
    job holds the directory; ``release`` removes the lock only if it is still ours.
    """

    def __init__(self, run_dir: str | os.PathLike, heartbeat_every_s: float = HEARTBEAT_EVERY_S) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self.heartbeat_every_s = heartbeat_every_s
        self.token = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.held = False

    def _record(self) -> dict[str, Any]:
        now = time.time()
        return {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "process_start": psutil.Process().create_time(),
            "started": now,
            "heartbeat": now,
            "token": self.token,
        }

    def _create(self, record: dict[str, Any]) -> bool:
        """Create the lock file exclusively; False when it already exists."""
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as handle:
            json.dump(record, handle)
        return True

    def acquire(self) -> RunLock:
        """Take the lock (taking over a stale one with a warning) and start the heartbeat."""
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(
                f"cannot create run.dir {str(self.run_dir)!r} ({exc.strerror}); choose another run.dir"
            ) from None
        self.record = self._record()
        for _ in range(3):  # a takeover can race another job's; retry a couple of times
            try:
                if self._create(self.record):
                    break
            except OSError as exc:
                raise ConfigError(
                    f"cannot write in run.dir {str(self.run_dir)!r} ({exc.strerror}); fix its "
                    f"permissions or choose another run.dir"
                ) from None
            owner = _read(self.path)
            if owner is None:
                continue  # released between our attempt and the read
            reason = stale_reason(owner, self.path)
            if reason is None:
                raise ConfigError(
                    f"run directory {self.run_dir} is in use by another job ({describe_owner(owner)}); "
                    f"wait for it to finish, stop it, or choose another run.dir"
                )
            # Move the stale lock aside under a unique name: of two jobs taking over at once, one rename wins.
            aside = self.path.with_name(f".{LOCK_NAME}.stale-{self.token}")
            try:
                self.path.rename(aside)
            except FileNotFoundError:
                continue
            aside.unlink(missing_ok=True)
            log.warning("functrain: took over the lock of %s from %s (%s)", self.run_dir, describe_owner(owner), reason)
        else:
            raise ConfigError(
                f"could not take the lock {self.path} (other jobs keep taking it); "
                f"make sure one job at a time uses run.dir {self.run_dir}"
            )
        self.held = True
        release_on_hard_exit(self.release)  # a process ended from its stop-signal watcher leaves no lock behind
        self._thread = threading.Thread(target=self._beat, name="functrain-run-lock", daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_every_s):
            owner = _read(self.path)
            if not owner or owner.get("token") != self.token:
                log.warning(
                    "functrain: the lock of %s was taken by another job; this job no longer owns it", self.run_dir
                )
                return
            tmp = self.path.with_name(f".{LOCK_NAME}.{self.token}")
            try:
                tmp.write_text(json.dumps({**self.record, "heartbeat": time.time()}))
                tmp.replace(self.path)
            except OSError:
                tmp.unlink(missing_ok=True)  # a full disk: the next beat tries again

    def release(self) -> None:
        """Stop the heartbeat and remove the lock if it is still ours."""
        forget_on_hard_exit(self.release)
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.held:
            owner = _read(self.path)
            if owner and owner.get("token") == self.token:
                self.path.unlink(missing_ok=True)
        self.held = False

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc_info: Any) -> None:
        self.release()


@contextlib.contextmanager
def held_for_the_job(run_dir: Path, backend: Backend) -> Iterator[None]:
    """Hold the run directory's lock (process 0, for the whole job) inside the block; when process 0 cannot take
    it, every process of the job raises, so none goes on alone."""
    lock, failure = RunLock(run_dir) if backend.process_index == 0 else None, None
    if lock is not None:
        try:
            lock.acquire()
        except ConfigError as exc:
            failure = exc
    try:
        if backend.process_count > 1 and backend.any_process([failure is not None])[0] and failure is None:
            raise ConfigError(f"process 0 could not take the lock of run directory {run_dir}; see its message")
        if failure is not None:
            raise failure
        yield
    finally:
        if lock is not None:
            lock.release()
