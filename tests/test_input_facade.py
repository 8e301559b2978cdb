"""The input iterator's interface: what the Replicator uses of it is named, and nothing
outside ``jreplicate/input/`` reaches the iterator's private members."""

import ast
import pathlib

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
