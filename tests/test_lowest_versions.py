"""The language-model code at the lowest transformers and peft that pyproject.toml allows.

pyproject.toml's lower bounds of transformers and peft are the versions tested here (the one place
they are written): :func:`lowest_versions` reads them. The slow test installs exactly those, with the
tokenizers and huggingface_hub releases that this transformers needs (:data:`COMPANIONS`), into a
folder of their own (``pip install --target DIR --no-deps``: four wheels from PyPI, under 10 s), puts
that folder first on PYTHONPATH (everything else, torch included, comes from the test environment),
and in one process there imports every nip_like module, checks that the versions it imported are the
lowest ones from that folder, and runs :data:`SUBSET` of the LM tests.

PyPI is needed for that build; without it the test fails, as a wrong version would. On a machine
without PyPI, set ``NIP_LIKE_OFFLINE_TESTS=1`` to skip it instead (CI reaches PyPI and runs it).

By hand, the same folder runs any test file at the lowest versions::

    .venv/bin/pip install --target /tmp/lowest --no-deps transformers==4.56.0 peft==0.18.0 \
        tokenizers==0.22.2 huggingface_hub==0.36.2
    PYTHONPATH=/tmp/lowest .venv/bin/python -m pytest -n 0 -p no:cacheprovider tests/test_lm_chat.py

(tests that start the CLI hand that PYTHONPATH on: tests/conftest.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

REPO_ROOT = Path(__file__).resolve().parent.parent

#: The packages whose lowest supported version is tested: their ``>=`` bounds in pyproject.toml.
TESTED = ("transformers", "peft")

#: The releases installed beside the lowest transformers because the test environment's own are too
#: new for it (transformers 4.56 wants huggingface_hub<1 and tokenizers<=0.23.0): the newest it
#: accepts, as pip picks for ``transformers==4.56.0``. A new lower bound of transformers may need
#: others; transformers checks them when it is imported, so a mismatch fails the import check below.
COMPANIONS = {"tokenizers": "0.22.2", "huggingface_hub": "0.36.2"}

#: The LM tests run at the lowest versions: in-process tests (no interpreter start-ups), chosen to cover
#: model building from config and from folders of three families, the tokenizers and chat templates,
#: sampling and scoring (the cache argument, left padding, chunks, micro-batches, gradient
#: checkpointing, bfloat16), value heads, save and reload, training in the RL loop in the token and chat
#: views, LoRA training and export through peft, a local text model. About 50 s on one core.
SUBSET = (
    "tests/test_lm_policy.py",
    "tests/test_lm_memory.py",
    "tests/test_lm_chat.py::test_a_built_folder_looks_like_a_download_and_loads_through_the_user_path",
    "tests/test_lm_chat.py::test_with_pad_equal_to_eos_a_message_keeps_its_eos_and_masks_nothing_after_it",
    "tests/test_lm_chat.py::test_micro_batches_by_a_token_budget_give_the_one_pass_gradient",
    "tests/test_lm_chat.py::test_scoring_in_chunks_gives_the_one_pass_scores_and_gradient",
    "tests/test_lm_chat.py::test_gradient_checkpointing_gives_the_same_gradient_and_bfloat16_halves_the_weights",
    "tests/test_lm_chat.py::test_prompts_rendered_together_are_the_template_applied_to_each",
    "tests/test_lm_chat.py::test_the_chat_view_trains_with_lora_and_masks_exactly_the_replies",
    "tests/test_lm_chat.py::test_a_lora_run_exports_merged_standalone_folders",
    "tests/test_lm_chat.py::test_the_chat_view_without_a_model_folder_builds_a_small_one_once",
    "tests/test_lm_chat.py::test_sampling_runs_in_eval_mode_and_gives_every_module_its_mode_back",
    "tests/test_duplicates_scenario.py::test_lm_actor_stores_what_a_teacher_forced_pass_recomputes",
    "tests/test_duplicates_scenario.py::test_every_objective_trains_lm_agents[ppo]",
    "tests/test_duplicates_scenario.py::test_every_objective_trains_lm_agents[grpo]",
    "tests/test_duplicates_scenario.py::test_every_objective_trains_lm_agents[dpo]",
    "tests/test_duplicates_scenario.py::test_best_agents_reload_with_from_pretrained_and_reproduce_the_dev_metric",
    "tests/test_duplicates_scenario.py::test_adapters_added_after_the_warm_start_share_it_with_full_fine_tuning",
    "tests/test_text.py::test_a_local_model_replies_reproducibly_by_seed_and_greedily",
)

#: Imports every nip_like module, then reports the versions of :data:`TESTED` and their
#: dependencies and where each came from.
IMPORTS = """
import importlib, pkgutil
import nip_like
for module in pkgutil.walk_packages(nip_like.__path__, "nip_like."):
    importlib.import_module(module.name)
import peft, transformers, tokenizers, huggingface_hub
for package in (transformers, peft, tokenizers, huggingface_hub):
    print(f"imported {package.__name__} {package.__version__} from {package.__file__}", flush=True)
"""

#: :data:`IMPORTS`, then pytest with the command's arguments, in the same interpreter.
RUNNER = IMPORTS + """
import sys, pytest
sys.exit(pytest.main(sys.argv[1:]))
"""


def _project() -> dict:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]


def _requirement(lines: list[str], name: str) -> Requirement:
    (requirement,) = [Requirement(line) for line in lines if Requirement(line).name == name]
    return requirement


def lowest_versions() -> dict[str, str]:
    """``{name: version}``: the ``>=`` bound of each of :data:`TESTED` in pyproject.toml's dependencies."""
    dependencies = _project()["dependencies"]
    lowest = {}
    for name in TESTED:
        bounds = [spec.version for spec in _requirement(dependencies, name).specifier if spec.operator == ">="]
        assert len(bounds) == 1, f"pyproject.toml: {name} needs exactly one >= bound (the lowest version tested)"
        lowest[name] = bounds[0]
    return lowest


def _environment(overlay: Path | None) -> dict[str, str]:
    # The overlay first, then this checkout; no variables of the outer pytest run (xdist's worker ids).
    path = [str(overlay)] if overlay is not None else []
    environment = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_")}
    environment.update(
        PYTHONPATH=os.pathsep.join([*path, str(REPO_ROOT)]),
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS="1",
    )
    return environment


def _build_overlay(folder: Path, pins: list[str]) -> None:
    # --no-compile: the one process that uses the folder compiles what it imports (a fraction of
    # transformers) instead of pip compiling every module (about 8 s of CPU more).
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    command = [*pip, "--no-deps", "--only-binary=:all:", "--no-compile", "--target", str(folder), *pins]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=600)
        failure = None if result.returncode == 0 else f"exit status {result.returncode}:\n{result.stderr[-3000:]}"
    except subprocess.TimeoutExpired:
        failure = "no answer in 600 s"
    if failure is not None:
        message = f"pip could not install {' '.join(pins)} from PyPI ({failure})"
        if os.environ.get("NIP_LIKE_OFFLINE_TESTS", "") not in ("", "0"):
            pytest.skip(f"NIP_LIKE_OFFLINE_TESTS is set: {message}")
        pytest.fail(f"{message}; set NIP_LIKE_OFFLINE_TESTS=1 to skip this test on a machine without PyPI")


def test_the_supported_ranges_are_bounded_and_the_dev_extra_agrees():
    """Each tested package has one lower and one upper bound; the dev extra's transformers has the same range."""
    project = _project()
    for name in TESTED:
        specifier = _requirement(project["dependencies"], name).specifier
        assert sorted(spec.operator for spec in specifier) == ["<", ">="], f"{name}: {specifier}"
    main = _requirement(project["dependencies"], "transformers").specifier
    dev = _requirement(project["optional-dependencies"]["dev"], "transformers")
    assert dev.extras == {"serving"}
    assert dev.specifier == main, f"dev extra: transformers{dev.specifier}, dependencies: transformers{main}"


@pytest.mark.slow
def test_every_module_imports_at_the_installed_versions():
    """The environment's own (highest) versions: every nip_like module imports in a fresh interpreter."""
    result = subprocess.run(
        [sys.executable, "-c", IMPORTS],
        cwd=REPO_ROOT,
        env=_environment(None),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "imported transformers" in result.stdout, result.stdout


@pytest.mark.slow
def test_the_lm_tests_pass_at_the_lowest_supported_versions(tmp_path):
    """At pyproject.toml's lower bounds, from the overlay: every nip_like module imports and :data:`SUBSET` passes."""
    lowest = lowest_versions()
    overlay = tmp_path / "lowest"
    _build_overlay(overlay, [f"{name}=={version}" for name, version in {**lowest, **COMPANIONS}.items()])

    # The runner imported nip_like, hydra with it, before pytest: hydra's pytest plugin cannot be rewritten.
    quiet = ["-W", "ignore::pytest.PytestAssertRewriteWarning"]
    arguments = ["-n", "0", "-q", "-p", "no:cacheprovider", *quiet, f"--basetemp={tmp_path / 'tests'}", *SUBSET]
    result = subprocess.run(
        [sys.executable, "-c", RUNNER, *arguments],
        cwd=REPO_ROOT,
        env=_environment(overlay),
        capture_output=True,
        text=True,
        timeout=900,
    )
    output = result.stdout + result.stderr
    imported = {
        line.split()[1]: (line.split()[2], Path(line.split(" from ", 1)[1]))
        for line in result.stdout.splitlines()
        if line.startswith("imported ")
    }
    assert set(imported) >= set(TESTED), f"nip_like did not import at the lowest versions:\n{output[-6000:]}"
    for name, version in {**lowest, **COMPANIONS}.items():
        found, module = imported[name]
        assert Version(found) == Version(version), f"{name} {found} imported, not {version}"
        assert module.is_relative_to(overlay), f"{name} imported from {module}, not from {overlay}"
    assert result.returncode == 0, f"LM tests failed at {lowest}:\n{output[-12000:]}"
    assert " passed" in result.stdout and " failed" not in result.stdout, output[-6000:]
