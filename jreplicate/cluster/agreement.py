"""Agreement through the coordination service's key-value store.

The key-value store of ``jax.distributed``'s coordination service carries the small
messages processes exchange so that they all take the same decision (the input of a
step, whether a checkpoint exists): :class:`Agreement` all-gathers them, and
:func:`decode_message` checks each against the caller's schema (JSON; nothing is
unpickled).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from jreplicate import _jax_compat, _wire
from jreplicate.cluster.spec import ClusterError, MessageError

_log = logging.getLogger("jreplicate")


def decode_message[T](raw: bytes, sender: int, what: str, check: Callable[[Any], T]) -> T:
    """Process ``sender``'s agreement message: JSON, checked by ``check``.

    ``check`` takes the parsed JSON and returns the typed value, or raises
    ``ValueError`` / ``TypeError`` saying what is wrong. Nothing is unpickled.

    Raises:
      MessageError: ``raw`` is not UTF-8 JSON or ``check`` rejects it; the message names
        the sender and what was being agreed on.
    """
    try:
        return check(json.loads(raw.decode("utf-8")))
    except (ValueError, TypeError, RecursionError) as e:  # JSONDecodeError, Unicode...
        raise MessageError(
            f"jreplicate: process {sender} sent a malformed message while agreeing on "
            f"{what}: {str(e)[:300]} (got {bytes(raw[:120])!r}"
            f"{'...' if len(raw) > 120 else ''}). Every process must run the same program "
            "with the same jreplicate version, and nothing else may write to the job's "
            "coordination service."
        ) from None


class Agreement:
    """All-gathers small messages between the processes, through the coordinator.

    Each call is numbered; process ``p`` publishes ``<prefix>/<n>/<p>`` and reads the
    others' values for the same ``n``, so every process receives the same list, in
    process order, and can take the same decision. Waits are bounded by ``timeout``.
    :meth:`exchange` carries JSON checked against the caller's schema: nothing read
    from the key-value store is unpickled.
    """

    def __init__(self, prefix: str, num_processes: int, process_id: int, timeout: float):
        self._prefix = prefix
        self._n = num_processes
        self._pid = process_id
        self._timeout_ms = max(1, int(timeout * 1000))
        self._timeout = timeout
        self._count = 0
        # Messages already checked (each step's input report is usually the last one's).
        self._checked: dict[tuple[Callable, bytes], Any] = {}

    @property
    def prefix(self) -> str:
        """The channel's key-value prefix, the same on every process (unique per channel)."""
        return self._prefix

    def all_gather(self, value: bytes, what: str) -> list[bytes]:
        """Publishes ``value`` and returns every process's value, in process order.

        Args:
          value: this process's bytes.
          what: what is being agreed on, for error messages ("the input of step 3").

        Raises:
          ClusterError: a process did not publish within the timeout (dead or stuck).
        """
        if self._n == 1:
            return [value]
        n, self._count = self._count, self._count + 1
        client = _jax_compat.distributed_client()
        key = f"{self._prefix}/{n}"
        client.key_value_set_bytes(f"{key}/{self._pid}", value)
        out = []
        for p in range(self._n):
            if p == self._pid:
                out.append(value)
                continue
            try:
                out.append(client.blocking_key_value_get_bytes(f"{key}/{p}", self._timeout_ms))
            except Exception as e:  # jax raises its own runtime error type
                raise ClusterError(
                    f"jreplicate: process {self._pid} waited for process {p} to agree on "
                    f"{what}, but it did not arrive within collective_timeout="
                    f"{self._timeout:g}s: it died, hangs, or is slower than the timeout "
                    f"allows. ({type(e).__name__}: {str(e).splitlines()[0][:300]})"
                ) from None
        if n > 0:  # everyone has read round n - 1 once they published round n
            try:
                client.key_value_delete(f"{self._prefix}/{n - 1}/{self._pid}")
            except Exception:  # noqa: BLE001 - best-effort cleanup
                _log.debug("agreement: best-effort cleanup", exc_info=True)
        return out

    def exchange[T](self, message: Any, what: str, check: Callable[[Any], T]) -> list[T]:
        """Publishes ``message`` (JSON-serialisable) and returns every process's message
        in process order, each parsed and checked by ``check`` (see
        :func:`decode_message`); this process's own goes through the same check. A
        message equal to one checked before is not parsed again: the values returned
        are shared, do not modify them.

        Raises:
          MessageError: a process's message is malformed (every process raises it).
          ClusterError: a process did not publish within the timeout.
        """
        data = _wire.dumps(message)
        out = []
        for p, raw in enumerate(self.all_gather(data, what)):
            key = (check, bytes(raw))
            if key not in self._checked:
                if len(self._checked) >= 64:
                    self._checked.clear()
                self._checked[key] = decode_message(raw, p, what, check)
            out.append(self._checked[key])
        return out
