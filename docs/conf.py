"""Sphinx configuration for the sharedarrays documentation (Markdown pages via MyST)."""

from __future__ import annotations

import os
import sys
from importlib import metadata

# Document the working tree even when the package is not installed (PYTHON_ENV=system).
sys.path.insert(0, os.path.abspath(".."))

project = "sharedarrays"
author = "sharedarrays contributors"
copyright = "sharedarrays contributors"
try:
    release = metadata.version("sharedarrays")
except metadata.PackageNotFoundError:
    release = "0+unknown"
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "myst_parser",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

# MyST: Markdown with directives ({eval-rst}, {toctree}) and anchors for headings.
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# autodoc + napoleon (NumPy-style docstrings).
autodoc_typehints = "description"
autodoc_member_order = "bysource"
autodoc_default_options = {"show-inheritance": True}
napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_rtype = False

# Unresolvable cross-references (third-party types in signatures) are not errors.
nitpicky = False

html_theme = "alabaster"
html_title = "sharedarrays"
