"""Shared fixtures: compose configs in-process, run the CLI in a subprocess, watch a run from outside."""

from __future__ import annotations

import fcntl
import gc
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch
from omegaconf import DictConfig
from tensordict import TensorDictBase

import nip_like.experiment as experiment
from nip_like.cli import compose_config
from nip_like.scenarios.environment import InteractionEnv
from nip_like.trainers.rl import TensorDictRlTrainer

REPO_ROOT = Path(__file__).resolve().parent.parent


#: Test modules run before the other slow ones: the real model's (its first test converts the GGUF file, minutes
#: on a machine without the cache, and its tests are the longest), so that they start while the other worker has
#: work of its own, instead of ending the run on both workers (as they did when they came last).
FIRST_MODULES = ("test_real_model.py", "test_real_model_memory.py")


def pytest_collection_modifyitems(config, items) -> None:
    """Run the slow tests first, the real model's first of all (the order is otherwise kept): pytest-xdist then ends
    with short tests on every worker, instead of one worker finishing a long test while the others have nothing left
    to run."""
    items.sort(key=lambda item: (item.get_closest_marker("slow") is None, item.path.name not in FIRST_MODULES))


#: The test process's collector thresholds, for pytest_collection_finish. Python's defaults (700, 10, 10) made a
#: worker of the fast tier spend 10% of its time in full collections (15-16 s of about 150 s, counted with
#: gc.callbacks): each one walked the millions of objects that importing torch, transformers and the tests made.
#: Frozen after collection (gc.freeze), and with young collections at 10,000 allocations, the same tier spent
#: about 11 s a worker in all three generations instead of 20.
GC_THRESHOLDS = (10_000, 20, 100)


def pytest_collection_finish(session) -> None:
    """Leave the objects of the imports and the collection out of every later garbage collection."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


@pytest.fixture(autouse=True)
def _one_torch_thread_per_xdist_worker():
    """Under pytest-xdist, every test starts on one torch thread (a run whose config sets ``run.num_threads`` still sets it).

    The workers fill the cores already: a run that left torch at its default
    (a thread per core) put two spinning threads per worker on the cores, and
    a CLI test's command gets one thread anyway (``OMP_NUM_THREADS`` below).
    Set before each test, because a run that sets its own count changes it
    for the rest of the process, so that no test's threads depend on the
    order the tests ran in.
    """
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)
    yield


def built_once(tmp_path_factory, name: str, finished: str, build: Callable[[Path], None]) -> Path:
    """The folder ``name``, built by ``build(folder)`` once for the whole session, pytest-xdist workers included.

    The folder lies in the base temporary folder every worker's own is in;
    a file lock beside it lets one worker build while the others wait, then
    read what it built. ``finished`` (a path in the folder) is written last
    by ``build``: while it is missing, what is there is a build that did not
    end, removed and made again.
    """
    root = tmp_path_factory.getbasetemp()
    root = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root
    folder = root / name
    with (root / f"{name}.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not (folder / finished).is_file():
                shutil.rmtree(folder, ignore_errors=True)
                folder.mkdir(parents=True)
                build(folder)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return folder


def stop_at(monkeypatch, iteration: int, error: type[BaseException]) -> None:
    """Make every RL run raise ``error`` when it starts training iteration ``iteration + 1`` (``iteration`` done).

    The run stops there as a crash or a kill would (no checkpoint of that
    iteration); ``monkeypatch.undo()`` lets the next run go through.
    """
    original = TensorDictRlTrainer.train_iteration

    def stopped(self):
        if self.state.iteration == iteration:
            raise error
        return original(self)

    monkeypatch.setattr(TensorDictRlTrainer, "train_iteration", stopped)


class Stopped(Exception):
    """What :func:`stopped_and_resumed` raises to stop a run as a crash would."""


def stopped_and_resumed(monkeypatch, config, run_dir: Path, iteration: int) -> dict[str, float]:
    """Run ``config`` into ``run_dir``, stopped after ``iteration`` iterations, then resumed: the resumed run's final metrics."""
    from nip_like.experiment import run_experiment

    stop_at(monkeypatch, iteration, Stopped)
    with pytest.raises(Stopped):
        run_experiment(config, run_dir)
    monkeypatch.undo()
    return run_experiment(config, run_dir, resume=True)


def tiered(names: list[str], fast: list[str]) -> list:
    """Parameters for ``names``: those in ``fast`` in the fast tier, the rest marked slow (the full run has them all)."""
    unknown = set(fast) - set(names)
    assert fast and not unknown, f"fast-tier names that are not parameters: {sorted(unknown)}"
    return [pytest.param(name, marks=() if name in fast else pytest.mark.slow) for name in names]


def fast_trainers(names: list[str], learning_aware: int = 1) -> list[str]:
    """Of trainer ``names``, those the fast tier trains: every standard objective and the first ``learning_aware`` learning-aware trainers."""
    from nip_like.registry import TRAINERS
    from nip_like.trainers.learning_aware import LearningAwareTrainer

    aware = [name for name in names if issubclass(TRAINERS.get(name), LearningAwareTrainer)]
    return [name for name in names if name not in aware] + aware[:learning_aware]


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


def _cli_environment(cwd: Path | None) -> dict[str, str]:
    # The folder it runs in first (a user's trainer module), then this checkout's nip_like, not
    # another copy that the environment may have installed. Tiny models run fastest on one thread,
    # and tests may run beside other work. A PYTHONPATH of the test run comes after them: a run against
    # other package versions put first on it (tests/test_lowest_versions.py) starts its commands with those.
    inherited = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    path = os.pathsep.join(dict.fromkeys([str(cwd or REPO_ROOT), str(REPO_ROOT), *inherited]))
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


def run_cli(args: list[str], cwd: Path | None = None, module: str = "nip_like", timeout: int = 300):
    """Run ``python -m <module> args`` and return the completed process."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd or REPO_ROOT,
        env=_cli_environment(cwd),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def popen_cli(args: list[str], cwd: Path | None = None, module: str = "nip_like") -> subprocess.Popen:
    """Start ``python -m <module> args`` (output piped), for a test that signals or kills it.

    A shell runs background jobs with SIGINT ignored, and children inherit that; the
    command gets the default disposition, so that Python turns SIGINT into Ctrl-C.
    """
    return subprocess.Popen(
        [sys.executable, "-m", module, *args],
        cwd=cwd or REPO_ROOT,
        env=_cli_environment(cwd),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


@pytest.fixture
def config_factory():
    """Return :func:`smoke_config`."""
    return smoke_config


class RunProbe:
    """What a :func:`~nip_like.experiment.run_experiment` call did, seen from outside the trainer.

    Records the trainer that ``run_experiment`` built, every agent's parameters
    right after it was built (pretraining included), and the full rollouts
    (actions and states of every step) that its test loop played.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.trainer = None
        self.initial: dict[str, list[torch.Tensor]] = {}
        self.test_rollouts: list[TensorDictBase] = []
        self._testing = False
        build, rollout, test = experiment.build_trainer, InteractionEnv.rollout, TensorDictRlTrainer.test
        probe = self

        def build_and_record(config, run_dir):
            probe.trainer = build(config, run_dir)
            probe.initial = probe.parameters()
            return probe.trainer

        def record_rollout(env, *args, **kwargs):
            result = rollout(env, *args, **kwargs)
            if probe._testing:
                probe.test_rollouts.append(result)
            return result

        def flag_test(trainer, *args, **kwargs):
            probe._testing = True
            try:
                return test(trainer, *args, **kwargs)
            finally:
                probe._testing = False

        monkeypatch.setattr(experiment, "build_trainer", build_and_record)
        monkeypatch.setattr(InteractionEnv, "rollout", record_rollout)
        monkeypatch.setattr(TensorDictRlTrainer, "test", flag_test)

    def parameters(self) -> dict[str, list[torch.Tensor]]:
        """A copy of each agent's current parameters (policy and value)."""
        agents = getattr(self.trainer, "agent_modules", None) or self.trainer.agents
        return {name: [p.detach().clone() for p in agents.agent_parameters(name)] for name in agents.agent_names}

    def changed(self) -> set[str]:
        """The agents whose parameters differ from those they were built with."""
        now = self.parameters()
        return {name for name in now if any(not torch.equal(a, b) for a, b in zip(self.initial[name], now[name]))}

    def test_decisions(self, num_episodes: int) -> TensorDictBase:
        """The step that ended each test episode: the state before it and every agent's action.

        Like the test loop, keeps each environment's first finished episode of
        every test rollout, in order, and the first ``num_episodes`` of them.
        """
        steps = []
        for rollout in self.test_rollouts:
            done = rollout.get(("next", "done")).squeeze(-1)
            steps.append(rollout[done & (done.cumsum(-1) == 1)])
        return torch.cat(steps)[:num_episodes]


def hidden_bits_correct(decisions: TensorDictBase, verifier: int) -> torch.Tensor:
    """Whether the verifier's last action (of :meth:`RunProbe.test_decisions`) names the hidden bits.

    The answers are the bit strings read as binary numbers (the first bit is the most significant).
    """
    bits = decisions["state", "bits"]
    value = (bits * 2 ** torch.arange(bits.shape[-1] - 1, -1, -1)).sum(-1)
    return decisions["agents", "action"][:, verifier] == value


@pytest.fixture
def run_probe(monkeypatch) -> RunProbe:
    """A :class:`RunProbe` on the next ``run_experiment`` call of the test."""
    return RunProbe(monkeypatch)
