"""Every fenced block whose info string is exactly ``python`` in docs/**/*.md runs here:
page by page, the blocks of a page in order in one shared namespace, in this process
(8 simulated CPU devices, from conftest.py), in a temporary working directory.

Code that must not run here (the TensorFlow or Keras side of a comparison, commands for
a cluster) is written in a ```{code-block} python directive, or a ``bash`` / ``text``
fence; those are shown, never executed. A UserWarning is an error while a page runs: a
page must not teach code jreplicate warns about (a page that shows a warning catches it
itself). Every ``jr.`` / ``rep.`` / ``ctx.`` name cited in inline code must exist, with
the keywords a cited call uses."""

import functools
import inspect
import pathlib
import re
import warnings

import pytest

import jreplicate as jr
import jreplicate.testing  # noqa: F401 - jr.testing, cited by the pages
from tests._optional import installed

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


def python_blocks(text: str) -> list[tuple[int, str]]:
    """The (first line number, source) of each fence whose info string is ``python``."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, info, start = m["fence"], m["info"].strip(), i + 1
        i += 1
        while i < len(lines):
            close = _FENCE.match(lines[i])
            if (close and close["fence"][0] == fence[0] and len(close["fence"]) >= len(fence)
                    and not close["info"].strip()):
                break
            i += 1
        if info == "python":
            indent = len(m["indent"])
            blocks.append((start + 1, "\n".join(line[indent:] for line in lines[start:i])))
        i += 1
    return blocks


PAGES = sorted(p for p in DOCS.rglob("*.md")
               if "_build" not in p.parts and python_blocks(p.read_text()))


def test_the_fence_parser():
    text = "a\n```python\nx = 1\n```\n````{code-block} python\n```python\ny\n```\n````\n" \
           "```bash\nls\n```\n```python\n\nz = x\n```\n"
    assert python_blocks(text) == [(3, "x = 1"), (14, "\nz = x")]
    assert PAGES, "no executed code in docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_page_code_runs(page, tmp_path, monkeypatch):
    code = "\n".join(source for _, source in python_blocks(page.read_text()))
    # The demo's data set (load_digits_split) is scikit-learn's, Ray checks its actors'
    # options; where a package beyond jreplicate's own is missing (the GPU image), the
    # page is skipped, naming it.
    missing = [m for m, used in (("sklearn", "sklearn" in code or "load_digits" in code),
                                 ("matplotlib", "matplotlib" in code),
                                 ("ray", 'carrier="ray"' in code)) if used
               and not installed(m)]
    if missing:
        pytest.skip(f"the page's code needs {', '.join(missing)} (not installed)")
    monkeypatch.chdir(tmp_path)  # what a page writes (checkpoints, figures) stays here
    namespace = {"__name__": f"docs_{page.stem}"}
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        for line, source in python_blocks(page.read_text()):
            # Padded so that a traceback names the page's own line numbers.
            code = compile("\n" * (line - 1) + source, str(page), "exec")
            exec(code, namespace)  # noqa: S102 - the documentation's own examples


def test_every_porting_page_is_in_its_toctree():
    index = (DOCS / "porting" / "index.md").read_text()
    for page in (DOCS / "porting").glob("*.md"):
        if page.name != "index.md":
            assert re.search(rf"^{re.escape(page.stem)}$", index, re.M), \
                f"{page.name} is missing from docs/porting/index.md's toctree"


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


ALL_PAGES = sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts)


@pytest.mark.parametrize("page", ALL_PAGES, ids=lambda p: str(p.relative_to(DOCS)))
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


def test_the_readme_example_runs_and_trains(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    readme = DOCS.parent / "README.md"
    blocks = python_blocks(readme.read_text())
    assert len(blocks) == 1, "the README has one short example"
    namespace = {"__name__": "readme"}
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        line, source = blocks[0]
        exec(compile("\n" * (line - 1) + source, str(readme), "exec"), namespace)  # noqa: S102
    assert float(namespace["loss"]) < 1e-3  # learnt y = sum(x) exactly


def test_the_readme_links_resolve():
    readme = DOCS.parent / "README.md"
    for target in re.findall(r"\]\(([^)#]+)\)", readme.read_text()):
        assert (readme.parent / target).exists(), f"README links to missing {target}"
