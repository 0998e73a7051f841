"""The persistent compilation cache (``run.compile_cache``) and what compiling costs a run.

A restart of an unchanged run loads its compiled steps from disk instead of compiling them again: JAX's
persistent cache, on by default in a directory per host under the user's cache directory
(``$XDG_CACHE_HOME/functrain/xla/<host>``, shared by every run and restart on that host; per host because a
home directory shared over NFS would otherwise mix the executables of different machines). A cache directory set
for JAX already (``JAX_COMPILATION_CACHE_DIR``) is kept as it is; ``run.compile_cache: null`` leaves JAX's own
settings alone (no cache unless they set one).

:func:`compile_counts` is the process's running total of compile time and cache hits, from JAX's monitoring
events: the goodput report's compile time and the "cache hit" line come from it.
"""

from __future__ import annotations

import logging
import os
import socket
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

from functrain.callbacks.base import Callback
from functrain.callbacks.view import RunView

log = logging.getLogger("functrain")

DEFAULT = "auto"  # run.compile_cache's default: the per-host directory under the user's cache directory

# JAX's duration events of one compilation: tracing, lowering, and the backend's compile (or cache load).
_COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_CACHE_LOOKUP = "/jax/compilation_cache/compile_requests_use_cache"


@dataclass
class CompileCounts:
    """Compilation in this process so far: seconds spent (tracing, lowering, compiling or loading from the
    cache), executables asked of the persistent cache and found there."""

    seconds: float = 0.0
    cache_lookups: int = 0
    cache_hits: int = 0


_counts = CompileCounts()
_listening = False


def _on_duration(event: str, duration_secs: float, **_: str | int) -> None:
    if event in _COMPILE_EVENTS:
        _counts.seconds += duration_secs


def _on_event(event: str, **_: str | int) -> None:
    if event == _CACHE_HIT:
        _counts.cache_hits += 1
    elif event == _CACHE_LOOKUP:
        _counts.cache_lookups += 1


def compile_counts() -> CompileCounts:
    """A copy of this process's compile totals (counted from the first call on: call it before compiling)."""
    global _listening
    if not _listening:
        import jax

        jax.monitoring.register_event_duration_secs_listener(_on_duration)
        jax.monitoring.register_event_listener(_on_event)
        _listening = True
    return replace(_counts)


def compile_seconds() -> float:
    """Seconds this process has spent compiling so far (see :func:`compile_counts`)."""
    return compile_counts().seconds


def default_directory() -> Path:
    """This host's cache directory under the user's cache directory."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "functrain" / "xla" / socket.gethostname()


def enable(setting: str | None) -> Path | None:
    """Point JAX's persistent compilation cache where ``run.compile_cache`` says (before the first compile);
    returns the directory in use, or None when there is none. A directory that cannot be created is a
    one-line warning: the run compiles as if there were no cache."""
    import jax

    compile_counts()  # count from here on
    # A cache entry that cannot be written (a full disk) costs a compile on the next start, nothing more; JAX's
    # warning about it would read as the run's failure beside the one line the run's own error gets.
    warnings.filterwarnings("ignore", message="Error writing persistent compilation cache entry")
    configured = jax.config.values["jax_compilation_cache_dir"]
    if setting is None or (setting == DEFAULT and configured):
        return Path(configured) if configured and jax.config.values["jax_enable_compilation_cache"] else None
    path = default_directory() if setting == DEFAULT else Path(setting).expanduser().absolute()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        log.warning("functrain: warning: run.compile_cache %s cannot be created (%s); compiling without it", path, exc)
        return None
    if str(path) != configured:
        from jax.experimental.compilation_cache import compilation_cache

        jax.config.update("jax_compilation_cache_dir", str(path))
        compilation_cache.reset_cache()  # the cache object reads the directory once, when first used
    return path


class CompileReport(Callback):
    """Logs, after the first call, whether the train step was compiled or loaded from the cache (process 0)."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        self.before: CompileCounts | None = None

    def on_train_begin(self, view: RunView) -> None:
        self.before = compile_counts()

    def on_step_end(self, view: RunView) -> None:
        if self.before is None:
            return
        before, after, self.before = self.before, compile_counts(), None
        if not view.is_primary:
            return
        seconds, hits = after.seconds - before.seconds, after.cache_hits - before.cache_hits
        if self.directory is None:
            log.info("train step compiled in %.1fs (no compilation cache: run.compile_cache is null)", seconds)
        elif hits and hits == after.cache_lookups - before.cache_lookups:
            log.info("train step: compilation cache hit in %s (%.1fs)", self.directory, seconds)
        else:
            log.info("train step compiled in %.1fs; compilation cache: %s", seconds, self.directory)
