"""Sphinx configuration of jreplicate's documentation (built as optax and Flax build theirs).

Build locally: ``python -m sphinx -W --keep-going -b html docs docs/_build/html``; the
build is nitpicky (every reference must resolve), as in tests/test_docs_build.py.
Notebooks (colab/) are rendered with their stored outputs, never executed here: they run
in tests/test_notebooks.py, the guides' code in tests/test_docs_examples.py. This site's
own extensions are in docs/_ext/, each saying what it fixes.
"""

import os
import pathlib
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "docs" / "_ext"))  # this site's own extensions
# Importing jreplicate imports JAX; a CPU backend is all autodoc needs.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jreplicate  # noqa: E402

project = "jreplicate"
author = "the jreplicate authors"
copyright = "the jreplicate authors"  # noqa: A001
release = version = jreplicate.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.intersphinx",
    "sphinx.ext.viewcode",
    "myst_nb",
    "sphinx_copybutton",
    "offline_inventories",  # links to Python/JAX/optax/Flax/NumPy names, no network
    "api_references",  # jreplicate names documented under another path; viewcode anchors
    "table_code_breaks",  # long code in table cells wraps after its dots, not past the column
    "notebook_links",  # "Download" (and "Open in Colab") atop each notebook page
]

source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "**.ipynb_checkpoints", "README.md"]
master_doc = "index"

# The API pages list their names by hand (an autosummary table, then each name's full
# entry): no stub pages are generated into the source tree.
autosummary_generate = False
autodoc_default_options = {"members": True, "show-inheritance": False}
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
autoclass_content = "both"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

# Every reference must resolve (tests/test_docs_build.py builds with -n -W). Links to
# the libraries the docstrings name come from docs/_ext/offline_inventories.py, which
# writes their inventories at build time (no network): add a newly referenced name there.
nitpicky = True
intersphinx_mapping = {}
# Internal types that public signatures return or take: each is described where it
# appears (the method's docstring), and documenting them would make them API.
nitpick_ignore = [
    # Strategy.agreement(): the strategy protocol's seam to the executors (written
    # "Agreement" where the annotation is imported for type checking only).
    ("py:class", "jreplicate.cluster.agreement.Agreement"),
    ("py:class", "Agreement"),
    # ParameterServerStrategy.make_executor(): the protocol's seam, as for Agreement.
    ("py:class", "jreplicate.ps.executor.ParameterServerExecutor"),
    # ParameterServerStrategy.placement: its docstring says how to read it (shard_of).
    ("py:class", "jreplicate.ps.placement.Placement"),
    # ParameterServerStrategy.restart_shard(): its fields are listed in "Returns".
    ("py:class", "jreplicate.ps.shard_restart.ShardRestart"),
    # jr.ps.pushable(): an optax transformation equal to tx, as its "Returns" says.
    ("py:class", "jreplicate.ps.capture.PushableTransformation"),
]

# Notebooks are stored executed; the guides' code runs in the tests.
nb_execution_mode = "off"
# The repository's public URL has one home, pyproject.toml's [project.urls] Repository.
# With it, each notebook page links "Open in Colab"; without it (no public repository
# yet) only the notebook's download, which needs no URL.
_URLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"].get("urls", {})
notebook_repository_url = _URLS.get("Repository")
notebook_branch = "main"
myst_enable_extensions = ["colon_fence", "deflist", "substitution"]
myst_substitutions = {"release": release}  # the front page states the version
myst_heading_anchors = 3

html_theme = "furo"
html_title = "jreplicate"
html_static_path = ["_static"]
html_css_files = ["tables.css"]  # long code in table cells wraps inside the cell

# Copy buttons on code blocks copy the code alone: the ">>> " and "... " prompts of
# doctest examples (a bare "..." is an empty continuation line) and "$ " of shell lines
# are removed, and a block with prompts copies only its prompt lines (not the outputs).
copybutton_prompt_text = r">>> |\.\.\. |\.\.\.$|\$ "
copybutton_prompt_is_regexp = True
copybutton_only_copy_prompt_lines = True



# --- Docstring fixes applied as autodoc reads the docstrings ---------------------------

def _module_comment(name: str, obj) -> list[str] | None:
    """The ``#:`` comment above ``name``'s assignment in the jreplicate module defining it.

    A constant re-exported by a namespace (``jreplicate.MODEL_AXIS``, defined in
    jreplicate/layout.py) has its comment in the defining module, which autodoc does not
    read: it would show the docstring of the value's type (``str``) instead.
    """
    from sphinx.pycode import ModuleAnalyzer

    attr = name.rsplit(".", 1)[-1]
    for modname in sorted(sys.modules):
        module = sys.modules[modname]
        if not modname.startswith("jreplicate") or getattr(module, attr, None) is not obj:
            continue
        try:
            comment = ModuleAnalyzer.for_module(modname).find_attr_docs().get(("", attr))
        except Exception:  # noqa: BLE001 - a module without source: try the next one
            continue
        if comment:
            return list(comment)
    return None


def _fix_docstring(app, what, name, obj, options, lines):
    """Documentation of constants, and no NamedTuple boilerplate, in the API pages."""
    if what == "data" and getattr(obj, "__doc__", None) == type(obj).__doc__:
        comment = _module_comment(name, obj)
        if comment is None:
            from sphinx.util import logging as sphinx_logging

            sphinx_logging.getLogger(__name__).warning(
                "%s has no documentation: put a '#:' comment above its assignment", name)
        lines[:] = comment or []
    elif what == "class" and hasattr(obj, "_fields"):  # a NamedTuple: drop __new__'s doc
        boilerplate = f"Create new instance of {obj.__name__}({', '.join(obj._fields)})"
        lines[:] = [line for line in lines if line != boilerplate]
    elif what in ("attribute", "property") and len(lines) <= 2 and lines and (
            lines[0].startswith("Alias for field number ")):
        lines[:] = []


def setup(app):
    app.connect("autodoc-process-docstring", _fix_docstring)
