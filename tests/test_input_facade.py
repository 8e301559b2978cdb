"""The input iterator's interface: what the Replicator uses of it is named, and nothing
outside ``jreplicate/input/`` reaches the iterator's private members."""

import ast
import pathlib

import pytest

import jreplicate
from jreplicate.input.iterator import InputIterator

ROOT = pathlib.Path(jreplicate.__file__).parent


def _private_reads(path: pathlib.Path) -> list[str]:
    """``name._attr`` accesses in ``path`` on anything but ``self``/``cls``."""
    return [f"{path.name}:{n.lineno} {n.value.id}.{n.attr}"
            for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Attribute) and n.attr.startswith("_")
            and not n.attr.startswith("__") and isinstance(n.value, ast.Name)
            and n.value.id not in ("self", "cls")]


def test_the_facade_touches_no_private_member_of_another_object():
    assert _private_reads(ROOT / "replicator.py") == []


def test_the_replicator_interface_of_the_iterator_is_named():
    for name in ("belongs_to", "next_steps", "put_back"):
        assert getattr(InputIterator, name).__doc__, name


# -- the staging, composed: it gets its reads and its placement, nothing else ----------
def _staging(n, *, buffer=0, warn_at=None):
    """A Staging over ``n`` host steps ``i`` (one replica, one leaf), placed as ints (a
    step) or lists (a device loop), with no iterator anywhere."""
    import jax
    import numpy as np

    from jreplicate.input.staging import Staging

    treedef = jax.tree.structure(0)
    steps = iter(range(n))
    box = {}

    def produce_host():
        i = next(steps)
        if i == warn_at:
            box["staging"].warn(f"dropped after step {i}")
        return [[np.array(i)]], treedef

    def assemble(leaves, td):
        assert td == treedef
        x = leaves[0][0]
        return x.tolist() if x.ndim else int(x)

    box["staging"] = Staging(produce_host, assemble, buffer=buffer)
    return box["staging"]



@pytest.mark.parametrize("buffer", [0, 1])
def test_staging_hands_out_steps_in_order_and_takes_them_back(buffer):
    s = _staging(4, buffer=buffer)
    assert s.prefetching == bool(buffer)
    assert s.next(None) == 0
    taken = s.next(None)
    s.put_back(taken, None)  # a run that raised: its batch is read again, first
    assert [s.next(None) for _ in range(3)] == [1, 2, 3]
    for _ in range(2):
        with pytest.raises(StopIteration):  # the end stays the end
            s.next(None)


@pytest.mark.parametrize("buffer", [0, 1])
def test_staging_hands_out_device_loops_shorter_only_at_the_end(buffer):
    s = _staging(6, buffer=buffer)
    assert s.next(4) == ([0, 1, 2, 3], 4)
    if not buffer:  # (with prefetch, the loop read ahead is re-cut: that needs PerReplica)
        s.put_back(([0, 1, 2, 3], 4), 4)
        assert s.next(4) == ([0, 1, 2, 3], 4)
    assert s.next(4) == ([4, 5], 2)
    with pytest.raises(StopIteration):
        s.next(4)


def test_staging_closed_refuses_reads_until_restarted():
    s = _staging(4, buffer=1)
    assert s.next(None) == 0
    s.close()
    with pytest.raises(RuntimeError, match="input iterator was closed"):
        s.next(None)
    s.restart()  # what was read ahead is forgotten; the source itself is the owner's
    assert s.next(None) in (1, 2)


def test_a_prefetched_reads_warning_comes_with_its_item():
    import warnings

    s = _staging(4, buffer=2, warn_at=2)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert s.next(None) == 0
        assert s.next(None) == 1
        assert [str(w.message) for w in seen] == []  # step 2 was read ahead, not taken
        assert s.next(None) == 2
    assert [str(w.message) for w in seen] == ["dropped after step 2"]
