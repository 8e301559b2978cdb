"""Background prefetch of device batches."""

from __future__ import annotations

import inspect
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

_END = object()


class Prefetcher:
    """Runs ``produce()`` on a background thread, keeping ``buffer_size`` results ready.

    ``produce`` raising StopIteration ends the stream; any other exception is re-raised
    in the consumer by :meth:`get`. Used to overlap reading and the host-to-device copy
    of the next batch with the current step.

    A bound method is held weakly: when its object (the input iterator) is dropped, the
    thread ends instead of keeping it, and a device batch, alive.
    """

    def __init__(self, produce: Callable[[], Any], buffer_size: int):
        ref = weakref.WeakMethod(produce) if inspect.ismethod(produce) else None
        self._produce_ref: Callable[[], Callable[[], Any] | None] = ref or (lambda: produce)
        self._queue: queue.Queue = queue.Queue(maxsize=buffer_size)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._run, name="jreplicate-prefetch",
                                        daemon=True)
        self._thread.start()

    def _alive(self) -> bool:
        return not self._stop.is_set() and self._produce_ref() is not None

    def _put(self, item: Any) -> bool:
        while self._alive():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        while not self._stop.is_set():
            produce = self._produce_ref()
            if produce is None:  # the consumer is gone
                return
            try:
                item = produce()
            except StopIteration:
                self._put((_END, None))
                return
            except BaseException as e:  # re-raised in the consumer
                self._put((_END, e))
                return
            finally:
                del produce
            if not self._put((item, None)):
                return

    def get(self) -> Any:
        """The next result; raises StopIteration at the end."""
        if self._stop.is_set():  # closed: no thread will ever fill the queue again
            raise RuntimeError(
                "this input iterator was closed (Replicator.finalize() or "
                "InputIterator.close()); call its reinitialize() to read from the start "
                "again, or prepare_input for a new one."
            )
        if self._done:
            raise StopIteration
        item, err = self._queue.get()
        if item is _END:
            self._done = True
            if err is not None:
                raise err
            raise StopIteration
        return item

    def close(self, *, wait: bool = False) -> None:
        """Stops the background thread and drops buffered results.

        Args:
          wait: wait for a read in progress to finish, however long it takes (needed
            before the source is restarted); otherwise give it 10 seconds.
        """
        self._stop.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=None if wait else 10)
