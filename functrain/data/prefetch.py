"""Run an iterator a few items ahead in a background thread, so host-side batch assembly overlaps the step.

Reading records, gathering and augmenting are mostly numpy and I/O, which release the GIL, so one thread
hides them behind a jitted step that runs longer than the assembly.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")

_DONE = object()


class _Failure:
    """An exception raised in the producer, carried to the consumer."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class BackgroundIterator(Generic[T]):
    """Iterate ``source`` in a daemon thread, at most ``depth`` items ahead of the consumer.

    Items arrive in the source's order; an exception in the source is raised by the consumer's ``next``.
    ``close()`` (or leaving a ``with`` block) stops the thread and waits for it, so none is left behind.
    """

    def __init__(self, source: Iterator[T], depth: int) -> None:
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        self._source = source
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._finished = False
        self._thread = threading.Thread(target=self._produce, name="functrain-prefetch", daemon=True)
        self._thread.start()

    def _put(self, item: object) -> bool:
        # Poll so a close() while the queue is full still ends the thread.
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self) -> None:
        try:
            for item in self._source:
                if not self._put(item):
                    return
            self._put(_DONE)
        except BaseException as error:  # noqa: BLE001 -- handed to the consumer, which re-raises it
            self._put(_Failure(error))

    def __iter__(self) -> BackgroundIterator[T]:
        return self

    def __next__(self) -> T:
        if self._finished:
            raise StopIteration
        item = self._queue.get()
        if item is _DONE:
            self._finished = True
            raise StopIteration
        if isinstance(item, _Failure):
            self._finished = True
            raise item.error
        return item

    def close(self, timeout: float = 10.0) -> None:
        """Stop the producer and join its thread (it finishes the item it is building first)."""
        self._stop.set()
        self._finished = True
        while True:  # unblock a producer waiting on a full queue
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout)
        close_source = getattr(self._source, "close", None)
        if close_source is not None and not self._thread.is_alive():
            close_source()

    @property
    def alive(self) -> bool:
        """Whether the background thread is still running."""
        return self._thread.is_alive()

    def __enter__(self) -> BackgroundIterator[T]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        if hasattr(self, "_thread"):  # __init__ may have failed before the thread existed
            self.close(timeout=0.0)
