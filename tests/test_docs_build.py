"""The documentation site builds with warnings as errors, and every public name of every
namespace has its entry, with its example, in the API pages (a new public name without
documentation fails here). Notebooks are rendered as stored, not executed (they run in
tests/test_notebooks.py; the guides' code runs in tests/test_docs_examples.py)."""

import inspect
import os
import pathlib
import re
import subprocess
import sys
import time
import types

import pytest

from tests.test_public_api import NAMESPACES

pytest.importorskip("sphinx", reason="Sphinx is not installed: pip install -e '.[docs]'")

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
         "-d", str(out / ".doctrees"), str(DOCS), str(out / "html")],
        capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    print(f"docs built in {time.monotonic() - start:.1f} s")
    return out / "html"


def _page(site, module) -> str:
    path = site / "api" / f"{module.__name__}.html"
    assert path.exists(), f"no API page for {module.__name__}: add docs/api/{path.stem}.md"
    return path.read_text()


@pytest.mark.parametrize("module", NAMESPACES, ids=lambda m: m.__name__)
def test_every_public_name_is_documented(site, module):
    page = _page(site, module)
    top = _page(site, NAMESPACES[0])
    missing, no_example = [], []
    for name in module.__all__:
        obj = getattr(module, name)
        if isinstance(obj, types.ModuleType):
            continue
        if f'id="{module.__name__}.{name}"' in page:
            entry = page.split(f'id="{module.__name__}.{name}"', 1)[1]
        elif (f'href="jreplicate.html#jreplicate.{name}"' in page
              and f'id="jreplicate.{name}"' in top):  # a top-level name, documented there
            entry = top.split(f'id="jreplicate.{name}"', 1)[1]
        else:
            missing.append(name)
            continue
        # The entry (up to the next top-level entry) shows the docstring's example.
        entry = re.split(r'<dl class="py (?:class|function|data|exception)">', entry)[0]
        if ">>>" in (inspect.getdoc(obj) or "") and "&gt;&gt;&gt;" not in entry:
            no_example.append(name)
    assert not missing, f"{module.__name__}: no entry in docs/api for {missing}"
    assert not no_example, f"{module.__name__}: the entry lacks the example of {no_example}"


def test_every_notebook_and_guide_is_a_page(site):
    notebooks = sorted(p.stem for p in (ROOT / "colab").glob("*.ipynb"))
    linked = sorted(p.stem for p in (DOCS / "notebooks").glob("*.ipynb"))
    assert linked == notebooks, "link each colab/ notebook into docs/notebooks/"
    for stem in notebooks:
        html = (site / "notebooks" / f"{stem}.html").read_text()
        assert "cell_output" in html, f"{stem}: rendered without its stored outputs"
    for guide in (DOCS / "guides").glob("*.md"):
        assert (site / "guides" / f"{guide.stem}.html").exists(), guide


def _entries(site):
    """``(kind, id, body)`` of every entry of the API pages (body: up to the next entry)."""
    for path in sorted((site / "api").glob("*.html")):
        parts = re.split(r'<dl class="py (\w+)">\s*<dt[^>]*id="([^"]+)"', path.read_text())
        yield from zip(parts[1::3], parts[2::3], parts[3::3])


def test_constants_show_their_own_documentation(site):
    """A re-exported constant shows the ``#:`` comment of its assignment, not the
    docstring of ``str`` (autodoc reads comments only in the documented module)."""
    bodies = {name: body for _, name, body in _entries(site)}
    for name, words in [("jreplicate.MODEL_AXIS", "logical devices of one replica"),
                        ("jreplicate.REPLICA_AXIS", "enumerating replicas"),
                        ("jreplicate.checkpoint.COMMIT_MARKER", "last act of a save")]:
        assert words in bodies[name], name
    leaked = [name for name, body in bodies.items() if "bytes_or_buffer" in body]
    assert not leaked, f"the docstring of str shown for {leaked}"


def test_no_namedtuple_boilerplate(site):
    for _, name, body in _entries(site):
        assert "Create new instance of" not in body, name
        assert "Alias for field number" not in body, name


def _public_properties():
    for module in NAMESPACES:
        for name in module.__all__:
            cls = getattr(module, name)
            if not isinstance(cls, type):
                continue
            for attr, value in vars(cls).items():
                if isinstance(value, property) and not attr.startswith("_"):
                    yield f"{module.__name__}.{name}.{attr}", inspect.getdoc(value) or ""


def test_property_docstrings_have_no_bogus_type():
    """Napoleon reads a property docstring whose first line holds a colon ("X: ...") as
    "TYPE: description", and shows the words before the colon as the property's type."""
    from sphinx.ext.napoleon import Config, GoogleDocstring

    bogus = [name for name, doc in _public_properties()
             if ":type:" in str(GoogleDocstring(doc, Config(), what="property", name=name))]
    assert not bogus, f"reword the first line of these docstrings (no colon): {bogus}"


def test_properties_render_without_a_type_field(site):
    typed = [name for kind, name, body in _entries(site)
             if kind == "property" and 'Type<span class="colon">' in body]
    assert not typed, f"napoleon read the first line as a type: {typed}"
    bodies = {name: body for _, name, body in _entries(site)}
    for name in ["jreplicate.ReplicaContext.batch_mask", "jreplicate.Replicator.mesh",
                 "jreplicate.InputIterator.prefetching", "jreplicate.MultiWorkerStrategy.cluster",
                 "jreplicate.strategies.Layout.first_devices",
                 "jreplicate.strategies.Strategy.worker_index"]:
        assert name in bodies, name


def test_changelog_is_a_page(site):
    html = (site / "changelog.html").read_text()
    first_entry = next(line for line in (ROOT / "CHANGELOG.md").read_text().splitlines()
                       if line.startswith("## "))
    assert "<h1>Changelog" in html and first_entry[3:].split(" (")[0] in html
    assert 'href="changelog.html"' in (site / "index.html").read_text()


def test_front_page_has_pitch_install_example_and_version(site):
    import jreplicate

    html = (site / "index.html").read_text()
    text = re.sub(r"<[^>]+>", "", html)
    assert f"Version {jreplicate.__version__}" in text
    assert "pip install -e ." in text
    assert "JAX form of TensorFlow" in text  # the README's pitch
    assert "rep.run(step, inputs, params, opt_state)" in text  # the README's example
    assert 'class="highlight-python' in html
    for page in ["guides/getting_started.html", "porting/index.html", "notebooks.html",
                 "api/index.html", "changelog.html"]:
        assert f'href="{page}"' in html, page


def test_notebooks_are_listed_in_reading_order(site):
    html = (site / "notebooks.html").read_text()
    at = [html.find(f'href="notebooks/{stem}.html"') for stem in
          ("quickstart", "model_parallel_and_device_loops", "parameter_server")]
    assert -1 not in at and at == sorted(at), at
