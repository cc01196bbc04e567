"""Sphinx configuration of the apex_amp documentation site.

Build (warnings are errors), from the repository root:

    .venv/bin/python -m sphinx -W --keep-going -b html docs docs/_build/html

tests/test_docs.py runs the same build, checks every internal link of the result, runs every
Python code block of the pages and checks that the generated O1 table is current.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The API reference imports apex_amp from this checkout, and the compat `apex` package from its
# folder (it is a separate distribution, installed only on request).
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "compat" / "apex"))

import apex_amp  # noqa: E402

project = "apex_amp"
author = "apex_amp developers"
copyright = "apex_amp developers, BSD-3-Clause"
release = version = apex_amp.__version__

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

# Markdown: "#anchor" links to headings of level 1-3, as GitHub makes them.
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_typehints = "description"
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "furo"
html_title = f"apex_amp {release}"
html_static_path: list[str] = []
