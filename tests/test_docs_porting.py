"""Runs the porting guide's code: every fenced block whose info string is exactly
``python`` in ``docs/porting/*.md``, the blocks of a page in order in one namespace.

TensorFlow, Keras and other not-run code sits in ``{code-block} python`` directives,
which are not collected here. Each page's jreplicate side asserts what it shows (a
loss decreases, numbers equal a numpy reference or the hand-written JAX version).
"""

from __future__ import annotations

import pathlib
import re
import warnings

import pytest

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
