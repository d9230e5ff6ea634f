"""Sphinx configuration of the nip_like documentation."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

# The repository root, so that autodoc imports the package from this checkout.
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# Local extensions (docs/_ext): tables drawn from the registries and the config folder.
sys.path.insert(0, str(ROOT / "docs" / "_ext"))

project = "nip_like"
author = "nip_like maintainers"
copyright = "nip_like maintainers"
release = "0.1.0"
version = "0.1"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "component_tables",
]

# Numpy-style docstrings only.
napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_rtype = False
napoleon_use_ivar = True

autodoc_default_options = {
    "members": True,
    "show-inheritance": True,
}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_class_signature = "mixed"

nitpicky = False

templates_path: list[str] = []
exclude_patterns = ["_build", "examples/outputs", "Thumbs.db", ".DS_Store"]

html_theme = "alabaster"
html_title = "nip_like"
html_theme_options = {
    "description": "Reinforcement learning for interactive games on TorchRL and TensorDict",
    "fixed_sidebar": True,
    "page_width": "1100px",
    "sidebar_width": "240px",
}
html_static_path: list[str] = []


def _constructor_signature(app, what, name, obj, options, signature, return_annotation):
    """Show ``__init__``'s parameters for classes whose metaclass hides them.

    TorchRL's ``EnvBase`` and ``LossModule`` have metaclasses whose
    ``__call__(*args, **kwargs)`` autodoc would otherwise show as the class
    signature.
    """
    if what != "class" or signature != "(*args, **kwargs)" or "__init__" not in vars(obj):
        return None
    parameters = list(inspect.signature(obj.__init__).parameters.values())[1:]
    plain = [parameter.replace(annotation=inspect.Parameter.empty) for parameter in parameters]
    return str(inspect.Signature(plain)), return_annotation


def setup(app):
    app.connect("autodoc-process-signature", _constructor_signature)
