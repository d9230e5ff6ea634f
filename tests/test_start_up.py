"""The collector paused while a program starts (nip_like.start_up): off during the imports and the build, back on and
frozen over the start-up's objects while the run trains, thawed when it ends; untouched for runs started from Python."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import textwrap

import pytest

from nip_like import start_up
from nip_like.experiment import run_experiment
from nip_like.trainers.rl import TensorDictRlTrainer
from tests.conftest import REPO_ROOT, _cli_environment, smoke_config

#: Runs ``python -m nip_like ARGS`` as the command line does (runpy, as ``-m``) and prints, as JSON, what the
#: collector was doing while the module's imports ran, while the trainer trained, and after the run.
PROBE = textwrap.dedent(
    """
    import gc, json, runpy, sys
    from nip_like.trainers.rl import TensorDictRlTrainer

    seen = {}
    train = TensorDictRlTrainer.train

    def observed_train(self):
        seen["training"] = [gc.isenabled(), gc.get_freeze_count()]
        return train(self)

    TensorDictRlTrainer.train = observed_train
    sys.argv = ["nip_like", *sys.argv[1:]]
    try:
        runpy.run_module("nip_like", run_name="__main__", alter_sys=True)
    except SystemExit:
        pass
    seen["after"] = [gc.isenabled(), gc.get_freeze_count()]
    print("PROBE " + json.dumps(seen))
    """
)


@pytest.fixture
def collector_restored():
    """Whatever a test does to the collector and to this module's state, the next test finds them as they were."""
    enabled, frozen = gc.isenabled(), gc.get_freeze_count()
    yield
    start_up._paused = start_up._frozen = False
    gc.enable() if enabled else gc.disable()
    if gc.get_freeze_count() < frozen:
        gc.freeze()


def test_pause_resume_and_thaw(collector_restored):
    gc.unfreeze()
    start_up.pause_for_start_up()
    assert not gc.isenabled()
    made = [[index] for index in range(1000)]  # objects of the "start-up", tracked by the collector
    start_up.resume_after_start_up()
    assert gc.isenabled() and gc.get_freeze_count() >= len(made)
    start_up.resume_after_start_up()  # again: nothing more
    start_up.thaw_start_up()
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_a_collector_that_was_off_stays_off_and_nothing_is_frozen(collector_restored):
    gc.unfreeze()
    gc.disable()
    start_up.pause_for_start_up()
    start_up.resume_after_start_up()
    start_up.thaw_start_up()
    assert not gc.isenabled() and gc.get_freeze_count() == 0


def test_a_run_started_from_python_leaves_the_collector_as_it_was(tmp_path, collector_restored, monkeypatch):
    seen = []
    train = TensorDictRlTrainer.train
    monkeypatch.setattr(TensorDictRlTrainer, "train", lambda self: seen.append((gc.isenabled(), gc.get_freeze_count())) or train(self))
    frozen = gc.get_freeze_count()
    run_experiment(smoke_config(), tmp_path / "run")
    # Nothing of the run was frozen (frozen objects that reference counting freed leave the count: it only falls).
    assert len(seen) == 1 and seen[0][0] and seen[0][1] <= frozen
    assert gc.isenabled() and gc.get_freeze_count() <= frozen


@pytest.mark.slow  # a command-line run: a few seconds
def test_the_command_line_trains_with_the_collector_on_over_a_frozen_start_up(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    args = ["preset=smoke", "run.progress_bar=false", "logger=none", f"hydra.run.dir={tmp_path / 'run'}"]
    result = subprocess.run(
        [sys.executable, str(script), *args], cwd=REPO_ROOT, env=_cli_environment(None), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    seen = json.loads(result.stdout.split("PROBE ", 1)[1])
    enabled, frozen = seen["training"]
    # On while it trains, with the start-up's objects (torch's, TorchRL's, the built trainer's: far more than 100,000)
    # frozen; handed back to the collector when the run ended.
    assert enabled and frozen > 100_000, seen
    assert seen["after"] == [True, 0], seen
    assert (tmp_path / "run" / "summary.json").is_file()


@pytest.mark.slow
def test_a_refused_command_line_turns_the_collector_back_on(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    result = subprocess.run(
        [sys.executable, str(script), "preset=smoke", "trainer.num_iterations=-1", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=REPO_ROOT, env=_cli_environment(None), capture_output=True, text=True, timeout=300,
    )
    assert "error:" in result.stderr
    seen = json.loads(result.stdout.split("PROBE ", 1)[1])
    assert "training" not in seen and seen["after"] == [True, 0], seen
