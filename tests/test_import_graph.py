"""No import cycle through the PS core: ps/ gets a frozen config, not the strategy, and
the Ray modules do not import each other (issue 18 item 10)."""

import ast
import pathlib

import jreplicate

ROOT = pathlib.Path(jreplicate.__file__).parent


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for p in ROOT.rglob("*.py"):
        parts = ["jreplicate", *p.relative_to(ROOT).with_suffix("").parts]
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return mods


def _edges(mods: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """Every import of a jreplicate module, wherever it is written (module level, in a
    function, under TYPE_CHECKING); parent packages, imported first anyway, left out."""
    def resolve(name):
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                subs = [f"{node.module}.{a.name}" for a in node.names]
                names = [s for s in subs if s in mods] or [node.module]
            else:
                continue
            for n in names:
                r = resolve(n)
                if r and r != m and not m.startswith(r + "."):
                    edges[m].add(r)
    return edges


def _reaches(edges: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for n in edges.get(todo.pop(), ()):
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return seen


def test_no_import_cycle_through_ps_or_strategies():
    edges = _edges(_modules())
    assert "jreplicate.strategies.parameter_server" in edges["jreplicate.testing"]
    cyclic = sorted(m for m in edges if m.startswith(("jreplicate.ps", "jreplicate.strategies"))
                    and m in _reaches(edges, m))
    assert cyclic == [], cyclic
