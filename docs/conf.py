"""Sphinx configuration of jreplicate's documentation (built as optax and Flax build theirs).

Build locally: ``python -m sphinx -W --keep-going -b html docs docs/_build/html``.
Notebooks (colab/) are rendered with their stored outputs, never executed here: they run
in tests/test_notebooks.py, the guides' code in tests/test_docs_examples.py.
"""

import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
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

# Cross-links to the libraries the docstrings name. No network at build time: only
# intersphinx inventories that are already cached would be used, so none are listed.
intersphinx_mapping = {}

# Notebooks are stored executed; the guides' code runs in the tests.
nb_execution_mode = "off"
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

html_theme = "furo"
html_title = "jreplicate"
html_static_path = ["_static"]

