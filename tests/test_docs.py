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
