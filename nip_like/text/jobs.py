"""Fine-tune jobs behind one interface: submit, poll, fetch the model, read the error.

:class:`FineTuneBackend` is what a text trainer talks to.
:class:`LocalFineTuneBackend` runs each job with transformers in a worker
process (``python -m nip_like.text.worker``), in a folder of its own under the
run folder::

    <root>/<job_id>/spec.json      the job (FineTuneSpec)
    <root>/<job_id>/status.json    running (with the worker's pid) | succeeded (with the model) | failed (with the error)
    <root>/<job_id>/log.txt        the worker's output, tracebacks included
    <root>/<job_id>/metrics.jsonl  each optimiser step's metrics

Job ids are derived from (run, iteration, group) by the trainer, so a resumed
run asks for the same ids: a job that succeeded is never run again, one that
is still running (its worker outlives the trainer) is adopted, and a job whose
worker died without saying so (killed, out of memory) is reported ``failed``,
never left ``running``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

from nip_like.errors import FineTuneError
from nip_like.text.fine_tune import FineTuneSpec

#: The states of a job.
JOB_STATES = ("pending", "running", "succeeded", "failed")


@dataclass(frozen=True)
class JobStatus:
    """Where a job stands: its state, its model when it succeeded, its error and log when it failed."""

    job_id: str
    state: str
    model: Optional[str] = None
    error: Optional[str] = None
    log: Optional[str] = None

    @property
    def finished(self) -> bool:
        return self.state in ("succeeded", "failed")


class FineTuneBackend(ABC):
    """Runs fine-tune jobs (see the module docstring)."""

    @abstractmethod
    def submit(self, spec: FineTuneSpec) -> JobStatus:
        """Start ``spec`` unless a job with its id already succeeded or is running; its status."""

    @abstractmethod
    def status(self, job_id: str) -> JobStatus:
        """The job's current status (``pending`` if it was never submitted)."""

    def wait(self, job_ids: Iterable[str], poll_seconds: float = 0.5, timeout: float | None = None) -> dict[str, JobStatus]:
        """Poll until every job has finished; their statuses.

        Raises
        ------
        FineTuneError
            If ``timeout`` seconds pass first.
        """
        job_ids = list(job_ids)
        started = time.monotonic()
        while True:
            statuses = {job_id: self.status(job_id) for job_id in job_ids}
            if all(status.finished for status in statuses.values()):
                return statuses
            if timeout is not None and time.monotonic() - started > timeout:
                waiting = [job_id for job_id, status in statuses.items() if not status.finished]
                raise FineTuneError(f"fine-tune jobs {waiting} did not finish within {timeout:g} s")
            time.sleep(poll_seconds)


def _alive(pid: int) -> bool:
    """Whether a worker process with this pid is running (not a zombie, and really a worker)."""
    proc = Path(f"/proc/{pid}")
    if proc.exists():
        try:
            if (proc / "stat").read_text().split(") ")[-1].startswith("Z"):
                return False
            return b"nip_like.text.worker" in (proc / "cmdline").read_bytes()
        except OSError:
            return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


class LocalFineTuneBackend(FineTuneBackend):
    """Each job in a worker process on this machine (see the module docstring).

    Parameters
    ----------
    root : Path
        The folder of the jobs' folders (``<run>/fine_tune``).
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._processes: dict[str, subprocess.Popen] = {}

    def folder(self, job_id: str) -> Path:
        return self.root / job_id

    def submit(self, spec: FineTuneSpec) -> JobStatus:
        spec.check()
        current = self.status(spec.job_id)
        if current.state in ("succeeded", "running"):
            return current
        folder = self.folder(spec.job_id)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "spec.json").write_text(spec.to_json())
        (folder / "status.json").unlink(missing_ok=True)
        with open(folder / "log.txt", "a") as log:
            log.write(f"--- started {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
            log.flush()
            environment = {**os.environ, "PYTHONUNBUFFERED": "1"}
            # A session of its own: the job goes on if the trainer is stopped, and a resumed run adopts it.
            process = subprocess.Popen(
                [sys.executable, "-m", "nip_like.text.worker", str(folder)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=environment,
                start_new_session=True,
            )
        self._processes[spec.job_id] = process
        (folder / "pid").write_text(str(process.pid))
        return JobStatus(spec.job_id, "running", log=str(folder / "log.txt"))

    def status(self, job_id: str) -> JobStatus:
        folder = self.folder(job_id)
        log = str(folder / "log.txt")
        process = self._processes.get(job_id)
        if process is not None:
            process.poll()  # reap a finished worker of this process
        status_file = folder / "status.json"
        if status_file.is_file():
            status = json.loads(status_file.read_text())
            if status["status"] == "succeeded":
                return JobStatus(job_id, "succeeded", model=status["model"], log=log)
            if status["status"] == "failed":
                return JobStatus(job_id, "failed", error=status.get("error"), log=log)
            pid = int(status["pid"])
        elif (folder / "pid").is_file():
            pid = int((folder / "pid").read_text())
            if process is not None and process.returncode is None:
                return JobStatus(job_id, "running", log=log)  # started, not yet at its first status write
        else:
            return JobStatus(job_id, "pending")
        if (process is not None and process.returncode is not None) or not _alive(pid):
            # Read again: the worker may have finished between the two reads.
            if status_file.is_file() and json.loads(status_file.read_text())["status"] != "running":
                return self.status(job_id)
            error = f"the worker process (pid {pid}) ended without finishing (killed?)"
            return JobStatus(job_id, "failed", error=error, log=log)
        return JobStatus(job_id, "running", log=log)

    def cancel(self, job_id: str) -> None:
        """Stop a running job's worker (it is then reported failed)."""
        status = self.status(job_id)
        if status.state == "running":
            pid = int((self.folder(job_id) / "pid").read_text())
            try:
                os.killpg(pid, 15)
            except ProcessLookupError:
                pass
            process = self._processes.get(job_id)
            if process is not None:
                process.wait()
