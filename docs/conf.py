"""Sphinx configuration of the cpsparse documentation (built with -W in CI)."""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))

import cpsparse  # noqa: E402

project = "cpsparse"
author = "the cpsparse developers"
copyright = "2026, the cpsparse developers"
release = cpsparse.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.doctest",
    "sphinx.ext.intersphinx",
    "numpydoc",
    "myst_parser",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "performance_*.md"]
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

autosummary_generate = True
autodoc_default_options = {"members": False}
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False
# numpydoc validation of every docstring the API pages render, methods included (a
# failure is a warning, and the build runs with -W): no unknown, untyped or misordered
# parameter, a summary line, known section names, Yields for generators.
# tests/test_docs.py adds PR01/RT01/GL08 (every parameter and return documented) for
# the objects docs/api.md lists.
numpydoc_validation_checks = {"GL06", "SS01", "PR02", "PR03", "PR04", "PR06", "PR10", "YD01"}

doctest_global_setup = "import numpy as np\nimport cpsparse"
intersphinx_mapping = {}

html_theme = "alabaster"
html_static_path = []
html_title = f"cpsparse {release}"
