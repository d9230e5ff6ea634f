"""``pip install .`` (not only ``-e``): the wheel alone runs the main job from any folder.

A wheel is built from a copy of the repository's tracked files, installed into a fresh
virtual environment, and run from a folder outside the repository.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent

# Building the wheel, making the venv and three runs: 35 to 45 s on two CPU cores.
pytestmark = pytest.mark.slow


@dataclass
class Installed:
    """A fresh virtual environment with the nip_like wheel installed."""

    wheel: Path
    venv: Path
    python: Path
    site_packages: Path
    env: dict[str, str]
    cache: Path


def _tracked_files() -> list[str]:
    try:
        result = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "ls-files", "-z"], capture_output=True, text=True, timeout=60
        )
    except OSError:
        pytest.skip("git is not available")
    if result.returncode != 0:
        pytest.skip("not a git checkout")
    return [name for name in result.stdout.split("\0") if name]


def _copy_tracked_files(destination: Path) -> list[str]:
    """Copy the tracked files (links as links) to ``destination``; return their names."""
    names = [name for name in _tracked_files() if os.path.lexists(REPO_ROOT / name)]
    for name in names:
        target = destination / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO_ROOT / name, target, follow_symlinks=False)
    return names


def _check(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, **kwargs)
    assert result.returncode == 0, f"{command} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    root = tmp_path_factory.mktemp("install")
    # Neither the build nor the runs may see the checkout through PYTHONPATH.
    base_env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME")}

    # Build from a copy, so that build/ and *.egg-info land there and not in the checkout,
    # and so that only tracked files can reach the wheel. The isolated build gets setuptools
    # and wheel from pip's configured index, as `pip install -e` does.
    source = root / "src"
    _copy_tracked_files(source)
    dist = root / "dist"
    _check([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(dist), str(source)], env=base_env)
    (wheel,) = dist.glob("nip_like-*.whl")

    venv = root / "venv"
    _check([sys.executable, "-m", "venv", str(venv)], env=base_env)
    python = venv / "bin" / "python"
    site_packages = Path(
        _check([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], env=base_env)
        .stdout.strip()
    )
    # The dependencies (torch, torchrl, hydra, ...) come from the running interpreter's
    # site-packages through a .pth file: installing them would need the network and
    # several GB of torch. This still proves that the wheel is enough for nip_like itself:
    # a folder named in a .pth file is only appended to sys.path, its own .pth files (such
    # as the editable install's finder of this checkout) are not processed, and the new
    # venv's site-packages, where the wheel goes, comes first on sys.path.
    # (test_installed_package_comes_from_the_wheel checks where nip_like is imported from.)
    parent = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (site_packages / "_nip_like_test_dependencies.pth").write_text("\n".join(parent) + "\n")
    # --ignore-installed: the parent environment's nip_like is visible through the .pth
    # file; pip must not try to replace it, only install the wheel into the new venv.
    _check(
        [str(python), "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed", str(wheel)],
        env=base_env,
    )

    # Runs write no caches under the real home: the main job's datasets and pretrained
    # agents go to `cache` (overrides), anything else (matplotlib, Hugging Face) under a tmp HOME.
    home = root / "home"
    home.mkdir()
    env = {**base_env, "HOME": str(home), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("XDG_CACHE_HOME", None)
    return Installed(wheel, venv, python, site_packages, env, root / "cache")


def _run(installed: Installed, command: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=cwd, env=installed.env, capture_output=True, text=True, timeout=300)


def _assert_ran_in(result: subprocess.CompletedProcess, folder: Path) -> None:
    assert result.returncode == 0, f"exit status {result.returncode}:\n{result.stdout}\n{result.stderr}"
    assert "Final test metrics" in result.stdout, result.stdout
    assert "test/accuracy" in result.stdout, result.stdout
    runs = [summary.parent for summary in (folder / "outputs").glob("*/*/summary.json")]
    assert len(runs) == 1, f"expected one run folder under {folder / 'outputs'}, found {runs}"
    assert f"Final test metrics ({runs[0]})" in result.stdout, result.stdout


def test_wheel_ships_every_package_file(installed):
    """Every tracked file of the package (modules and the Hydra configs) is in the wheel."""
    tracked = {name for name in _tracked_files() if name.startswith("nip_like/")}
    with zipfile.ZipFile(installed.wheel) as wheel:
        shipped = set(wheel.namelist())
    assert "nip_like/configs/config.yaml" in shipped
    assert not tracked - shipped, f"missing from the wheel: {sorted(tracked - shipped)}"


def test_installed_package_comes_from_the_wheel(installed, tmp_path):
    result = _check(
        [str(installed.python), "-c", "import nip_like; print(nip_like.__file__)"], cwd=tmp_path, env=installed.env
    )
    module = Path(result.stdout.strip())
    assert module.is_relative_to(installed.site_packages), f"nip_like imported from {module}, not the new venv"


def test_main_job_runs_from_another_folder(installed, tmp_path):
    """``python -m nip_like run.test_run=true``: the main job (graph isomorphism, NIP), every loop once."""
    command = [
        str(installed.python),
        "-m",
        "nip_like",
        "run.test_run=true",
        "run.progress_bar=false",
        f"scenario.cache_dir={installed.cache / 'datasets'}",
        f"trainer.pretrain.cache_dir={installed.cache / 'pretrained'}",
    ]
    result = _run(installed, command, tmp_path)
    _assert_ran_in(result, tmp_path)
    assert "graph_isomorphism_nip" in result.stdout


def test_console_script_runs_from_another_folder(installed, tmp_path):
    """``nip-like`` with a preset of the user's own, added with ``--config-dir`` (docs/quickstart.rst)."""
    presets = tmp_path / "my_configs" / "preset"
    presets.mkdir(parents=True)
    (presets / "mine.yaml").write_text("# @package _global_\ndefaults:\n  - smoke\nname: my_run\n")
    command = [
        str(installed.venv / "bin" / "nip-like"),
        "--config-dir",
        "my_configs",
        "preset=mine",
        "run.test_run=true",
        "run.progress_bar=false",
    ]
    result = _run(installed, command, tmp_path)
    _assert_ran_in(result, tmp_path)
    assert "_my_run)" in result.stdout, result.stdout


def test_install_without_the_configs_fails_clearly(installed, tmp_path):
    """Without the package data, the run stops with one line naming the missing folder."""
    configs = installed.site_packages / "nip_like" / "configs"
    aside = configs.with_name("configs.aside")
    configs.rename(aside)
    try:
        result = _run(installed, [str(installed.python), "-m", "nip_like", "run.test_run=true", "preset=smoke"], tmp_path)
    finally:
        aside.rename(configs)
    assert result.returncode == 2, f"exit status {result.returncode}:\n{result.stdout}\n{result.stderr}"
    assert "error: config: Primary config directory not found" in result.stderr
    assert str(configs) in result.stderr
    assert not (tmp_path / "outputs").exists()
