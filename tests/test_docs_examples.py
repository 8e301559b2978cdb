"""Every fenced block whose info string is exactly ``python`` in docs/**/*.md runs here:
page by page, the blocks of a page in order in one shared namespace, in this process
(8 simulated CPU devices, from conftest.py), in a temporary working directory.

Code that must not run here (the TensorFlow or Keras side of a comparison, commands for
a cluster) is written in a ```{code-block} python directive, or a ``bash`` / ``text``
fence; those are shown, never executed."""

import pathlib
import re

import pytest

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
    monkeypatch.chdir(tmp_path)  # what a page writes (checkpoints, figures) stays here
    namespace = {"__name__": f"docs_{page.stem}"}
    for line, source in python_blocks(page.read_text()):
        # Padded so that a traceback names the page's own line numbers.
        code = compile("\n" * (line - 1) + source, str(page), "exec")
        exec(code, namespace)  # noqa: S102 - the documentation's own examples
