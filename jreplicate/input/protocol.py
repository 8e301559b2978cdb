"""The input's cross-process protocol: one step's read outcome and the decision (private).

Across processes (:class:`jreplicate.MultiWorkerStrategy`) every process reads its own
replicas' elements, publishes a :class:`ReadOutcome` (data with its element spec, end of
input, a partial batch, or an error) through the coordination service as a checked JSON
message (:meth:`ReadOutcome.to_wire`, :meth:`ReadOutcome.from_wire`; nothing is
unpickled), and then every process calls :func:`decide` on the same outcomes: a pure
function, so every process takes the same :class:`Decision` (yield the data, padding
where a process ran out; stop; or raise one error with one message), and no process
raises while another waits in a collective.

Example:
  >>> spec = {"structure": "*", "tree": "*", "leaves": [[[4], "float32"]]}
  >>> decide([ReadOutcome.data(spec, process=0), ReadOutcome.end(process=1)],
  ...        pad=False, single=False, num_replicas=8).action
  <Action.STOP: 'stop'>
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import Any, NamedTuple

from jreplicate import _wire
from jreplicate._tree import LeafErrors


class OutcomeKind(enum.Enum):
    """What one process's read of a step gave; the value is the wire status."""

    DATA = "ok"  # elements (or, for a process without pipelines, nothing to read)
    END = "end"  # its pipelines ran out
    PARTIAL = "partial"  # a final partial batch (dropped)
    ERROR = "error"  # reading or checking an element raised


@dataclasses.dataclass(frozen=True)
class ReadOutcome:
    """One process's outcome of reading one step's input.

    Attributes:
      kind: what the read gave.
      spec: the element spec (:data:`jreplicate._wire.ELEMENT_SPEC`: structure, leaf
        shapes and dtypes), with ``DATA`` only; None for a process that reads nothing.
      detail: the partial batch (``PARTIAL``) or ``"Type: message"`` of the error
        (``ERROR``); empty otherwise.
      error_type: the error's class name (``ERROR``); empty otherwise.
      seen: whether the process knows the element structure (has read an element).
      process: the process it comes from (not sent: the agreement's order says it).
    """

    kind: OutcomeKind
    spec: dict | None = None
    detail: str = ""
    error_type: str = ""
    seen: bool = True
    process: int = 0

    @classmethod
    def data(cls, spec: dict | None, *, seen: bool = True, process: int = 0) -> ReadOutcome:
        return cls(OutcomeKind.DATA, spec, seen=seen, process=process)

    @classmethod
    def end(cls, *, seen: bool = True, process: int = 0) -> ReadOutcome:
        return cls(OutcomeKind.END, seen=seen, process=process)

    @classmethod
    def partial(cls, detail: str, *, seen: bool = True, process: int = 0) -> ReadOutcome:
        return cls(OutcomeKind.PARTIAL, detail=detail, seen=seen, process=process)

    @classmethod
    def error(cls, error: BaseException, *, seen: bool = True,
              process: int = 0) -> ReadOutcome:
        name = type(error).__name__
        return cls(OutcomeKind.ERROR, detail=f"{name}: {error}", error_type=name,
                   seen=seen, process=process)

    def to_wire(self) -> dict:
        """The JSON message of this outcome (:func:`jreplicate._wire.input_report`)."""
        return {"status": self.kind.value, "detail": self.detail, "seen": self.seen,
                "error_type": self.error_type, "spec": self.spec}

    @classmethod
    def from_wire(cls, payload: Any, process: int = 0) -> ReadOutcome:
        """The outcome a process sent, checked.

        Raises:
          ValueError: ``payload`` is not a well-formed message; says which field is wrong.
        """
        r = _wire.input_report(payload)
        return cls(OutcomeKind(r["status"]), r["spec"], r["detail"], r["error_type"],
                   r["seen"], _wire.natural(process, "process"))

    def at(self, process: int) -> ReadOutcome:
        """This outcome as process ``process``'s."""
        return dataclasses.replace(self, process=process)


class Action(enum.Enum):
    DATA = "data"  # assemble the step (processes in Decision.pad pad theirs)
    STOP = "stop"  # StopIteration on every process (after Decision.warning)
    RAISE = "raise"  # every process raises Decision.error_type(Decision.message)


class Decision(NamedTuple):
    """What every process does with one step, from :func:`decide`.

    Attributes:
      action: yield the data, stop, or raise.
      spec: ``DATA``: the agreed element spec.
      pad: ``DATA``: the processes whose pipelines ran out, which pad their elements.
      warning: ``STOP``: what was dropped (None: nothing to warn about).
      error_type: ``RAISE``: the exception class every process raises...
      message: ...with this message.
      process: ``RAISE`` for a failed read: the process whose read failed (it raises
        its own exception, the others ``error_type(message)``); None otherwise.
    """

    action: Action
    spec: dict | None = None
    pad: frozenset[int] = frozenset()
    warning: str | None = None
    error_type: type[Exception] | None = None
    message: str = ""
    process: int | None = None

    def error(self) -> Exception:
        """The exception a ``RAISE`` decision stands for."""
        return self.error_type(self.message)


#: The error classes rebuilt by name on the processes whose read did not raise.
_KINDS: dict[str, type[Exception]] = {"ValueError": ValueError, "TypeError": TypeError,
                                      "LeafErrors": LeafErrors}


def decide(outcomes: Sequence[ReadOutcome], *, pad: bool, single: bool,
           num_replicas: int) -> Decision:
    """The decision every process takes from every process's outcome of one step.

    Pure: the same outcomes (in any order; each names its process) give the same
    decision. In order: a failed read (the lowest process's) is raised everywhere;
    with ``pad``, the input stops when every process ran out, and otherwise those that
    ran out pad; without it, a process that ran out or had a partial batch stops every
    process; elements whose specs differ across processes raise ValueError, as does a
    structure a process must rebuild (SINGLE mode's receivers; a padded process that
    never saw an element) but cannot.

    Args:
      outcomes: one per process, processes ``0 .. n-1``.
      pad: ``partial_batch="pad"``.
      single: ``InputReplicationMode.SINGLE`` (process 0 reads for everyone).
      num_replicas: the number of replicas (for the error's fix).

    Raises:
      ValueError: ``outcomes`` are not one per process, or no process has data, none
        ran out and none failed (a protocol error, not an input error).
    """
    by_process = sorted(outcomes, key=lambda o: o.process)
    if [o.process for o in by_process] != list(range(len(by_process))) or not by_process:
        raise ValueError("decide(outcomes) needs one outcome per process 0..n-1, got "
                         f"processes {[o.process for o in outcomes]}")
    for o in by_process:
        if o.kind is OutcomeKind.ERROR:
            return Decision(
                Action.RAISE, error_type=_KINDS.get(o.error_type, RuntimeError),
                message=f"reading the input on process {o.process} failed, so every "
                        f"process stops: {o.detail}", process=o.process)
    ended = [o for o in by_process if o.kind in (OutcomeKind.END, OutcomeKind.PARTIAL)]
    specs = [o for o in by_process if o.spec is not None]
    padded: frozenset[int] = frozenset()
    if pad and ended:
        if not specs:  # every pipeline everywhere has run out
            return Decision(Action.STOP)
        padded = frozenset(o.process for o in ended if o.kind is OutcomeKind.END)
        ended = []
    if ended:
        return Decision(Action.STOP, warning=_dropped(by_process, ended))
    if not specs:
        raise ValueError("decide(outcomes): no process read an element, none ran out and "
                         "none failed")
    # The first step, padded: each process padded its elements to its own largest one
    # (its replicas' shards may all be shorter than a batch), so the processes take
    # the largest process's spec when the others differ from it in the batch only.
    widest = (_widest([o.spec for o in specs])
              if pad and not any(o.seen for o in by_process) else None)
    agreed = widest or specs[0].spec
    if widest is None and any(o.spec != agreed for o in specs):
        listing = "; ".join(f"process {o.process}: {_wire.spec_str(o.spec)}" for o in specs)
        return Decision(Action.RAISE, error_type=ValueError, message=(
            "the input elements differ across processes (" + listing + "). Every "
            "replica must get an element of one structure, shape and dtype: batch each "
            "pipeline with ctx.get_per_replica_batch_size(global_batch_size), with a "
            "global batch size divisible by the number of replicas "
            f"({num_replicas}), and split the data evenly across processes."))
    problem = _unbuildable(by_process, specs[0].spec, single)
    if problem:
        return Decision(Action.RAISE, error_type=ValueError, message=problem)
    return Decision(Action.DATA, spec=agreed, pad=padded)


def _widest(specs: Sequence[dict]) -> dict | None:
    """The spec of ``specs`` with the longest batch, where each has one leading length
    in every leaf (as padded elements with their mask do) and they differ in it only;
    else None."""
    def key(spec):
        leaves = spec["leaves"]
        if not leaves or any(not shape for shape, _ in leaves):
            return None
        if len({shape[0] for shape, _ in leaves}) != 1:
            return None
        return (repr(spec["tree"]), spec["structure"],
                tuple((tuple(shape[1:]), dtype) for shape, dtype in leaves))
    keys = {key(spec) for spec in specs}
    if len(keys) != 1 or None in keys:
        return None
    return max(specs, key=lambda spec: spec["leaves"][0][0][0])


def _dropped(outcomes: Sequence[ReadOutcome], ended: Sequence[ReadOutcome]) -> str | None:
    """What the last step dropped (None when no process had anything to drop)."""
    if not any(o.kind is OutcomeKind.PARTIAL or o.spec is not None for o in outcomes):
        return None
    return "the last step's input: " + "; ".join(
        f"process {o.process} " + (f"had a partial batch ({o.detail})"
                                   if o.kind is OutcomeKind.PARTIAL else "ran out of input")
        for o in ended)


def _unbuildable(outcomes: Sequence[ReadOutcome], spec: dict, single: bool) -> str | None:
    """What is wrong (the same on every process) when a process must build input
    elements of ``spec`` from its description (SINGLE mode's receivers; a padded process
    that has never seen an element) and the structure has a custom pytree node, which
    only the process that flattened it knows; None when nothing is."""
    needs = [o.process for o in outcomes
             if (single and o.process) or (o.kind is OutcomeKind.END and not o.seen)]
    if not needs or _wire.rebuildable(spec["tree"]):
        return None
    return (
        f"process(es) {needs} must build input elements of structure {spec['structure']} "
        "from another process's description, which covers dicts, lists, tuples, None and "
        "module-level namedtuples only, not custom pytree nodes. Make input_fn yield "
        "elements made of those containers (e.g. a dict of arrays), "
        + ("or use InputReplicationMode.PER_WORKER." if single else
           "or give every process's input at least one element.")
    )
