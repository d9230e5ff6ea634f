"""Faults on the text path, each in the middle of a stage: a model server that dies while it samples, the main
process killed (SIGKILL) while its fine-tune jobs run, a disk that fills while the checkpoint or a job's model is
written. Each ends in one line naming what failed, with the last good state intact, and a resume that ends with the
final metrics of an uninterrupted run of the same seed.

A fine-tune job killed mid-job is ``test_a_failed_job_names_its_log_and_the_stage_is_retried_on_the_same_rollouts``
(tests/test_text_trainer.py); a server that fails from a stage's start, and one still failing at the resume, are in
tests/test_text_server_errors.py. A full disk is a write that fails: ENOSPC from the checkpoint's file, and a
file-size limit (``ulimit -f``, through the jobs' documented ``trainer.jobs.setup``) in the job's process, which
needs no privilege to mount a small file system.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import time
from pathlib import Path

import pytest

import nip_like.checkpoint as checkpoint_module
from nip_like import resume
from nip_like.checkpoint import load_checked
from nip_like.cli import compose_config, report_errors
from nip_like.errors import FineTuneError
from nip_like.experiment import run_experiment
from nip_like.trainers.text import PureTextRlTrainer
from tests.conftest import popen_cli
from tests.fake_servers import fake_server
from tests.test_text_jobs import attempts
from tests.test_text_server_errors import TEXT_RUN
from tests.test_text_trainer import KEEP_ALL, NO_WARM_START, TINY, config, reference_run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, float]:
    """The final metrics of the tiny text run (both agents local models, a job per group each iteration).

    The same run as tests/test_text_trainer.py's reference: made once per session.
    """
    return reference_run(tmp_path_factory, "keep_all", KEEP_ALL)[1]


@pytest.fixture(scope="module")
def uninterrupted_cold(tmp_path_factory) -> dict[str, float]:
    """As :func:`uninterrupted`, without the warm start: for the faults of iteration 0's stages."""
    return reference_run(tmp_path_factory, "keep_all_cold", KEEP_ALL, NO_WARM_START)[1]


def state_of(run_dir: Path) -> tuple[int, str]:
    """The (iteration, stage) of the run's checkpoint, read through its checksum."""
    state = load_checked(run_dir / "checkpoints" / "last.pt")["trainer"]["text_state"]
    readable = json.loads((run_dir / "checkpoints" / "state.json").read_text())
    assert (readable["iteration"], readable["stage"]) == (state["iteration"], state["stage"])
    return state["iteration"], state["stage"]


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err.strip()


# ------------------------------------------------------------------ a server that dies mid-sampling
def seeded_reply(body: dict) -> str:
    """A reply that hangs on the request's seed: a resume that asked with other seeds would end elsewhere."""
    return "accept" if body["seed"] % 2 else "reject"


def test_a_server_that_dies_mid_sampling_stops_the_run_in_one_line_and_the_resume_ends_as_if_it_had_not(
    tmp_path, capsys, monkeypatch
):
    # The verifier behind the server, the prover scripted; two iterations, a job between them.
    overrides = [
        *TEXT_RUN, KEEP_ALL, "scenario.scripted_provers=true", "trainer.num_iterations=2", "trainer.episodes=8",
        f"scenario.cache_dir={tmp_path / 'cache'}",
    ]
    url = "scenario.default_model.base_url="
    with fake_server("ok", reply=seeded_reply) as server:
        reference = run_experiment(compose_config([*overrides, url + server.url]), tmp_path / "reference")
    run_dir = tmp_path / "run"
    with fake_server("ok", reply=seeded_reply) as server:
        run_config = compose_config([*overrides, url + server.url])
        # The server answers the first iteration and 3 requests of the second one's sampling, then dies.
        sample = PureTextRlTrainer._stage_sample_rollouts_run

        def dies_in_the_second_sampling(self):
            if self.state.iteration == 1:
                server.dies_after = server.kinds().count("chat") + 3
            return sample(self)

        monkeypatch.setattr(PureTextRlTrainer, "_stage_sample_rollouts_run", dies_in_the_second_sampling)
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info, report_errors():
            run_experiment(run_config, run_dir)
        monkeypatch.undo()
        port = server.server_port
    assert exit_info.value.code == 2
    err = one_error_line(capsys)
    assert err.startswith(f"error: text-model server {server.url} (model fake) failed after 2 tries") and "Connection" in err
    # The last good state: the first iteration whole, the second one's sampling not done and nothing of it written.
    assert state_of(run_dir) == (1, "sample_rollouts")
    rollouts = run_dir / "rollouts"
    assert sorted(path.name for path in rollouts.iterdir()) == ["iteration_0000.jsonl"]
    before = (rollouts / "iteration_0000.jsonl").read_text()
    # The server is back (on its port): the resume samples the stage again and ends as the uninterrupted run.
    with fake_server("ok", reply=seeded_reply, port=port):
        assert run_experiment(run_config, run_dir, resume=True) == reference
    assert (rollouts / "iteration_0000.jsonl").read_text() == before


# ------------------------------------------------------------------ the main process killed while jobs run
def test_the_main_process_killed_while_its_jobs_run_resumes_to_the_same_metrics(tmp_path, capsys, uninterrupted_cold):
    run_dir = tmp_path / "run"
    # Without the warm start, the first jobs the run waits for are iteration 0's (two fine-tune processes fewer).
    process = popen_cli([*TINY, KEEP_ALL, NO_WARM_START, f"hydra.run.dir={run_dir}"])
    try:
        # Killed once the first iteration's jobs are submitted and the run waits for them.
        deadline = time.monotonic() + 240
        state_file = run_dir / "checkpoints" / "state.json"
        while not (state_file.is_file() and json.loads(state_file.read_text())["stage"] == "await_fine_tune_jobs"):
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "the run did not reach its fine-tune stage"
            time.sleep(0.05)
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.kill()
        process.communicate()
    assert state_of(run_dir) == (0, "await_fine_tune_jobs")
    # python -m nip_like.resume's entry point, in this process: what is killed is the first process, and the jobs
    # it left running are processes of their own either way.
    capsys.readouterr()
    assert resume.main([str(run_dir)]) == 0
    assert "Traceback" not in capsys.readouterr().err
    assert json.loads((run_dir / "summary.json").read_text())["test_metrics"] == uninterrupted_cold
    # The jobs the killed process left running were adopted, not run again.
    for job in (run_dir / "fine_tune").iterdir():
        assert len(attempts(job)) == 1, job


# ------------------------------------------------------------------ a full disk
def disk_full_at_write(monkeypatch, name: str, count: int) -> None:
    """The ``count``-th atomic write of a file called ``name`` fails half-way with ENOSPC, as on a full disk."""
    writes = {"count": 0}

    class HalfWritten:
        def __init__(self, handle):
            self.handle = handle

        def __enter__(self):
            return self

        def __exit__(self, *exc_info):
            self.handle.close()

        def write(self, data):
            self.handle.write(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def open_(path, mode="r", *args, **kwargs):
        handle = open(path, mode, *args, **kwargs)
        if Path(path).name.startswith(f".{name}.") and Path(path).name.endswith(".tmp") and "w" in mode:
            writes["count"] += 1
            if writes["count"] == count:
                return HalfWritten(handle)
        return handle

    monkeypatch.setattr(checkpoint_module, "open", open_, raising=False)


def test_a_disk_that_fills_while_the_checkpoint_is_written_keeps_the_last_one(tmp_path, monkeypatch, capsys, uninterrupted_cold):
    run_dir = tmp_path / "run"
    # No warm start (its jobs are not what fails). Sampling, statistics and test are saved; the save after the jobs
    # were submitted fails.
    overrides = (KEEP_ALL, NO_WARM_START)
    disk_full_at_write(monkeypatch, "last.pt", 4)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info, report_errors():
        run_experiment(config(*overrides), run_dir)
    assert exit_info.value.code == 2
    checkpoints = run_dir / "checkpoints"
    assert one_error_line(capsys) == (
        f"error: could not write {checkpoints / 'last.pt'}: No space left on device; its previous version is kept"
    )
    assert state_of(run_dir) == (0, "create_fine_tune_jobs")  # the last good state, whole
    assert sorted(path.name for path in checkpoints.iterdir()) == ["last.pt", "state.json"]  # no partial file
    monkeypatch.undo()
    assert run_experiment(config(*overrides), run_dir, resume=True) == uninterrupted_cold
    for job in (run_dir / "fine_tune").iterdir():
        assert len(attempts(job)) == 1, job  # the submitted jobs were adopted


def test_a_disk_that_fills_while_a_job_writes_its_model_fails_the_job_and_the_retry_ends_the_run(tmp_path, capsys, uninterrupted):
    run_dir = tmp_path / "run"
    # Files of the jobs' processes may not grow past 10 or 20 KiB (sh counts 512-byte, bash 1 KiB blocks): the logs
    # and metrics fit, the tiny models' 24 KiB weights do not.
    with pytest.raises(FineTuneError) as error:
        run_experiment(config(KEEP_ALL, 'trainer.jobs.setup=["ulimit -f 20"]'), run_dir)
    message = str(error.value)
    assert "\n" not in message and " failed: could not write " in message
    assert "warm-" in message and "File too large" in message and "its previous version is kept" in message
    log = Path(message.split("log: ")[1])
    assert "File too large" in log.read_text()
    assert state_of(run_dir) == (0, "warm_start")
    # Nothing half-written is left under a model's name or beside it.
    assert not [path for path in (run_dir / "models").rglob("*") if path.is_dir() and "warm-" in path.name]
    # Space again (the run setting is not part of the run's identity): the resume retries the jobs and ends as the
    # uninterrupted run.
    assert run_experiment(config(KEEP_ALL), run_dir, resume=True) == uninterrupted
