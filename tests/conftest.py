"""Shared fixtures: compose configs in-process and run the CLI in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import DictConfig

from nip_like.cli import compose_config

REPO_ROOT = Path(__file__).resolve().parent.parent


def make_config(*overrides: str) -> DictConfig:
    """Compose the experiment config with ``overrides`` (no Hydra run folder).

    Unless the overrides pick a preset, ``preset=none``: tests start from the
    group defaults (the seconds-long hidden-bits game), not from the main job's
    graph-isomorphism preset.
    """
    if not any(override.startswith("preset=") for override in overrides):
        overrides = ("preset=none", *overrides)
    return compose_config(list(overrides))


def smoke_config(*overrides: str) -> DictConfig:
    """The ``smoke`` preset, quiet: no progress bars, no CSV files."""
    return make_config("preset=smoke", "run.progress_bar=false", "logger=none", "run.num_threads=1", *overrides)


def run_cli(args: list[str], cwd: Path | None = None, module: str = "nip_like", timeout: int = 300):
    """Run ``python -m <module> args`` and return the completed process."""
    # Tiny models run fastest on one thread, and tests may run beside other work.
    env = {**os.environ, "PYTHONPATH": str(cwd or REPO_ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd or REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def config_factory():
    """Return :func:`smoke_config`."""
    return smoke_config
