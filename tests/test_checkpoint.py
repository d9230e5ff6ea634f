"""Atomic checkpoints, corrupt files, and exact resume after an interruption."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import nip_like.resume
from nip_like.checkpoint import load_checked, save_atomic, write_text_atomic
from nip_like.errors import CheckpointError
from nip_like.experiment import run_experiment
from nip_like.logging import read_csv_metric
from tests.test_duplicates_scenario import TINY_AGENT
from tests.conftest import REPO_ROOT, make_config, smoke_config, stop_at


def test_crash_during_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "last.pt"
    save_atomic({"run_id": "a", "value": 1}, path)

    def crash(obj, handle, *args, **kwargs):
        handle.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError):
        save_atomic({"run_id": "a", "value": 2}, path)
    monkeypatch.undo()
    assert load_checked(path, "a")["value"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]


@pytest.mark.parametrize("write", ["state", "text"])
def test_two_writers_of_one_file_at_once_both_succeed(tmp_path, monkeypatch, write):
    # The jobs of a sweep fill one shared data cache: two writers may have their temporary files
    # open at the same moment. Both must end without error and leave one whole file.
    path = tmp_path / "shared.pt"
    both_written = threading.Barrier(2, timeout=10)
    if write == "state":
        real_fsync = os.fsync

        def fsync(descriptor):  # each writer waits here until the other has written its temporary file
            real_fsync(descriptor)
            both_written.wait()

        monkeypatch.setattr(os, "fsync", fsync)
        writers = [lambda value=value: save_atomic({"value": value}, path) for value in (1, 2)]
    else:
        real_write_text = Path.write_text

        def write_text(self, text, *args, **kwargs):
            written = real_write_text(self, text, *args, **kwargs)
            both_written.wait()
            return written

        monkeypatch.setattr(Path, "write_text", write_text)
        writers = [lambda value=value: write_text_atomic(str(value), path) for value in (1, 2)]
    errors = []

    def run(writer):
        try:
            writer()
        except Exception as error:  # noqa: BLE001 - the test reports what a writer raised
            errors.append(error)

    threads = [threading.Thread(target=run, args=(writer,)) for writer in writers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    if write == "state":
        assert load_checked(path)["value"] in (1, 2)
    else:
        assert Path.read_text(path) in ("1", "2")
    assert not list(tmp_path.glob(".*.tmp"))


def test_missing_corrupt_and_foreign_checkpoints_are_one_line_errors(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint"):
        load_checked(tmp_path / "nothing.pt")
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointError, match="corrupt.pt is damaged") as error:
        load_checked(corrupt)
    assert "\n" not in str(error.value)
    save_atomic({"run_id": "abc"}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="hyper-parameters differ"):
        load_checked(tmp_path / "other.pt", "xyz")


class Interrupted(Exception):
    pass


@pytest.mark.parametrize(
    "objective",
    [
        pytest.param((), marks=pytest.mark.slow),  # 2 s; test_reliability resumes a signalled run in the fast tier
        # DPO's moving reference (an EMA step every 3 iterations) and its count live in the loss's state.
        pytest.param(
            ("trainer=dpo", "trainer.objective.ref_sync_every=3", "trainer.objective.ref_mixup_alpha=0.5", "trainer.minibatch_size=4"),
            marks=pytest.mark.slow,
        ),
    ],
    ids=["ppo", "dpo_ema_reference"],
)
def test_interrupted_run_resumes_to_the_same_final_metrics(tmp_path, monkeypatch, objective):
    _interrupt_and_resume(tmp_path, monkeypatch, objective)


@pytest.mark.slow
def test_interrupted_lm_run_resumes_to_the_same_final_metrics(tmp_path, monkeypatch):
    # Language-model agents: their optimiser, collector carrier (prompts, messages) and RNG resume exactly.
    _interrupt_and_resume(tmp_path, monkeypatch, (*lm_overrides(tmp_path), "trainer.eval.metric=eval/accuracy"))


def lm_overrides(tmp_path) -> tuple[str, ...]:
    """Tiny language-model agents on the duplicates task, NIP, prover first."""
    agent = [f"scenario.default_agent.{key}={value}" for key, value in TINY_AGENT.items()]
    return ("scenario=duplicates", "protocol=nip", "protocol.first_speaker=prover", "protocol.max_rounds=2",
            "scenario.num_lists=200", f"scenario.cache_dir={tmp_path / 'data'}", *agent)


def _interrupt_and_resume(tmp_path, monkeypatch, objective) -> None:
    overrides = (*objective, "trainer.num_iterations=7", "run.checkpoint_every=2", "logger=csv", "trainer.eval.every=3")
    reference = run_experiment(smoke_config(*overrides), tmp_path / "reference")

    stop_at(monkeypatch, 5, Interrupted)
    with pytest.raises(Interrupted):
        run_experiment(smoke_config(*overrides), tmp_path / "resumed")
    monkeypatch.undo()
    resumed = run_experiment(smoke_config(*overrides), tmp_path / "resumed", resume=True)

    assert resumed == reference
    for metric in ("loss/policy", "train/reward", "eval/reward"):
        assert read_csv_metric(tmp_path / "resumed", metric) == read_csv_metric(tmp_path / "reference", metric)


@pytest.mark.slow  # about a second or more: the fast tier keeps tests under ~0.8 s
def test_resume_refuses_other_hyper_parameters_and_settings(tmp_path):
    run_experiment(smoke_config(), tmp_path)
    with pytest.raises(CheckpointError, match="hyper-parameters differ"):
        run_experiment(smoke_config("seed=5"), tmp_path, resume=True)
    with pytest.raises(CheckpointError, match="no checkpoints"):
        run_experiment(smoke_config(), tmp_path / "empty", resume=True)


def _iteration_of(path):
    try:
        return load_checked(path)["trainer"]["train_state"]["iteration"]
    except CheckpointError:
        return -1


@pytest.mark.slow
@pytest.mark.parametrize("agents", ["graph", "language_models"])
def test_killed_process_resumes_to_the_same_final_metrics(tmp_path, agents):
    # 12 iterations, an evaluation every 3: the killed run has evaluated (at 3) and checkpointed (at 4 or later)
    # before the kill, and the resume evaluates again. The kill comes once checkpoint 4 is seen, 8 iterations
    # before the end (about a second of the graph run, several of the LM run, on a quiet machine).
    args = [
        "preset=smoke", "trainer.num_iterations=12", "trainer.eval.every=3", "run.checkpoint_every=1",
        "run.progress_bar=false", "run.num_threads=1",
    ]
    if agents == "language_models":
        # Half the smoke preset's batches and a quarter of its test and evaluation episodes: the claim is that the
        # resumed run's metrics equal the reference's, whatever their size.
        args += [*lm_overrides(tmp_path), "trainer.eval.metric=eval/accuracy", "trainer.num_envs=8", "trainer.frames_per_batch=48",
                 "trainer.minibatch_size=16", "trainer.num_test_episodes=16", "trainer.test_batch_episodes=16",
                 "trainer.eval.num_episodes=16"]
    # Only the killed run needs a process of its own (SIGKILL): the reference runs in this process, from the
    # config that the command composes, and the resume through nip_like.resume's entry function. Each saves an
    # interpreter start-up (about 5 s of imports); run.num_threads=1 gives all three the same arithmetic.
    reference = run_experiment(make_config(*args), tmp_path / "reference")

    killed_dir = tmp_path / "killed"
    process = subprocess.Popen(
        [sys.executable, "-m", "nip_like", *args, f"hydra.run.dir={killed_dir}"],
        cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    deadline = time.time() + 240
    checkpoint = killed_dir / "checkpoints" / "last.pt"
    while time.time() < deadline and process.poll() is None:
        if checkpoint.is_file() and _iteration_of(checkpoint) >= 4:
            break
        time.sleep(0.05)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert 4 <= _iteration_of(checkpoint) < 12, "the run must be killed part-way"
    assert not (killed_dir / "summary.json").exists()

    assert nip_like.resume.main([str(killed_dir), "run.progress_bar=false"]) == 0
    final = json.loads((killed_dir / "summary.json").read_text())
    expected = json.loads((tmp_path / "reference" / "summary.json").read_text())
    assert final["test_metrics"] == expected["test_metrics"] == reference
    assert final["frames"] == expected["frames"] and final["resumed"]
