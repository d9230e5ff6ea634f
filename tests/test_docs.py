"""The Sphinx documentation builds without a single warning."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

DOCS_DIR = Path(__file__).resolve().parent.parent / "docs"


@pytest.mark.slow
def test_docs_build_without_warnings(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "sphinx",
            "-W",
            "--keep-going",
            "-b",
            "html",
            "-d",
            str(tmp_path / "doctrees"),
            str(DOCS_DIR),
            str(tmp_path / "html"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"sphinx-build failed (exit status {result.returncode}):\n{result.stderr}"


def test_every_public_scenario_module_is_in_the_api_reference():
    api = (DOCS_DIR / "api.rst").read_text()
    package = DOCS_DIR.parent / "nip_like" / "scenarios"
    modules = [
        ".".join(("nip_like", "scenarios", *path.relative_to(package).with_suffix("").parts))
        for path in sorted(package.rglob("*.py"))
        if not path.name.startswith("_")
    ]
    missing = [module for module in modules if f".. automodule:: {module}\n" not in api]
    assert not missing, f"docs/api.rst has no automodule for {missing}"


def test_every_builtin_scenario_has_its_generated_options_table():
    from nip_like.registry import SCENARIOS

    configuration = (DOCS_DIR / "configuration.rst").read_text()
    missing = [
        entry.name
        for entry in SCENARIOS.entries()
        if entry.cls.__module__.startswith("nip_like.")
        and f".. schema-options:: {entry.schema.__module__}.{entry.schema.__qualname__}\n" not in configuration
    ]
    assert not missing, f"docs/configuration.rst has no schema-options table for the scenarios {missing}"
