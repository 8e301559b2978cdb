"""Shard actors seen from a Ray process (the driver or a worker actor): a
:class:`jreplicate.ps.handle.RemoteShardHandle` over a shard actor.

Imported by both :mod:`jreplicate.ps.ray.carrier` (the driver) and
:mod:`jreplicate.ps.ray.actors` (inside the worker actors); it imports neither, so the
two Ray modules do not import each other.
"""

from __future__ import annotations

import time
from typing import NamedTuple

from jreplicate.ps.ray import wire
from jreplicate.ps.ray.pieces import in_pieces
from jreplicate.ps.remote import ShardUpdateError


def _ray():
    try:
        import ray
    except ImportError as e:
        raise ImportError(
            "ParameterServerStrategy(carrier='ray') needs Ray: pip install "
            "'jreplicate[ray]' (or pip install 'ray>=2.40'), or use carrier='embedded'."
        ) from e
    return ray


class _ShardLost(RuntimeError):
    """A worker found a shard actor dead."""


class _Forgotten(RuntimeError):
    """A worker actor that Ray restarted afresh (its process died while idle) was sent a
    step before the carrier told it again what it told the first (the shards, its
    settings, the functions it was sent once). The step did not run there."""


class _PackedReply(NamedTuple):
    """The refs of a ``push_pull_packed`` call: its head, then the parameter chunks."""

    refs: list


class _ShardCalls:
    """A shard actor's :class:`ShardHandle` operations returning Ray object refs."""

    def __init__(self, actor):
        self.actor = actor
        self._packed = {}  # chunks -> push_pull_packed with that many returns

    def pull(self):
        return self.actor.pull.remote()

    def push(self, push_id, worker, fetched_step, grads, decision=None, attempt=0):
        return self.actor.push.remote(push_id, worker, fetched_step, in_pieces(grads),
                                      decision, attempt)

    def push_pull(self, push_id, worker, fetched_step, grads):
        # Pieces small enough go as raw bytes in chunks Ray sends inline (ps/wire.py);
        # the reply is its head (decision, step, meta) and the parameters in as many
        # chunks. Larger ones go as dicts through the object store, each array over
        # 1 MiB in 1 MiB pieces both ways (ray/pieces.py).
        if not wire.fits_inline(grads):
            return self.actor.push_pull.remote(push_id, worker, fetched_step,
                                               in_pieces(grads))
        meta, chunks = wire.pack(grads)
        call = self._packed.get(len(chunks))
        if call is None:
            call = self._packed[len(chunks)] = self.actor.push_pull_packed.options(
                num_returns=1 + len(chunks))
        return _PackedReply(call.remote(push_id, worker, fetched_step, wire.encode(meta),
                                        *wire.to_bytes(chunks)))

    def check(self, push_id, fetched_step, grads):
        return self.actor.check.remote(push_id, fetched_step, in_pieces(grads))

    def stage(self, push_id, attempt, grads):
        return self.actor.stage.remote(push_id, attempt, in_pieces(grads))

    def commit(self, push_id, decision):
        return self.actor.commit.remote(push_id, decision)

    def decision(self, push_id):
        return self.actor.decision.remote(push_id)

    def ack(self, steps):
        return self.actor.ack.remote(steps)

    def record(self, push_id, decision):
        return self.actor.record.remote(push_id, decision)

    def decided(self, push_id):
        return self.actor.decided.remote(push_id)

    def return_token(self, token):
        return self.actor.return_token.remote(token)


class _ShardProxy:
    """A shard actor as a :class:`jreplicate.ps.handle.RemoteShardHandle`: blocking
    calls through ``ray.get``; ``nowait`` returns the refs, ``gather`` waits for them."""

    def __init__(self, actor):
        self.actor = actor
        self.nowait = _ShardCalls(actor)

    def _get(self, ref, timeout=None):
        ray = _ray()
        try:
            return ray.get(ref, timeout=timeout)
        except ray.exceptions.RayActorError as e:
            raise _ShardLost(f"a parameter-server shard actor died: {e}") from None
        except ray.exceptions.RayTaskError as e:  # the shard raised: its own error
            cause = getattr(e, "cause", None)
            if isinstance(cause, ShardUpdateError):
                raise cause from None
            raise

    def gather(self, futures: list) -> list:
        refs = [r for f in futures for r in (f.refs if isinstance(f, _PackedReply) else [f])]
        got, out = self._get(refs), []
        for f in futures:
            if isinstance(f, _PackedReply):
                (decision, step, meta), *chunks = got[:len(f.refs)]
                meta = wire.decode(meta, "a parameter-server shard")
                out.append((decision, step, wire.unpack(meta, chunks)))
                got = got[len(f.refs):]
            else:
                out.append(got[0])
                got = got[1:]
        return out

    def pull(self):
        return self._get(self.nowait.pull())

    def push(self, push_id, worker, fetched_step, grads, decision=None, attempt=0):
        return self._get(self.nowait.push(push_id, worker, fetched_step, grads, decision,
                                          attempt))

    def push_pull(self, push_id, worker, fetched_step, grads):
        return self.gather([self.nowait.push_pull(push_id, worker, fetched_step, grads)])[0]

    def check(self, push_id, fetched_step, grads):
        return self._get(self.nowait.check(push_id, fetched_step, grads))

    def stage(self, push_id, attempt, grads):
        return self._get(self.nowait.stage(push_id, attempt, grads))

    def commit(self, push_id, decision):
        return self._get(self.nowait.commit(push_id, decision))

    def decision(self, push_id):
        return self._get(self.nowait.decision(push_id))

    def ack(self, steps):
        return self._get(self.nowait.ack(steps))

    def record(self, push_id, decision):
        return self._get(self.nowait.record(push_id, decision))

    #: Seconds :meth:`decided` waits for the shard's answer.
    DECIDED_TIMEOUT = 60.0

    def decided(self, push_id):
        return self._get(self.nowait.decided(push_id), timeout=self.DECIDED_TIMEOUT)

    def return_token(self, token):
        return self._get(self.nowait.return_token(token))

    def take_token(self, deadline, *, skip_stale=True, min_step=0, live_workers=0,
                   on_wait=None):
        # on_wait brackets the whole remote call: the shard actor cannot call back into
        # this process, so "blocking" here means waiting for the actor's answer.
        left = max(deadline - time.monotonic(), 0.0)
        if on_wait is not None:
            on_wait(True)
        try:
            return self._get(self.actor.take_token.remote(left, skip_stale, min_step,
                                                          live_workers), timeout=left + 30.0)
        finally:
            if on_wait is not None:
                on_wait(False)
