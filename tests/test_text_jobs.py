"""Fine-tune jobs through submitit: the local executor runs them, a killed one is failed with its log, a later
process adopts a running one; the SLURM executor writes the launcher's options into its batch script and reads
states from sacct (fake SLURM commands); an executor the machine lacks is one line, exit status 2, before the run
folder is made."""

from __future__ import annotations

import json
import os
import signal
import stat
import time
from pathlib import Path
from typing import Callable

import pytest
from omegaconf import OmegaConf
from submitit.slurm.slurm import SlurmJob

from nip_like.cli import compose_config
from nip_like.errors import ConfigError, FineTuneError
from nip_like.experiment import preflight
from nip_like.text.fine_tune import FineTuneSpec
from nip_like.text import jobs as jobs_module
from nip_like.text.jobs import JobsConfig, SubmititFineTuneBackend
from nip_like.text.models import create_model_folder
from nip_like.text.tokenizer import build_chat_tokenizer
from tests.conftest import run_cli
from tests.test_text import TINY_MODEL, sft_records, write_jsonl


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    return create_model_folder(TINY_MODEL, tmp_path_factory.mktemp("model") / "tiny", build_chat_tokenizer())


def attempts(folder: Path) -> list[Path]:
    """The logs of a job's attempts (one per submission), oldest first."""
    return sorted(folder.glob("*_0_log.out"), key=lambda path: path.stat().st_mtime)


def kill_when_started(
    backend: SubmititFineTuneBackend, job_id: str, timeout: float = 120, kill: Callable[[str], None] | None = None
) -> None:
    """Kill a local job once it has started training: from outside (SIGKILL to its controller's process group), or by ``kill(job_id)``."""
    record = json.loads((backend.folder(job_id) / "job.json").read_text())
    log, metrics = Path(record["log"]), backend.folder(job_id) / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while not (log.is_file() and "--- started" in log.read_text() and metrics.is_file()):
        assert time.monotonic() < deadline, "the job did not start"
        time.sleep(0.05)
    if kill is not None:
        kill(job_id)
        return
    os.killpg(int(record["job_id"]), signal.SIGKILL)


# ------------------------------------------------------------------ the local executor
@pytest.mark.slow
def test_a_local_job_runs_once_and_a_failed_one_names_its_error_and_log(tmp_path, model_folder):
    backend = SubmititFineTuneBackend(tmp_path / "jobs")
    data = write_jsonl(tmp_path / "sft.jsonl", sft_records(8))
    spec = FineTuneSpec("good", "sft", str(model_folder), str(data), str(tmp_path / "models" / "good"), num_threads=1)
    assert backend.status("good").state == "pending"
    assert backend.submit(spec).state == "running"
    status = backend.wait(["good"], poll_seconds=0.1, timeout=120)["good"]
    assert status.state == "succeeded" and Path(status.model, "config.json").is_file()
    # Submitted again (a resumed run), it is not run twice.
    assert backend.submit(spec).state == "succeeded"
    assert SubmititFineTuneBackend(tmp_path / "jobs").submit(spec).state == "succeeded"
    assert len(attempts(tmp_path / "jobs" / "good")) == 1 and Path(status.log) == attempts(tmp_path / "jobs" / "good")[0]
    assert len((tmp_path / "jobs" / "good" / "metrics.jsonl").read_text().splitlines()) == 1

    broken = FineTuneSpec("bad", "sft", str(tmp_path / "missing"), str(data), str(tmp_path / "models" / "bad"), num_threads=1)
    backend.submit(broken)
    status = backend.wait(["bad"], poll_seconds=0.1, timeout=120)["bad"]
    assert status.state == "failed" and "\n" not in status.error and "missing" in status.error
    assert status.log.endswith("_0_log.out") and "Traceback" in Path(status.log).read_text()


@pytest.mark.slow  # a real fine-tune job started, adopted and killed: 5-6 s
def test_a_running_job_is_adopted_by_a_later_process_and_a_killed_one_is_failed_with_its_log(tmp_path, model_folder):
    data = write_jsonl(tmp_path / "sft.jsonl", sft_records(64))
    spec = FineTuneSpec("slow", "sft", str(model_folder), str(data), str(tmp_path / "out"), epochs=10_000, num_threads=1)
    first = SubmititFineTuneBackend(tmp_path / "jobs")
    first.submit(spec)
    # A resumed run (a backend that did not submit it) re-attaches the job by its id and folder: running, not
    # submitted again.
    later = SubmititFineTuneBackend(tmp_path / "jobs")
    deadline = time.monotonic() + 120
    while not (tmp_path / "jobs" / "slow" / "metrics.jsonl").is_file():
        assert later.status("slow").state == "running" and time.monotonic() < deadline
        time.sleep(0.1)
    assert later.submit(spec).state == "running"
    assert len(attempts(tmp_path / "jobs" / "slow")) == 1
    # Killed from outside (as by the OOM killer): failed, with its log, for both, never left running.
    kill_when_started(first, "slow")
    for backend in (first, later, SubmititFineTuneBackend(tmp_path / "jobs")):
        status = backend.wait(["slow"], poll_seconds=0.1, timeout=30)["slow"]
        assert status.state == "failed" and "ended without a result" in status.error and "\n" not in status.error
        assert Path(status.log).is_file() and status.log == str(attempts(tmp_path / "jobs" / "slow")[0])


def ignored_signals(pid: int) -> int:
    """The mask of signals process ``pid`` ignores (``SigIgn`` of its /proc status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return int(line.split()[1], 16)
    raise AssertionError(f"no SigIgn in /proc/{pid}/status")


def submit_ignoring_interrupts(spec: FineTuneSpec, folder: Path) -> None:
    """Submit ``spec`` from a process that ignores SIGINT, as a trainer started by ``nohup ... &`` does."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        SubmititFineTuneBackend(folder).submit(spec)
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads signal masks from /proc")
def test_a_job_cancelled_by_a_later_process_is_failed_also_when_the_trainer_ignores_interrupts(tmp_path, model_folder):
    data = write_jsonl(tmp_path / "sft.jsonl", sft_records(64))
    spec = FineTuneSpec("slow", "sft", str(model_folder), str(data), str(tmp_path / "out"), epochs=10_000, num_threads=1)
    submit_ignoring_interrupts(spec, tmp_path / "jobs")
    # The controller does not inherit the ignored SIGINT, so it can stop its tasks when cancelled.
    controller = int(json.loads((tmp_path / "jobs" / "slow" / "job.json").read_text())["job_id"])
    assert not ignored_signals(controller) & (1 << (signal.SIGINT - 1))
    later = SubmititFineTuneBackend(tmp_path / "jobs")
    status = later.status("slow")
    assert status.state == "running", (status, list((tmp_path / "jobs" / "slow").iterdir()))
    later.cancel("slow")
    assert later.wait(["slow"], poll_seconds=0.1, timeout=30)["slow"].state == "failed"


@pytest.mark.slow
def test_a_cancelled_job_whose_processes_ignore_interrupts_is_killed(tmp_path, model_folder, monkeypatch):
    # Without the reset of SIGINT the whole job ignores it; cancel kills the process group after its grace.
    monkeypatch.setattr(jobs_module, "_default_interrupt", lambda: None)
    monkeypatch.setattr(jobs_module._LocalJob, "cancel_grace_s", 1.0)
    data = write_jsonl(tmp_path / "sft.jsonl", sft_records(64))
    spec = FineTuneSpec("stuck", "sft", str(model_folder), str(data), str(tmp_path / "out"), epochs=10_000, num_threads=1)
    submit_ignoring_interrupts(spec, tmp_path / "jobs")
    later = SubmititFineTuneBackend(tmp_path / "jobs")
    kill_when_started(later, "stuck", kill=later.cancel)
    status = later.wait(["stuck"], poll_seconds=0.1, timeout=30)["stuck"]
    assert status.state == "failed" and "ended without a result" in status.error


# ------------------------------------------------------------------ the SLURM executor (fake commands)
def fake_slurm(folder: Path, job_id: str) -> Path:
    """A bin folder with fake sbatch (accepts any script, says job ``job_id``), srun, and sacct (reads ``state``)."""
    folder.mkdir(parents=True)
    scripts = {
        "sbatch": f'#!/bin/sh\ncp "$1" {folder}/submitted.sh\necho "Submitted batch job {job_id}"\n',
        "srun": "#!/bin/sh\nexit 1\n",
        "sacct": f'#!/bin/sh\necho "JobID|State|NodeList"\necho "{job_id}|$(cat {folder}/state)|node1"\n',
    }
    for name, text in scripts.items():
        (folder / name).write_text(text)
        (folder / name).chmod((folder / name).stat().st_mode | stat.S_IEXEC)
    (folder / "state").write_text("PENDING")
    return folder


@pytest.mark.slow
def test_the_slurm_executor_submits_with_the_launchers_options_and_reads_states_from_sacct(tmp_path, monkeypatch):
    job_id = str(900_000 + os.getpid() % 100_000)  # submitit's watcher is shared: an id no other test uses
    bin_dir = fake_slurm(tmp_path / "bin", job_id)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(SlurmJob, "_results_timeout_s", 0)
    jobs = JobsConfig(
        executor="slurm", partition="gpu", timeout_min=90, cpus_per_task=4, gpus_per_node=1, mem_gb=16,
        setup=["source ~/venv/bin/activate"], additional_parameters={"mail-user": "me@lab.org"}, poll_seconds=0.1,
    )
    backend = SubmititFineTuneBackend(tmp_path / "jobs", OmegaConf.structured(jobs))
    data = write_jsonl(tmp_path / "sft.jsonl", sft_records(4))
    spec = FineTuneSpec("run-it0000-verifier", "sft", str(tmp_path / "model"), str(data), str(tmp_path / "out"))
    status = backend.submit(spec)
    folder = tmp_path / "jobs" / spec.job_id
    assert status.state == "running" and status.log == str(folder / f"{job_id}_0_log.out")
    assert json.loads((folder / "job.json").read_text()) == {"executor": "slurm", "job_id": job_id, "log": status.log}
    script = (bin_dir / "submitted.sh").read_text()
    for line in (
        "#SBATCH --partition=gpu", "#SBATCH --time=90", "#SBATCH --cpus-per-task=4", "#SBATCH --gpus-per-node=1",
        "#SBATCH --mem=16GB", "#SBATCH --job-name=run-it0000-verifier", "#SBATCH --mail-user=me@lab.org",
        "source ~/venv/bin/activate", "-m submitit.core._submit",
    ):
        assert line in script, line
    assert "#SBATCH --error" not in script  # tracebacks go to the one log
    assert backend.status(spec.job_id).state == "running"  # PENDING
    # Killed from outside (out of memory): failed with sacct's state and the log, for a later process too.
    (bin_dir / "state").write_text("OUT_OF_MEMORY")
    for each in (backend, SubmititFineTuneBackend(tmp_path / "jobs", OmegaConf.structured(jobs))):
        status = each.wait([spec.job_id], timeout=30)[spec.job_id]
        assert status.state == "failed" and "OUT_OF_MEMORY" in status.error and status.log.endswith(f"{job_id}_0_log.out")


def test_a_job_that_sbatch_refuses_is_one_line_and_can_be_submitted_again(tmp_path, monkeypatch):
    bin_dir = fake_slurm(tmp_path / "bin", "1")
    (bin_dir / "sbatch").write_text('#!/bin/sh\necho "sbatch: error: invalid partition specified: nope" >&2\nexit 1\n')
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    backend = SubmititFineTuneBackend(tmp_path / "jobs", JobsConfig(executor="slurm", partition="nope"))
    spec = FineTuneSpec("job", "sft", str(tmp_path / "model"), str(write_jsonl(tmp_path / "d.jsonl", sft_records(2))), str(tmp_path / "out"))
    with pytest.raises(FineTuneError) as error:
        backend.submit(spec)
    message = str(error.value)
    assert "\n" not in message and message.startswith("fine-tune job job could not be submitted (slurm executor): ")
    assert "invalid partition specified: nope" in message
    assert backend.status("job").state == "pending"  # nothing recorded: a resumed run submits it again


# ------------------------------------------------------------------ an executor the machine lacks
def without_slurm(monkeypatch, tmp_path) -> None:
    """PATH without SLURM's commands (an empty folder first, then the system's folders that have none)."""
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    folders = [str(empty)] + [
        folder for folder in ("/usr/bin", "/bin") if not any(Path(folder, name).exists() for name in ("sbatch", "srun", "sacct"))
    ]
    monkeypatch.setenv("PATH", os.pathsep.join(folders))


def test_an_executor_the_machine_lacks_is_one_line(tmp_path, monkeypatch):
    without_slurm(monkeypatch, tmp_path)
    config = compose_config(["preset=text_quick", "trainer.jobs.executor=slurm", f"scenario.cache_dir={tmp_path / 'cache'}"])
    with pytest.raises(ConfigError) as error:
        preflight(config)
    message = str(error.value)
    assert "\n" not in message
    assert message == (
        "trainer.jobs.executor=slurm needs SLURM's sbatch, srun, sacct on PATH, and this machine has no sbatch, srun, "
        "sacct; allowed here: local"
    )
    with pytest.raises(ConfigError, match="allowed here: local"):
        SubmititFineTuneBackend(tmp_path / "jobs", JobsConfig(executor="slurm"))
    with pytest.raises(ConfigError, match="trainer.jobs.executor.*pbs"):
        preflight(compose_config(["preset=text_quick", "trainer.jobs.executor=pbs"]))


@pytest.mark.slow
def test_the_command_line_refuses_slurm_without_sbatch_before_it_makes_the_run_folder(tmp_path, monkeypatch):
    without_slurm(monkeypatch, tmp_path)
    run_dir = tmp_path / "run"
    result = run_cli(["preset=text_quick", "trainer.jobs.executor=slurm", f"hydra.run.dir={run_dir}"])
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("error: trainer.jobs.executor=slurm needs SLURM's sbatch"), result.stderr
    assert not run_dir.exists()
