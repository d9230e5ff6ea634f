"""Every ``python -m nip_like`` command of docs/shared_models.rst runs, at test-run size (``run.test_run=true``)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from nip_like.experiment import run_experiment
from tests.conftest import REPO_ROOT, make_config

PAGE = REPO_ROOT / "docs" / "shared_models.rst"
COMMAND = "python -m nip_like "
RUN_DIR = "hydra.run.dir="


def documented_commands(page: Path) -> list[list[str]]:
    """The arguments of each ``python -m nip_like`` command in the page's literal blocks (continued lines joined)."""
    commands, pending = [], ""
    for line in page.read_text().splitlines():
        text = line.strip()
        if pending:
            pending += " " + text
        elif line.startswith("   ") and text.startswith(COMMAND):
            pending = text[len(COMMAND):]
        else:
            continue
        if pending.endswith("\\"):
            pending = pending[:-1]
            continue
        commands.append(shlex.split(pending, comments=True))
        pending = ""
    return commands


def test_the_page_has_commands_and_each_names_a_quick_preset():
    commands = documented_commands(PAGE)
    assert len(commands) >= 4
    for args in commands:
        assert "preset=lm_quick" in args, args


@pytest.mark.slow
def test_every_documented_command_runs_at_test_run_size(tmp_path):
    folders: dict[str, Path] = {}  # a command's hydra.run.dir, as the page names it -> where the test runs it
    for number, args in enumerate(documented_commands(PAGE)):
        named = [arg[len(RUN_DIR):] for arg in args if arg.startswith(RUN_DIR)]
        folder = tmp_path / f"run{number}"
        if named:
            folders[named[0]] = folder
        overrides = []
        for arg in args:
            if arg.startswith(RUN_DIR):
                continue
            for name, path in folders.items():  # a later command that reads an earlier run's folder
                arg = re.sub(rf"(?<![\w/]){re.escape(name)}(?![\w/])", str(path), arg)
            overrides.append(arg)
        config = make_config(*overrides, "run.test_run=true", "run.progress_bar=false", "logger=none")
        OmegaConf.update(config, "scenario.cache_dir", str(tmp_path / "data"))
        OmegaConf.update(config, "trainer.pretrain.cache_dir", str(tmp_path / "pretrained"))
        assert run_experiment(config, folder), args
