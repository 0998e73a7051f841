"""XLA:CPU's per-call temporaries kept in the heap instead of fresh mappings (glibc's malloc, Linux).

XLA:CPU allocates a program's temporaries (one block, tens of MiB for a small model's train step) with malloc at
every call and frees them after it. glibc serves a block above its mmap threshold with a fresh mapping, whose pages
the kernel zero-fills on first touch: page faults at every call. glibc raises the threshold after freeing such a
block, but not always: a block freed by another thread's arena can stay mapped call after call. Seen on
``bench_grpo.py``'s train step with a shared prompt prefix (20 MiB of temporaries): about 9 ms of system time per
call, a step 1.6x slower (``bench/README.md``). Fixed thresholds (the largest glibc takes) keep such blocks in the
heap; the trim threshold keeps freed heap memory for the next call instead of returning and faulting it in again.

Applied once, to a process that runs a JAX program on CPU; a no-op where the C library has no ``mallopt``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

log = logging.getLogger("functrain")

# mallopt(3) parameters and the values set: glibc refuses an mmap threshold above 32 MiB on 64-bit machines.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 * 2**20
TRIM_THRESHOLD = 512 * 2**20


@functools.cache
def keep_temporaries_in_heap() -> bool:
    """Set glibc's mmap and trim thresholds (once per process); True when the C library took them."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        return False
    taken = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    log.debug("glibc malloc thresholds for XLA:CPU temporaries: %s", "set" if taken else "refused")
    return taken
