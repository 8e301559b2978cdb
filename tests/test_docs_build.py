"""The documentation site builds nitpicky (every reference resolves) with no warning, and
every public name of every namespace has its entry, with its example, in the API pages
(a new public name without documentation fails here). Notebooks are rendered as stored,
not executed (they run in tests/test_notebooks.py; the guides' code runs in
tests/test_docs_examples.py). Also checked on the built HTML, as a reader meets it: every
link to an anchor lands on one, tables keep long code inside their column, figures have
captions, copy buttons copy runnable code without prompts, notebooks can be downloaded."""

import html
import inspect
import json
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
def build(tmp_path_factory):
    """The site built nitpicky with warnings as errors (``-n -W --keep-going``, so a
    warning still builds every page): the process, and the html folder, which the other
    tests read even where ``test_the_build_is_clean`` fails."""
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "sphinx", "-n", "-W", "--keep-going", "-q", "-b", "html",
         "-d", str(out / ".doctrees"), str(DOCS), str(out / "html")],
        capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert (out / "html" / "index.html").exists(), proc.stdout + proc.stderr
    print(f"docs built in {time.monotonic() - start:.1f} s")
    return out / "html", proc


@pytest.fixture(scope="module")
def site(build):
    return build[0]


def test_the_build_is_clean(build):
    """No warning in a nitpicky build (``-n -W``): a name in a docstring or page that
    links nowhere (a typo, a moved object, a library name missing from
    docs/_ext/offline_inventories.py) fails here, as any other warning does."""
    _, proc = build
    assert proc.returncode == 0 and "WARNING" not in proc.stderr, proc.stdout + proc.stderr


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


# --- The site as a reader meets it -------------------------------------------------------

def test_api_pages_show_public_paths_only(site):
    """A library class appears under its public name (``Layout.mesh`` showed
    ``jax._src.mesh.Mesh``, its ``__module__``), linked to its library's documentation."""
    for page in sorted((site / "api").glob("*.html")):
        text = _text(page.read_text())
        private = sorted(set(re.findall(r"[\w.]*\._(?:src|jax)\.[\w.]*", text)))
        assert not private, f"{page.name}: {private}"
    strategies = (site / "api" / "jreplicate.strategies.html").read_text()
    assert 'href="https://docs.jax.dev/en/latest/jax.sharding.html#jax.sharding.Mesh"' in (
        strategies)


def _ids(page: pathlib.Path, cache: dict) -> set[str] | None:
    if page not in cache:
        cache[page] = set(re.findall(r'\sid="([^"]+)"', page.read_text())) if page.exists() \
            else None
    return cache[page]


def test_every_link_to_an_anchor_lands_on_one(site):
    """Every internal link with a ``#fragment`` (the API's "[source]" links into
    ``_modules/``, viewcode's "[docs]" links back, cross-references, tables of contents)
    names an id of its target page. viewcode once linked ``CheckpointError``'s source
    back to ``#jreplicate.CheckpointError``: it names one documenting module per source
    file, and ``CheckpointManager``, defined beside it, is documented at the top level."""
    cache, broken, count = {}, [], 0
    for page in sorted(site.rglob("*.html")):
        for path, fragment in re.findall(r'href="([^"#:?]*\.html)?#([^"]+)"', page.read_text()):
            target = (page.parent / path).resolve() if path else page
            count += 1
            ids = _ids(target, cache)
            if ids is None or html.unescape(fragment) not in ids:
                broken.append(f"{page.relative_to(site)} -> {path}#{fragment}")
    assert count > 500, count  # the API's source links, the back-links, the cross-references
    assert not broken, "\n".join(broken)


def _text(fragment: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", fragment))


def test_name_tables_keep_long_code_inside_their_column(site):
    """The porting guide's three-column name tables fit the content column: the
    stylesheet lets table code wrap (``overflow-wrap: anywhere`` also narrows the column
    in the browser's layout), and ``<wbr>`` after each dot makes a name break where a
    reader splits it. The text is unchanged."""
    names = (site / "porting" / "names.html").read_text()
    assert '<link rel="stylesheet" type="text/css" href="../_static/tables.css' in names
    css = re.sub(r"\s+", " ", (site / "_static" / "tables.css").read_text())
    assert re.search(r"table\.docutils td code\.literal,[^{]*\{ overflow-wrap: anywhere; \}",
                     css), css
    tables = re.findall(r'<table class="docutils[^"]*">(.*?)</table>', names, re.S)
    three_columns = [t for t in tables if len(re.findall(r"<th[ >]", t)) == 3]
    assert len(three_columns) == len(tables) >= 6, (len(three_columns), len(tables))
    for table in three_columns:
        codes = re.findall(r"<code[^>]*>(.*?)</code>", table, re.S)
        assert any("<wbr>" in c for c in codes)
        for code in codes:  # a break opportunity after a dot only, never inside a word
            assert not re.search(r"[^.,(=]<wbr>", code.replace('</span>', '')), code
    assert "tf.distribute.experimental.CentralStorageStrategy" in _text(names)


def test_figures_are_captioned_at_the_column_width(site):
    """Every figure of the guides and the benchmark pages is a captioned figure as wide
    as the content column (they were 48 % wide, two abreast, with no caption)."""
    pages = sorted((site / "guides").glob("*.html")) + sorted(
        (site / "benchmarks").rglob("*.html"))
    seen = 0
    for page in pages:
        text = page.read_text()
        images = re.findall(r"<img [^>]*>", text)
        figures = re.findall(r"<figure[^>]*>(.*?)</figure>", text, re.S)
        captioned = [f for f in figures if re.search(r"<figcaption>\s*<p>.{20,}</p>", f, re.S)]
        assert len(captioned) == len(images), f"{page.name}: an image without a caption"
        for img in images:
            assert 'style="width: 100%;"' in img, f"{page.name}: {img}"
        seen += len(images)
    assert seen >= 10, seen  # performance (4), sync_replicas (1), the 2026-11-25 report (5)
    performance = _text((site / "guides" / "performance.html").read_text())
    assert "Device loops: steps per second of run(..., steps=K) against K" in performance


def _copy_button_text(js: str, block: str) -> str:
    """What a copy button copies from ``block``: ``formatCopyText`` of
    sphinx-copybutton, with the arguments the built ``copybutton.js`` passes it (the
    prompt regex, prompt lines only, prompts removed, empty lines kept)."""
    call = re.search(r"return formatCopyText\(text, '((?:[^'\\]|\\.)*)', (\w+), (\w+), (\w+), "
                     r"(\w+), '', ''\)", js)
    assert call, "copybutton.js does not call formatCopyText as configured"
    prompt = call[1].encode().decode("unicode_escape")
    assert call.groups()[1:] == ("true", "true", "true", "true"), call.groups()
    lines, found = [], False
    for line in block.split("\n"):
        m = re.match(f"^({prompt})(.*)", line)
        if m:
            found = True
            lines.append(m[2])
        elif not line.strip():
            lines.append(line)
    return ("\n".join(lines) if found else block).removesuffix("\n")


def test_copy_buttons_copy_the_examples_without_prompts(site):
    """The copy button of every ``>>>`` example of the API pages copies runnable code: no
    ``>>>`` or ``...`` prompt, no output line."""
    api = (site / "api" / "jreplicate.html").read_text()
    assert '<script src="../_static/copybutton.js' in api
    js = (site / "_static" / "copybutton.js").read_text()
    copied = 0
    for page in sorted((site / "api").glob("*.html")):
        for block in re.findall(r'<div class="doctest highlight[^"]*"><div class="highlight">'
                                r"<pre>(.*?)</pre>", page.read_text(), re.S):
            code = _copy_button_text(js, _text(block))
            assert ">>>" not in code and not re.search(r"^\.\.\.", code, re.M), code
            compile(code, f"{page.name}: copied example", "exec")
            copied += 1
    assert copied >= 30, copied
    # A continuation line keeps its code, an empty one ("...") stays empty, outputs go.
    assert _copy_button_text(js, ">>> def f(x):\n...     return x\n...\n>>> f(1)\n1") == (
        "def f(x):\n    return x\n\nf(1)")


def test_notebooks_download_and_colab_only_with_a_repository(site):
    """Each notebook page links its ``.ipynb`` as a download (the file is in the site);
    "Open in Colab" appears only when pyproject.toml names the repository."""
    import tomllib

    urls = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"].get("urls", {})
    for notebook in sorted((ROOT / "colab").glob("*.ipynb")):
        page = (site / "notebooks" / f"{notebook.stem}.html").read_text()
        links = re.search(r'<p class="notebook-links">(.*?)</p>', page, re.S)
        assert links, f"{notebook.stem}: no links under the title"
        href = re.search(r'<a class="reference download internal" download="" '
                         r'href="([^"]+)"', links[1])
        assert href and href[1].endswith(f"/{notebook.name}"), links[1]
        served = (site / "notebooks" / href[1]).resolve()
        assert served.read_bytes() == notebook.read_bytes()
        json.loads(served.read_text())  # a notebook, not a page
        assert ("colab.research.google.com" in links[1]) == ("Repository" in urls)


def _extension(name: str):
    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(DOCS / "_ext"))


def test_colab_url_from_the_repository_url():
    from sphinx.errors import ConfigError

    colab_url = _extension("notebook_links").colab_url
    want = ("https://colab.research.google.com/github/org/jreplicate/blob/main/"
            "colab/quickstart.ipynb")
    for url in ("https://github.com/org/jreplicate", "https://github.com/org/jreplicate/",
                "https://github.com/org/jreplicate.git"):
        assert colab_url(url, "colab/quickstart.ipynb") == want
    assert colab_url(None, "colab/quickstart.ipynb") is None
    assert colab_url("", "colab/quickstart.ipynb") is None
    with pytest.raises(ConfigError, match=r"Repository.*github\.com/OWNER/REPO"):
        colab_url("https://gitlab.com/org/jreplicate", "colab/quickstart.ipynb")


def test_offline_inventories_name_real_objects_and_load(tmp_path):
    """Every name the offline inventories link is an object of the installed library (a
    typo would link a page that does not have it), a private runtime path is shown under
    its public name, and each inventory loads as intersphinx reads it."""
    import builtins

    from sphinx.util.inventory import InventoryFile

    inv = _extension("offline_inventories")
    for key, project in inv.PROJECTS.items():
        for name, _ in project.entries:
            found = (inv.lookup(name) is not None) if "." in name else name in vars(builtins)
            assert found, f"{key}: {name} is not an object of the installed library"
        inv.write_inventory(tmp_path / f"{key}.inv", project)
        loaded = InventoryFile.loads((tmp_path / f"{key}.inv").read_bytes(), uri=project.url)
        data = getattr(loaded, "data", loaded)  # Sphinx >= 9: an _Inventory
        for (name, role), page in project.entries.items():
            item = data[role][name]
            uri = item.uri if hasattr(item, "uri") else item[2]
            assert uri == project.url + page.replace("$", name)
    mesh = inv.runtime_path("jax.sharding.Mesh")
    assert mesh and mesh.startswith("jax._src.")  # as autodoc writes it in signatures
    assert f"{mesh} py:class 1 jax.sharding.html#jax.sharding.Mesh jax.sharding.Mesh" in (
        inv.inventory_lines(inv.PROJECTS["jax"]))


def test_jreplicate_references_resolve_by_identity_and_typos_still_fail(tmp_path):
    """docs/_ext/api_references.py resolves a name to the entry documenting the same
    object and shows an existing undocumented module as text, but hides nothing else: a
    name that does not exist, or an undocumented class, still fails the build."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "conf.py").write_text(
        f"import sys\nsys.path.insert(0, {str(DOCS / '_ext')!r})\n"
        "extensions = ['sphinx.ext.autodoc', 'api_references']\nnitpicky = True\n")
    (src / "index.rst").write_text(
        "Page\n====\n\n.. autoclass:: jreplicate.strategies.Layout\n   :no-members:\n\n"
        ":class:`jreplicate.layout.Layout` :mod:`jreplicate.ps.placement` "
        ":class:`jreplicate.NoSuchThing` :mod:`jreplicate.no_such_module` "
        ":class:`jreplicate.ps.placement.Placement`\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "sphinx", "-q", "-b", "html", str(src), str(tmp_path / "out")],
        capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    unresolved = sorted(re.findall(r"reference target not found: (\S+)", proc.stderr))
    assert unresolved == ["jreplicate.NoSuchThing", "jreplicate.no_such_module",
                          "jreplicate.ps.placement.Placement"], proc.stderr
    page = (tmp_path / "out" / "index.html").read_text()
    assert 'href="#jreplicate.strategies.Layout"' in page  # the defining path, resolved
