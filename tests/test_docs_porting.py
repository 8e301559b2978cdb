"""Runs the porting guide's code: every fenced block whose info string is exactly
``python`` in ``docs/porting/*.md``, the blocks of a page in order in one namespace.

TensorFlow, Keras and other not-run code sits in ``{code-block} python`` directives,
which are not collected here. Each page's jreplicate side asserts what it shows (a
loss decreases, numbers equal a numpy reference or the hand-written JAX version).
"""

from __future__ import annotations

import functools
import inspect
import pathlib
import re
import warnings

import pytest

import jreplicate as jr
import jreplicate.testing  # noqa: F401 - jr.testing, cited by the pages

PAGES_DIR = pathlib.Path(__file__).resolve().parents[1] / "docs" / "porting"
PAGES = sorted(PAGES_DIR.glob("*.md"))
_FENCE = re.compile(r"^(`{3,}|~{3,})(.*)$")


def python_blocks(text: str) -> list[tuple[int, str]]:
    """``(first line number, source)`` of each fenced block whose info string is
    exactly ``python``; other fences (``{code-block} python``, ``bash``) are skipped."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, info, start = m.group(1), m.group(2).strip(), i + 1
        i += 1
        while i < len(lines) and not (lines[i].startswith(fence[0] * len(fence))
                                      and lines[i].strip(fence[0]) == ""):
            i += 1
        if info == "python":
            blocks.append((start + 1, "\n".join(lines[start:i]) + "\n"))
        i += 1
    return blocks


def test_extraction_rules():
    text = ("```python\na = 1\n```\n\n```{code-block} python\nb = 2\n```\n"
            "````python\nc = '```'\n````\n```bash\nls\n```\n")
    assert [src for _, src in python_blocks(text)] == ["a = 1\n", "c = '```'\n"]


def test_every_page_is_in_the_toctree_and_runs_code():
    index = (PAGES_DIR / "index.md").read_text()
    for page in PAGES:
        if page.name == "index.md":
            continue
        assert re.search(rf"^{re.escape(page.stem)}$", index, re.M), \
            f"{page.name} is missing from docs/porting/index.md's toctree"


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p.read_text())],
                         ids=lambda p: p.stem)
def test_page_code_runs(page):
    # A warning is an error: a page must not teach code jreplicate warns about (a
    # page that shows a warning catches it itself).
    namespace: dict = {"__name__": f"docs_porting_{page.stem}"}
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        for line, src in python_blocks(page.read_text()):
            code = compile(src, f"{page}:{line}", "exec")
            exec(code, namespace)  # noqa: S102 - the page's own examples


# -- every jreplicate name the pages cite exists ------------------------------------
# ``ctx`` is a step's ReplicaContext or an input_fn's InputContext.
_ROOTS = {"jr": (jr,), "rep": (jr.Replicator,), "ctx": (jr.ReplicaContext, jr.InputContext)}
_NAME = re.compile(r"(?<![\w.])(jr|rep|ctx)((?:\.[A-Za-z_]\w*)+)")


def _resolve(dotted: str) -> object:
    """The object ``jr.a.b`` / ``rep.a`` / ``ctx.a`` names; an instance attribute
    (``self.a = ...`` in the class's source) counts. Raises AttributeError."""
    root, *parts = dotted.split(".")
    *others, obj = _ROOTS[root]
    if others and hasattr(others[0], parts[0]):
        obj = others[0]
    for part in parts:
        if hasattr(obj, part):
            obj = getattr(obj, part)
        elif inspect.isclass(obj) and f"self.{part} =" in inspect.getsource(obj):
            return None  # an instance attribute: nothing further to check
        else:
            raise AttributeError(f"{dotted}: {obj!r} has no attribute {part!r}")
    return obj


def cited_names(text: str) -> list[tuple[str, list[str]]]:
    """``(dotted name, keywords)`` for every ``jr.``/``rep.``/``ctx.`` name in an inline
    code span; keywords are those of a span that calls the name
    (``jr.TPUStrategy(steps_per_run=K)``)."""
    found = []
    for span in re.findall(r"(?<!`)`([^`\n]+)`(?!`)", text):
        for m in _NAME.finditer(span):
            kws = []
            if span.startswith(m.group(0) + "(") and m.start() == 0:
                kws = re.findall(r"(?<![\w.])([A-Za-z_]\w*)=(?!=)", span[m.end():])
            found.append((m.group(1) + m.group(2), kws))
    return found


@functools.cache
def _params(obj: object) -> set[str] | None:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        return None
    return set(sig.parameters)


def test_cited_names_resolve():
    assert ("jr.TPUStrategy", ["steps_per_run"]) in cited_names("`jr.TPUStrategy(steps_per_run=K)`")
    assert cited_names("`rep.run(fn, x)` and `ctx.all_sum`") == [("rep.run", []),
                                                                  ("ctx.all_sum", [])]
    with pytest.raises(AttributeError):
        _resolve("jr.ps.NoSuchThing")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.stem)
def test_every_cited_jreplicate_name_exists(page):
    bad = []
    for dotted, kws in cited_names(page.read_text()):
        try:
            obj = _resolve(dotted)
        except AttributeError as e:
            bad.append(str(e))
            continue
        params = _params(obj) if kws and callable(obj) else None
        if params is not None:
            bad += [f"{dotted}: no keyword {kw!r}" for kw in kws if kw not in params]
    assert not bad, f"{page.name} cites names jreplicate lacks:\n" + "\n".join(bad)
