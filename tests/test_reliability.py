"""Reliability: one process per run folder, a clean stop on Ctrl-C or SIGTERM, checkpoints with a checksum.

The in-process tests send signals to this process while ``run_experiment`` runs (its
handlers are in place then, and restored after); the slow ones run the real command
line in subprocesses and signal or kill them.
"""

from __future__ import annotations

import errno
import hashlib
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import nip_like.resume
import nip_like.trainers.solo_agent as solo_agent
from nip_like import interrupts
from nip_like.checkpoint import load_checked, save_atomic
from nip_like.cli import report_errors
from nip_like.errors import CheckpointError, ConfigError, RunInterrupted, RunInUseError
from nip_like.experiment import run_experiment
from nip_like.logging import read_csv_metric
from nip_like.run_lock import LOCK_FILE, acquire, lock_holder, release
from nip_like.scenarios.environment import InteractionEnv
from nip_like.scenarios.graph_isomorphism.data import cache_path, GraphPairSpec, load_or_generate
from nip_like.scenarios.datasets import CacheRebuildWarning
from nip_like.sweeps.state import JobState, folder_state
from nip_like.trainers.rl import TensorDictRlTrainer
from tests.conftest import popen_cli, run_cli, smoke_config, stop_at


@pytest.fixture(autouse=True)
def default_sigint():
    """Give SIGINT its default Python disposition (Ctrl-C) for each test, as a terminal would.

    A shell starts background jobs with SIGINT ignored, and the runs keep an
    ignored SIGINT ignored (as they should); the tests that send SIGINT to
    themselves need the disposition of an interactive run, so they set it.
    """
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)

#: SIGTERM in the fast tier, SIGINT too in the full run.
SIGNALS = [pytest.param(signal.SIGINT, id="SIGINT", marks=pytest.mark.slow), pytest.param(signal.SIGTERM, id="SIGTERM")]


def stop_at_safe_points_only(monkeypatch) -> None:
    """Give a stopped iteration all the time it needs to reach its safe point, however busy the machine.

    A long phase stops where it is once :data:`nip_like.interrupts.GRACE_SECONDS`
    have passed (``tests/test_signals_in_phases.py``); the tests here are about
    the safe points.
    """
    monkeypatch.setattr(interrupts, "GRACE_SECONDS", 3600.0)


# ------------------------------------------------------------------ helpers


def file_hashes(folder: Path, skip: tuple[str, ...] = ()) -> dict[str, str]:
    """SHA-256 of every file under ``folder`` (but those under the top-level entries in ``skip``)."""
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.relative_to(folder).parts[0] not in skip
    }


def metric_steps(run_dir: Path) -> dict[str, list[int]]:
    """The steps of every CSV metric file of a run folder, by file."""
    root = run_dir / "metrics" / "scalars"
    return {
        str(path.relative_to(root)): [int(float(line.split(",")[0])) for line in path.read_text().splitlines()]
        for path in sorted(root.rglob("*.csv"))
    }


def assert_one_row_per_step(run_dir: Path, iterations: int) -> None:
    steps = metric_steps(run_dir)
    assert steps["train/iteration.csv"] == list(range(1, iterations + 1))
    for name, rows in steps.items():
        assert rows == sorted(set(rows)), f"{name} has repeated or unordered steps: {rows}"


def iteration_of(path: Path) -> int:
    return int(load_checked(path)["trainer"]["train_state"]["iteration"])


def signal_self_at(monkeypatch, iteration: int, *signums: int) -> None:
    """Send ``signums`` to this process at the start of train iteration ``iteration`` (1-based)."""
    original = TensorDictRlTrainer.train_iteration

    def signalled(self):
        if self.state.iteration == iteration - 1:
            for signum in signums:
                os.kill(os.getpid(), signum)
        return original(self)

    monkeypatch.setattr(TensorDictRlTrainer, "train_iteration", signalled)


HOLD_LOCK = """
import fcntl, os, sys, time
descriptor = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(descriptor, fcntl.LOCK_EX)
os.write(descriptor, f"pid={os.getpid()} host=testhost started=2026-01-02T03:04:05+00:00\\n".encode())
print("locked", flush=True)
time.sleep(600)
"""


@contextmanager
def lock_held_elsewhere(run_dir: Path):
    """Hold ``run_dir/run.lock`` from another process, as a running run does; yield its PID, then SIGKILL it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(run_dir / LOCK_FILE)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout.readline().strip() == "locked"
        yield process.pid
    finally:
        process.kill()
        process.wait()
        process.stdout.close()


def exit_and_line(capsys, action, *args) -> tuple[int, str]:
    """Run ``action`` as the entry points do; return the exit status and the one line on standard error."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_, report_errors():
        action(*args)
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return exit_.value.code, err.strip()


def wait_for(condition, process: subprocess.Popen, seconds: float = 240) -> None:
    deadline = time.time() + seconds
    while not condition():
        assert process.poll() is None, process.communicate()
        assert time.time() < deadline, "timed out"
        time.sleep(0.02)


def has_rows(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > 0


# ------------------------------------------------------------ item 3: the lock


def test_lock_is_reentrant_in_one_process_and_removed_at_the_end(tmp_path):
    run_dir = tmp_path / "run"
    acquire(run_dir)
    acquire(run_dir)
    text = (run_dir / LOCK_FILE).read_text()
    assert text.startswith(f"pid={os.getpid()} ") and "started=" in text
    assert lock_holder(run_dir) is None  # this process's own lock does not stop it
    release(run_dir)
    assert (run_dir / LOCK_FILE).is_file()
    release(run_dir)
    assert not (run_dir / LOCK_FILE).exists()


def test_a_folder_in_use_is_refused_untouched_and_free_once_its_process_dies(tmp_path, capsys):
    run_dir = tmp_path / "run"
    config = smoke_config("trainer.num_iterations=2", "logger=csv")
    run_experiment(config, run_dir)
    (run_dir / "checkpoints" / ".last.pt.tmp").write_bytes(b"half a checkpoint")
    with lock_held_elsewhere(run_dir) as pid:
        before = file_hashes(run_dir)
        status, line = exit_and_line(capsys, nip_like.resume.main, [str(run_dir)])
        assert status == 2 and line.startswith("error: ") and f"process {pid} " in line and str(run_dir) in line
        with pytest.raises(RunInUseError, match=f"process {pid} \\(host testhost"):
            run_experiment(config, run_dir)  # a new run into it, in-process
        with pytest.raises(RunInUseError, match=f"process {pid}"):
            run_experiment(config, tmp_path / "run", resume=True)
        state, detail = folder_state(run_dir, None, False)  # a sweep leaves it alone
        assert state == JobState.CONFLICT and f"process {pid}" in detail
        assert file_hashes(run_dir) == before
    # SIGKILL dropped the lock; its file stays, stale, and does not stop a resume.
    assert (run_dir / LOCK_FILE).is_file() and lock_holder(run_dir) is None
    assert run_experiment(config, run_dir, resume=True)
    assert not (run_dir / LOCK_FILE).exists()
    assert not (run_dir / "checkpoints" / ".last.pt.tmp").exists()  # the stale temporary went


def test_a_new_run_into_a_run_folder_is_refused_before_it_writes(tmp_path):
    run_dir = tmp_path / "run"
    run_experiment(smoke_config("trainer.num_iterations=1"), run_dir)
    before = file_hashes(run_dir)
    with pytest.raises(ConfigError, match="already holds a run"):
        run_experiment(smoke_config("trainer.num_iterations=1", "seed=4"), run_dir)
    assert file_hashes(run_dir) == before


@pytest.mark.slow
def test_resume_refuses_a_running_run_and_a_refused_command_changes_nothing(tmp_path, capsys):
    run_dir = tmp_path / "run"
    args = ["preset=none", "trainer.num_iterations=400", "run.checkpoint_every=0", "trainer.eval.every=0",
            "run.progress_bar=false", f"hydra.run.dir={run_dir}"]
    running = popen_cli(args)
    try:
        wait_for(lambda: has_rows(run_dir / "metrics" / "scalars" / "train" / "iteration.csv"), running)
        # Paused, it still holds the folder (its process lives) but takes no CPU from the commands below.
        running.send_signal(signal.SIGSTOP)
        assert (run_dir / LOCK_FILE).read_text().startswith(f"pid={running.pid} ")
        # What a refused command could change: everything but the running run's growing metric files.
        before = file_hashes(run_dir, skip=("metrics",))
        # The resume through its entry function in this process (the lock, not an interpreter, refuses it: no
        # start-up of its own needed); a new run into the folder through the real command line, where Hydra
        # composes and would write its .hydra/ folder.
        status, line = exit_and_line(capsys, nip_like.resume.main, [str(run_dir)])
        refused = run_cli(["preset=none", "seed=7", f"hydra.run.dir={run_dir}"])  # a new run into it
        assert refused.returncode == 2, refused.stderr
        lines = refused.stderr.strip().splitlines()
        assert len(lines) == 1, refused.stderr
        for status, line in ((status, line), (refused.returncode, lines[0])):
            assert status == 2 and line.startswith("error: "), line
            assert f"process {running.pid} " in line and f"kill -TERM {running.pid}" in line
        assert file_hashes(run_dir, skip=("metrics",)) == before
        assert running.poll() is None, "the running run goes on"
    finally:
        running.kill()
        _, stderr = running.communicate()
    # Killed before its first checkpoint, with its lock file left behind: resume starts it again.
    assert not (run_dir / "checkpoints" / "last.pt").exists() and (run_dir / LOCK_FILE).is_file()
    capsys.readouterr()
    # In this process, through the command's entry function, on one torch thread as the command would run.
    assert nip_like.resume.main([str(run_dir), "run.test_run=true", "run.num_threads=1"]) == 0
    assert "starting the run again from the beginning" in capsys.readouterr().out
    assert_one_row_per_step(run_dir, 1)
    assert not (run_dir / LOCK_FILE).exists()
    # A new run into the folder, which now holds a run, is refused before Hydra writes .hydra/.
    before = file_hashes(run_dir)
    refused = run_cli(["preset=none", "seed=7", f"hydra.run.dir={run_dir}"])
    assert refused.returncode == 2 and "already holds a run" in refused.stderr, refused.stderr
    assert file_hashes(run_dir) == before


# ------------------------------------------------------ item 5: interruption


@pytest.mark.parametrize("signum", SIGNALS)
def test_a_signal_stops_at_the_next_iteration_and_the_run_resumes_to_the_same_results(tmp_path, monkeypatch, signum):
    stop_at_safe_points_only(monkeypatch)
    overrides = ("trainer.num_iterations=6", "run.checkpoint_every=4", "logger=csv", "trainer.eval.every=2")
    reference = run_experiment(smoke_config(*overrides), tmp_path / "reference")
    run_dir = tmp_path / "run"
    handler = signal.getsignal(signum)
    signal_self_at(monkeypatch, 3, signum)
    with pytest.raises(RunInterrupted) as error:
        run_experiment(smoke_config(*overrides), run_dir)
    assert str(error.value) == f"interrupted at iteration 3; resume with: python -m nip_like.resume {run_dir}"
    assert error.value.exit_status == 128 + signum
    assert signal.getsignal(signum) is handler  # put back
    # The checkpoint was not due (every 4): it is written at the stop.
    assert iteration_of(run_dir / "checkpoints" / "last.pt") == 3
    assert metric_steps(run_dir)["train/iteration.csv"] == [1, 2, 3]
    monkeypatch.undo()
    assert run_experiment(smoke_config(*overrides), run_dir, resume=True) == reference
    assert metric_steps(run_dir) == metric_steps(tmp_path / "reference")
    assert_one_row_per_step(run_dir, 6)


def test_the_entry_points_print_the_resume_line_and_exit_with_128_plus_the_signal(capsys):
    def interrupted():
        raise RunInterrupted("interrupted at iteration 3; resume with: python -m nip_like.resume out/x", 143)

    status, line = exit_and_line(capsys, interrupted)
    assert status == 143 and line == "interrupted at iteration 3; resume with: python -m nip_like.resume out/x"


def test_a_second_signal_stops_at_once(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    overrides = ("trainer.num_iterations=6", "run.checkpoint_every=1")
    signal_self_at(monkeypatch, 2, signal.SIGINT, signal.SIGINT)
    with pytest.raises(RunInterrupted) as error:
        run_experiment(smoke_config(*overrides), run_dir)
    assert str(error.value) == (
        f"interrupted at once during iteration 2; resume from the last checkpoint with: "
        f"python -m nip_like.resume {run_dir}"
    )
    assert error.value.exit_status == 130
    assert iteration_of(run_dir / "checkpoints" / "last.pt") == 1
    assert not (run_dir / LOCK_FILE).exists()


def test_a_signal_in_the_test_loop_stops_it_and_resume_tests_again(tmp_path, monkeypatch):
    stop_at_safe_points_only(monkeypatch)
    overrides = ("trainer.num_iterations=2", "trainer.eval.every=0", "logger=csv")
    reference = run_experiment(smoke_config(*overrides), tmp_path / "reference")
    run_dir = tmp_path / "run"
    original = InteractionEnv.rollout

    def signalled(self, *args, **kwargs):  # without evaluation, only the test loop plays whole episodes
        os.kill(os.getpid(), signal.SIGTERM)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(InteractionEnv, "rollout", signalled)
    with pytest.raises(RunInterrupted, match="interrupted in the test loop \\(training finished at iteration 2\\)"):
        run_experiment(smoke_config(*overrides), run_dir)
    assert not (run_dir / "summary.json").exists()
    monkeypatch.undo()
    assert run_experiment(smoke_config(*overrides), run_dir, resume=True) == reference
    assert_one_row_per_step(run_dir, 2)


@pytest.mark.slow  # about a second or more: the fast tier keeps tests under ~0.8 s
def test_the_solo_agent_loop_stops_on_a_signal_too(tmp_path, monkeypatch):
    stop_at_safe_points_only(monkeypatch)
    overrides = (
        "scenario=graph_isomorphism", "scenario.num_pairs=80", "scenario.min_nodes=7", "scenario.max_nodes=8",
        f"scenario.cache_dir={tmp_path / 'cache'}", "scenario.default_agent.hidden_size=16",
        "trainer=solo_agent", "protocol=solo_verifier", "trainer.num_iterations=4", "run.checkpoint_every=0",
    )
    reference = run_experiment(smoke_config(*overrides), tmp_path / "reference")
    original = solo_agent.supervised_epoch
    calls = []

    def signalled(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return original(*args, **kwargs)

    monkeypatch.setattr(solo_agent, "supervised_epoch", signalled)
    run_dir = tmp_path / "run"
    with pytest.raises(RunInterrupted, match="^interrupted at iteration 2; resume with"):
        run_experiment(smoke_config(*overrides), run_dir)
    assert iteration_of(run_dir / "checkpoints" / "last.pt") == 2
    monkeypatch.undo()
    assert run_experiment(smoke_config(*overrides), run_dir, resume=True) == reference


@pytest.mark.slow  # about a second or more: the fast tier keeps tests under ~0.8 s
def test_a_run_stopped_before_its_first_checkpoint_starts_again_on_resume(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    overrides = ("trainer.num_iterations=3", "run.checkpoint_every=0", "trainer.eval.every=0", "logger=csv")
    reference = run_experiment(smoke_config(*overrides), tmp_path / "reference")

    class Killed(BaseException):
        pass

    stop_at(monkeypatch, 2, Killed)  # as a SIGKILL would: no checkpoint, rows of two iterations logged
    with pytest.raises(Killed):
        run_experiment(smoke_config(*overrides), run_dir)
    monkeypatch.undo()
    assert metric_steps(run_dir)["train/iteration.csv"] == [1, 2]
    assert not (run_dir / "checkpoints" / "last.pt").exists()
    (run_dir / "checkpoints").mkdir(exist_ok=True)
    (run_dir / "checkpoints" / ".last.pt.tmp").write_bytes(b"half a checkpoint")
    assert nip_like.resume.main([str(run_dir)]) == 0
    assert f"No checkpoint in {run_dir} yet: starting the run again from the beginning" in capsys.readouterr().out
    assert metric_steps(run_dir) == metric_steps(tmp_path / "reference")
    assert_one_row_per_step(run_dir, 3)
    assert not (run_dir / "checkpoints" / ".last.pt.tmp").exists()
    summary = (run_dir / "summary.json").read_text()
    assert '"resumed": true' in summary
    assert read_csv_metric(run_dir, "test/reward") == read_csv_metric(tmp_path / "reference", "test/reward")


@pytest.mark.slow
@pytest.mark.parametrize("signum", SIGNALS)
def test_a_signalled_run_exits_with_one_line_and_resumes_to_completion(tmp_path, signum):
    # The signal goes once the first iteration's row is written: the run stops at iteration 1 or 2 (10 iterations
    # to spare), where no checkpoint was due (every 8), and the resume passes one that is (at 8).
    run_dir = tmp_path / "run"
    args = ["preset=smoke", "trainer.num_iterations=12", "run.checkpoint_every=8", "run.progress_bar=false",
            f"hydra.run.dir={run_dir}"]
    process = popen_cli(args)
    wait_for(lambda: has_rows(run_dir / "metrics" / "scalars" / "train" / "iteration.csv"), process)
    process.send_signal(signum)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + signum, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr  # no traceback, no leaked-semaphore warning
    iteration = iteration_of(run_dir / "checkpoints" / "last.pt")
    assert 1 <= iteration < 12
    assert lines[0] == f"interrupted at iteration {iteration}; resume with: python -m nip_like.resume {run_dir}"
    assert not (run_dir / "summary.json").exists() and not (run_dir / LOCK_FILE).exists()

    # The resume in this process, through the command's entry function: the claim about the process is the stop's.
    # One torch thread, as the command's OMP_NUM_THREADS=1 gives it (a second thread here only spins on a busy machine).
    assert nip_like.resume.main([str(run_dir), "run.progress_bar=false", "run.num_threads=1"]) == 0
    assert_one_row_per_step(run_dir, 12)
    assert iteration_of(run_dir / "checkpoints" / "last.pt") == 12


# ---------------------------------------------------------- item 6: integrity


def test_any_flipped_byte_or_truncation_is_refused_before_torch_reads_it(tmp_path, monkeypatch):
    path = tmp_path / "last.pt"
    save_atomic({"run_id": "r", "weights": torch.arange(64, dtype=torch.float32), "note": "x" * 100}, path)
    good = path.read_bytes()
    assert good.startswith(b"nip_like-checkpoint format=2 size=")
    assert torch.equal(load_checked(path, "r")["weights"], torch.arange(64, dtype=torch.float32))

    def never(*args, **kwargs):
        raise AssertionError("torch.load read a damaged file")

    monkeypatch.setattr(torch, "load", never)
    for position in range(0, len(good), 3):
        damaged = bytearray(good)
        damaged[position] ^= 0x10
        path.write_bytes(bytes(damaged))
        with pytest.raises(CheckpointError, match=str(path)) as error:
            load_checked(path, "r")
        assert "\n" not in str(error.value)
    for size in (0, 40, len(good) // 2, len(good) - 1):
        path.write_bytes(good[:size])
        with pytest.raises(CheckpointError, match="is damaged"):
            load_checked(path, "r")


def test_a_checkpoint_of_the_old_format_is_refused_in_one_line(tmp_path):
    path = tmp_path / "old.pt"
    torch.save({"format": 1, "run_id": "r"}, path)  # nip_like before checksums
    with pytest.raises(CheckpointError, match="has no checksum header"):
        load_checked(path)


def test_resume_refuses_a_damaged_checkpoint_and_loads_a_good_one(tmp_path, capsys):
    run_dir = tmp_path / "run"
    config = smoke_config("trainer.num_iterations=2")
    metrics = run_experiment(config, run_dir)
    last = run_dir / "checkpoints" / "last.pt"
    good = last.read_bytes()
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0xFF
    last.write_bytes(bytes(flipped))
    status, line = exit_and_line(capsys, nip_like.resume.main, [str(run_dir)])
    assert status == 2 and line == (
        f"error: checkpoint {last} is damaged: its sha256 checksum does not match its contents; it was not loaded"
    )
    last.write_bytes(good[: len(good) - 100])
    status, line = exit_and_line(capsys, nip_like.resume.main, [str(run_dir)])
    assert status == 2 and f"checkpoint {last} is damaged: it holds" in line
    last.write_bytes(good)
    assert run_experiment(config, run_dir, resume=True) == metrics


@pytest.mark.slow  # a subprocess: seconds of start-up
def test_resume_of_a_damaged_checkpoint_exits_2_from_the_command_line(tmp_path):
    run_dir = tmp_path / "run"
    run_experiment(smoke_config("trainer.num_iterations=1"), run_dir)
    last = run_dir / "checkpoints" / "last.pt"
    damaged = bytearray(last.read_bytes())
    damaged[len(damaged) // 2] ^= 0x01
    last.write_bytes(bytes(damaged))
    before = file_hashes(run_dir)
    result = run_cli([str(run_dir)], module="nip_like.resume")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and str(last) in lines[0] and "checksum" in lines[0], result.stderr
    assert file_hashes(run_dir) == before


@pytest.mark.slow
def test_the_graph_data_cache_warning_speaks_of_the_cache(tmp_path):
    spec = GraphPairSpec(num_pairs=20, seed=1, min_nodes=5, max_nodes=6)
    fresh = load_or_generate(spec, tmp_path)
    path = cache_path(spec, tmp_path)
    damaged = bytearray(path.read_bytes())
    damaged[len(damaged) // 2] ^= 0x01
    path.write_bytes(bytes(damaged))
    with pytest.warns(CacheRebuildWarning) as caught:
        rebuilt = load_or_generate(spec, tmp_path)
    message = str(caught[0].message)
    assert message == (
        f"rebuilding the graph-pairs cache: cache file {path} is damaged: its sha256 checksum does not match "
        f"its contents; it was not loaded"
    )
    assert "checkpoint" not in message
    assert rebuilt.checksum() == fresh.checksum()


# ------------------------------------------------- file-system problems, messages
def resume_line(capsys, run_dir: Path, *overrides: str) -> str:
    """Run ``nip_like.resume`` in this process; return its one stderr line (exit status 2)."""
    with pytest.raises(SystemExit) as exit_info:
        nip_like.resume.main([str(run_dir), *overrides])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda root: (root / "f").touch() or root / "f", "the run folder .*/f is a file"),
        (lambda root: (root / "f").touch() or root / "f" / "run", r"lies under a file \(.*/f\)"),
        (lambda root: root / ("x" * 300), "has a name longer than the file system allows"),
    ],
)
def test_an_unusable_run_folder_is_refused_in_one_line(tmp_path, make, message):
    from nip_like.experiment import check_run_folder

    with pytest.raises(ConfigError, match=message):
        check_run_folder(make(tmp_path))


def test_a_cache_dir_that_is_a_file_is_refused(tmp_path):
    from nip_like.experiment import build_trainer

    (tmp_path / "cache").touch()
    config = smoke_config("scenario=graph_isomorphism", "protocol=nip", f"scenario.cache_dir={tmp_path / 'cache'}")
    with pytest.raises(ConfigError, match="scenario.cache_dir .*/cache is a file"):
        build_trainer(config, tmp_path / "run")


@pytest.mark.parametrize(
    "text, message",
    [("", "config.yaml is empty"), ("seed: [\n", "config.yaml is not valid YAML")],
)
def test_an_unreadable_run_config_is_named_as_such(tmp_path, capsys, text, message):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "config.yaml").write_text(text)
    assert message in resume_line(capsys, run_dir)


def test_resume_names_a_bad_override_not_the_runs_config(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_experiment(smoke_config("trainer.num_iterations=1"), run_dir)
    line = resume_line(capsys, run_dir, "run.num_threads=abc")
    assert "override 'run.num_threads=abc'" in line and "config.yaml" not in line


def test_resume_usage_shows_overrides_as_optional(capsys):
    with pytest.raises(SystemExit) as exit_info:
        nip_like.resume.main([])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == "error: the following arguments are required: run_dir"
    with pytest.raises(SystemExit):
        nip_like.resume.main(["--help"])
    assert "RUN_DIR [run.key=value | logger.key=value ...]" in capsys.readouterr().out


def test_an_unquoted_non_ascii_value_gets_a_quoting_hint(monkeypatch, capsys):
    from nip_like.cli import compose_config

    monkeypatch.setattr(sys, "argv", ["nip_like", "preset=smoke", "name=héllo"])
    with pytest.raises(SystemExit) as exit_info, report_errors():
        compose_config(sys.argv[1:])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.strip().endswith("quote a value with non-ASCII characters: name='héllo'")


def test_read_only_folders_are_refused_before_training(tmp_path, monkeypatch):
    """As root every folder is writable, so the permission check is given a read-only answer here."""
    from nip_like import folders
    from nip_like.experiment import check_run_folder

    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    read_only = {tmp_path / "run" / "checkpoints"}
    monkeypatch.setattr(folders.os, "access", lambda path, mode: Path(path) not in read_only)
    with pytest.raises(ConfigError, match=r"the checkpoints folder .*/checkpoints cannot be written: .* is read-only"):
        check_run_folder(tmp_path / "run", resume=True)
    read_only.add(tmp_path)
    with pytest.raises(ConfigError, match=r"the run folder .*/new cannot be written: .* is read-only"):
        check_run_folder(tmp_path / "new")


@pytest.mark.slow
def test_a_sweep_run_again_with_other_values_leaves_the_job_folder_as_it_was(tmp_path):
    sweep = ["--multirun", "preset=smoke", "seed=0", f"hydra.sweep.dir={tmp_path / 'sweep'}", "hydra.sweep.subdir=job",
             "run.progress_bar=false", "logger.print_metrics=false"]
    first = run_cli(sweep)
    assert first.returncode == 0, first.stderr
    folder = tmp_path / "sweep" / "job"
    job_log = ("__main__.log",)  # Hydra's log of the job, appended to by every launch
    before = file_hashes(folder, skip=job_log)
    assert ".hydra/overrides.yaml" in before
    again = run_cli([*sweep, "trainer.num_iterations=2"])  # the same folder, another config
    assert again.returncode == 2
    assert "holds a run of another config" in again.stderr
    assert file_hashes(folder, skip=job_log) == before


def test_a_disk_that_fills_while_metric_rows_are_written_stops_the_run_in_one_line_and_the_resume_completes_it(
    tmp_path, monkeypatch, capsys
):
    from torchrl.record.loggers.csv import CSVExperiment

    config = smoke_config("trainer.num_iterations=4", "run.checkpoint_every=1", "logger=csv")
    run_dir = tmp_path / "run"
    write = CSVExperiment.add_scalar

    def full_at_step_three(self, name, value, global_step=None):
        if global_step == 3 and name == "train/reward":
            handle = next(iter(self.files.values()))
            handle.write("3,0.")  # half a row reaches the disk, then it is full
            handle.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        write(self, name, value, global_step)

    monkeypatch.setattr(CSVExperiment, "add_scalar", full_at_step_three)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info, report_errors():
        run_experiment(config, run_dir)
    assert exit_info.value.code == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("error: could not write the metrics of step 3") and "No space left on device" in line
    assert "\n" not in line and not (run_dir / "summary.json").exists()
    assert [step for step, _ in read_csv_metric(run_dir, "train/reward")] == [1, 2]

    monkeypatch.setattr(CSVExperiment, "add_scalar", write)
    run_experiment(config, run_dir, resume=True)
    scalars = run_dir / "metrics" / "scalars"
    for path in scalars.rglob("*.csv"):  # the half row is gone with its step; every step once
        metric = str(path.relative_to(scalars).with_suffix(""))
        steps = [step for step, _ in read_csv_metric(run_dir, metric)]
        assert steps == sorted(set(steps)) and (metric.startswith("test/") or steps[-1] == 4), (metric, steps)
    assert [step for step, _ in read_csv_metric(run_dir, "train/reward")] == [1, 2, 3, 4]


def test_a_preset_made_for_another_scenario_gets_a_hint(monkeypatch, capsys):
    from nip_like.cli import compose_config

    # The default preset (quick) sets scenario.num_pairs, which the duplicates scenario does not have.
    monkeypatch.setattr(sys, "argv", ["nip_like", "scenario=duplicates"])
    with pytest.raises(SystemExit) as exit_info, report_errors():
        compose_config(sys.argv[1:])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Key 'num_pairs' not in 'DuplicatesConfig'" in err
    assert err.strip().endswith(
        "preset quick sets scenario.num_pairs, which this choice does not have: the preset is made for another "
        "scenario or trainer (add preset=none, or choose a preset made for this one)"
    )
