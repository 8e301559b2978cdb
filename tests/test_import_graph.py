"""The import graph the design promises (issue 16 item 1, issue 18 item 10): no cycle among
jreplicate's modules, and no module importing from a layer above it -- strategies import
executors and the PS core, never the reverse; ``execution/`` knows nothing of ``ps/``;
``layout.py`` sits below all three. Package ``__init__`` files that only re-export are the
public facade: an import through one counts as an import of the module defining the name."""

import ast
import pathlib

import pytest

import jreplicate

ROOT = pathlib.Path(jreplicate.__file__).parent


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for p in ROOT.rglob("*.py"):
        parts = ["jreplicate", *p.relative_to(ROOT).with_suffix("").parts]
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return mods


MODS = _modules()
TREES = {m: ast.parse(p.read_text()) for m, p in MODS.items()}


def _imports(m: str):
    """``(line, imported module, imported name or None)`` for every import written in
    module ``m`` (module level, in a function, under TYPE_CHECKING; relative ones resolved)."""
    package = m if MODS[m].name == "__init__.py" else m.rpartition(".")[0]
    for node in ast.walk(TREES[m]):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name, None) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            mod = ".".join(filter(None, [base, node.module]))
            yield from ((node.lineno, mod, a.name) for a in node.names)


def _is_facade(m: str) -> bool:
    """A package ``__init__`` holding only a docstring, imports and dunders (``__all__``)."""
    return MODS[m].name == "__init__.py" and all(
        isinstance(s, (ast.Import, ast.ImportFrom, ast.Expr))
        or (isinstance(s, ast.Assign) and all(getattr(t, "id", "").startswith("__")
                                              for t in s.targets))
        for s in TREES[m].body)


def _resolve(mod: str, name: str | None) -> str | None:
    """The jreplicate module an import depends on, seen through re-exporting facades."""
    if name is not None and f"{mod}.{name}" in MODS:
        mod, name = f"{mod}.{name}", None
    while mod and mod not in MODS:
        mod, name = mod.rpartition(".")[0], None
    if mod and _is_facade(mod) and name is not None:
        for _, src, reexported in _imports(mod):
            if reexported == name:
                return _resolve(src, name)
    return mod or None


def _edges() -> dict[str, dict[str, str]]:
    """``{module: {imported module: 'module:line imports ...'}}`` over non-facade modules."""
    edges: dict[str, dict[str, str]] = {}
    for m in MODS:
        if _is_facade(m):
            continue
        edges[m] = {}
        for line, mod, name in _imports(m):
            target = _resolve(mod, name)
            if target and target != m and not _is_facade(target):
                what = f"{mod}.{name}" if name else mod
                edges[m].setdefault(target, f"{m}:{line} imports {what}")
    return edges


def _cycle_from(edges, start: str) -> list[str] | None:
    """One import path from ``start`` back to itself, or None."""
    parents, todo = {}, [start]
    while todo:
        node = todo.pop()
        for nxt in edges.get(node, ()):
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    path.append(parents[path[-1]])
                return [edges[a][b] for a, b in zip(path[::-1], [*path[-2::-1], start])]
            if nxt not in parents:
                parents[nxt] = node
                todo.append(nxt)
    return None


def test_the_graph_sees_imports_inside_functions_relative_ones_and_through_facades(
        monkeypatch):
    edges = _edges()
    assert "jreplicate.strategies.parameter_server" in edges["jreplicate.testing"]
    assert _is_facade("jreplicate") and "jreplicate" not in edges and len(edges) > 40
    m = "jreplicate.execution.base"  # an upward import and a cycle, planted in a function
    planted = "def _f():\n    from ..strategies import MirroredStrategy\n    from . import spmd\n"
    monkeypatch.setitem(TREES, m, ast.parse(MODS[m].read_text() + planted))
    edges = _edges()
    assert "jreplicate.strategies.mirrored" in edges[m]  # through the strategies facade
    assert _cycle_from(edges, m)[0].endswith("imports jreplicate.execution.spmd")
    with pytest.raises(AssertionError, match="execution.base:.* imports jreplicate.strat"):
        test_no_module_imports_from_a_layer_above_it()


def test_no_import_cycle():
    edges = _edges()
    cycles = {m: c for m in sorted(edges) if (c := _cycle_from(edges, m))}
    assert cycles == {}, "import cycles:\n" + "\n".join(
        f"- {m}: " + " -> ".join(c) for m, c in cycles.items())


LAYERS = {  # a module under the key imports nothing from under the values
    # the multi-process runtime sits below everything that runs on it
    "jreplicate.cluster": ("jreplicate.strategies", "jreplicate.execution", "jreplicate.ps",
                           "jreplicate.checkpoint"),
    "jreplicate.execution": ("jreplicate.ps", "jreplicate.strategies"),
    "jreplicate.ps": ("jreplicate.strategies",),
    "jreplicate.layout": ("jreplicate.execution", "jreplicate.ps", "jreplicate.strategies"),
    # checkpointing sits above the strategies whose state it saves
    "jreplicate.strategies": ("jreplicate.checkpoint",),
}


def _under(m: str, package: str) -> bool:
    return m == package or m.startswith(package + ".")


def test_no_module_imports_from_a_layer_above_it():
    upward = [why for m, targets in _edges().items() for low, highs in LAYERS.items()
              if _under(m, low) for t, why in targets.items()
              if any(_under(t, h) for h in highs)]
    assert upward == [], "imports reaching a layer above:\n" + "\n".join(
        f"- {w}" for w in sorted(upward))


def test_only_the_ray_subpackage_imports_ray():
    """Every module that touches Ray lives in ``jreplicate.ps.ray``; the rest of the
    package (the embedded carrier, the coordinator, the shards) runs without Ray."""
    outside = [f"- {m}:{line} imports {mod}" for m in sorted(MODS)
               if not _under(m, "jreplicate.ps.ray")
               for line, mod, _ in _imports(m) if _under(mod, "ray")]
    assert outside == [], "Ray imported outside jreplicate.ps.ray:\n" + "\n".join(outside)
