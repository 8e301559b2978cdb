"""Background threads of the input pipeline: prefetch of device batches, parallel readers.

Every thread here is a daemon thread that ends promptly once it is told to stop, and
an exit hook stops them all (bounded) before the interpreter and JAX are torn down: a
thread still inside a JAX call when the process exits aborts it ("terminate called
after throwing an instance of ..."), and a non-daemon thread stalled in a slow reader
would hold up the exit (e.g. after Ctrl-C) for as long as the read takes.
"""

from __future__ import annotations

import inspect
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from jreplicate.input import shutdown
from jreplicate.input.shutdown import InputClosedError

_END = object()
END = _END  # the end-of-stream marker of drain()
ERROR = object()  # drain()'s marker of an error the stream went on after
# Seconds the exit hook waits, in all, for prefetch threads to leave a call in progress.
EXIT_JOIN_TIMEOUT = 5.0
_POLL = 0.05  # seconds between checks for a stop request while waiting

_live: weakref.WeakSet[Prefetcher] = weakref.WeakSet()


def stop_all(timeout: float = EXIT_JOIN_TIMEOUT) -> list[threading.Thread]:
    """Stops every live :class:`Prefetcher` and waits, ``timeout`` s in all, until each
    thread has ended or is inside a read from a user's source.

    Runs at interpreter exit, before the ``atexit`` handlers (JAX's among them) and before
    the runtime is torn down: a thread inside a JAX call then would abort the process.
    A thread inside a source's read runs user code, not JAX, and is not waited for (a
    stalled reader would hold up Ctrl-C): the read, once it returns, raises
    :class:`InputClosedError` (see :mod:`jreplicate.input.shutdown`), so
    the thread never goes on into JAX. Returns the threads neither ended nor reading
    after ``timeout``.
    """
    shutdown.begin_exit()  # before the readers are looked at: see Pipeline.next
    prefetchers = list(_live)
    for p in prefetchers:
        p._stop.set()
    deadline = time.monotonic() + timeout

    def busy(p: Prefetcher) -> bool:
        return p._thread.is_alive() and p._thread.ident not in shutdown.threads_reading()

    for p in prefetchers:
        while busy(p) and time.monotonic() < deadline:
            p._thread.join(timeout=min(_POLL, max(0.0, deadline - time.monotonic())))
    return [p._thread for p in prefetchers if busy(p)]


def _register_exit_hook() -> None:
    # threading's exit hooks run first at interpreter exit, before atexit handlers.
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is None:
            raise AttributeError
        register(stop_all)
    except (AttributeError, RuntimeError):
        import atexit
        atexit.register(stop_all)


_register_exit_hook()


class Prefetcher:
    """Runs ``produce()`` on a background thread, keeping ``buffer_size`` results ready.

    ``produce`` raising StopIteration ends the stream (:meth:`get` raises that
    StopIteration, so a subclass can carry what the end brings). Any other
    ``Exception`` is raised by one :meth:`get`, in its place in the stream, and the
    thread reads on, as a caller reading in line after the error would; a
    ``BaseException`` (``SystemExit``) is raised by :meth:`get` and ends the stream. Used
    to overlap reading and the host-to-device copy of the next batch with the current
    step.

    A bound method is held weakly: when its object (the input iterator) is dropped, the
    thread ends instead of keeping it, and a device batch, alive. At interpreter exit
    every live prefetcher is stopped and its thread joined (see :func:`stop_all`).
    """

    def __init__(self, produce: Callable[[], Any], buffer_size: int):
        ref = weakref.WeakMethod(produce) if inspect.ismethod(produce) else None
        self._produce_ref: Callable[[], Callable[[], Any] | None] = ref or (lambda: produce)
        self._queue: queue.Queue = queue.Queue(maxsize=buffer_size)
        self._stop = threading.Event()
        self._done = False
        self._orphan: Any = None  # a result made while stopping, kept for drain()
        self._thread = threading.Thread(target=self._run, name="jreplicate-prefetch",
                                        daemon=True)
        _live.add(self)
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
        self._orphan = item
        return False

    def _run(self) -> None:
        while not self._stop.is_set():
            produce = self._produce_ref()
            if produce is None:  # the consumer is gone
                return
            try:
                item = (produce(), None)
            except StopIteration as e:
                self._put((_END, e))
                return
            except Exception as e:  # raised in the consumer, in its place; reading goes on
                item = (ERROR, e)
            except BaseException as e:  # raised in the consumer; the stream ends
                self._put((_END, e))
                return
            finally:
                del produce
            if not self._put(item):
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
            raise err
        if item is ERROR:
            raise err
        return item

    def drain(self) -> list[tuple[Any, BaseException | None]]:
        """Stops the thread once the read in progress is done and returns, in order, the
        results not yet taken: ``(result, None)``, ``(ERROR, exception)`` for an error
        the stream went on after, or ``(END, StopIteration or exception)`` for the end of
        the stream. Nothing read is lost."""
        self._stop.set()
        self._thread.join()
        items = []
        while True:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                break
        if self._orphan is not None:
            items.append(self._orphan)
            self._orphan = None
        _live.discard(self)
        return items

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
        _live.discard(self)


class ReaderPool:
    """Daemon threads that read several pipelines at once (one element each per call).

    Unlike a ``concurrent.futures.ThreadPoolExecutor``, whose threads the interpreter
    joins at exit, a reader stalled in a slow source never holds up the exit, and a
    wait for results gives up as soon as the pool is closed or the process exits.

    Args:
      num_threads: the number of reader threads.
    """

    def __init__(self, num_threads: int):
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = threading.Event()
        for i in range(num_threads):
            threading.Thread(target=_reader, args=(self._tasks,), daemon=True,
                             name=f"jreplicate-input-{i}").start()
        # The threads hold the task queue only: a dropped pool (its iterator dropped
        # without close()) still ends them.
        self._end_threads = weakref.finalize(self, _end_readers, self._tasks, num_threads)

    def map(self, fn: Callable[[int], Any], n: int) -> list[tuple[Any, BaseException | None]]:
        """``[(fn(k), None) or (None, exception) for k in range(n)]``, read concurrently.

        Raises:
          InputClosedError: the pool was closed, or the process started to exit, before
            every result arrived (the reads still running are abandoned).
        """
        results: list[Any] = [None] * n
        done = threading.Semaphore(0)
        for k in range(n):
            self._tasks.put((fn, k, results, done))
        for _ in range(n):
            while not done.acquire(timeout=_POLL):
                if self._closed.is_set() or shutdown.exiting():
                    raise InputClosedError(
                        "this input iterator was closed (Replicator.finalize(), "
                        "InputIterator.close() or the process exiting) while reading; "
                        "call its reinitialize() to read from the start again."
                    )
        return results

    def close(self) -> None:
        """Ends the threads once their reads in progress return; abandons waits now."""
        self._closed.set()
        self._end_threads()


def _end_readers(tasks: queue.SimpleQueue, num_threads: int) -> None:
    for _ in range(num_threads):
        tasks.put(None)


def _reader(tasks: queue.SimpleQueue) -> None:
    while True:
        task = tasks.get()
        if task is None:
            return
        fn, k, results, done = task
        del task  # hold nothing of the iterator while idle
        try:
            results[k] = (fn(k), None)
        except BaseException as e:  # handed to the waiting reader
            results[k] = (None, e)
        del fn, results
        done.release()
