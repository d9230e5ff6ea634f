"""Fine-tune jobs through submitit: submit, poll, fetch the model, read the error.

:class:`FineTuneBackend` is what a text trainer talks to.
:class:`SubmititFineTuneBackend` runs each job
(:func:`nip_like.text.worker.run_job`) through `submitit
<https://github.com/facebookincubator/submitit>`_: its local executor (a
process on this machine) or its SLURM executor (``sbatch``), as
``trainer.jobs`` (:class:`JobsConfig`) says. Each job has a folder of its own
under the run folder, which is also submitit's folder for it::

    <root>/<job_id>/spec.json                  the job (FineTuneSpec)
    <root>/<job_id>/job.json                   the latest attempt: executor, submitit's job id, log
    <root>/<job_id>/metrics.jsonl              each optimiser step's metrics
    <root>/<job_id>/<attempt>_0_log.out        the attempt's output, tracebacks included (submitit's log)
    <root>/<job_id>/<attempt>_0_result.pkl     the attempt's outcome (submitit's result)
    <root>/<job_id>/controller.log             the local executor's controllers' own output

``<attempt>`` is submitit's job id: the SLURM job id, or the local job's
process id. Job states are submitit's (``sacct`` on SLURM). Job ids are
derived from (run, iteration, group) by the trainer, so a resumed run asks for
the same ids: a job that succeeded is never run again, one that is still
running (it outlives the trainer) is re-attached from ``job.json`` and waited
for, and one that ended without a result (killed from outside, out of memory,
out of time) is reported ``failed`` with its log, never left ``running``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Optional

from submitit import LocalExecutor, SlurmExecutor
from submitit.core.core import Job
from submitit.core.utils import FailedJobError
from submitit.local.local import LocalJob
from submitit.slurm.slurm import SlurmJob

from nip_like import interrupts
from nip_like.allowed import checked
from nip_like.errors import ConfigError, FineTuneError, one_line

if TYPE_CHECKING:
    from nip_like.text.fine_tune import FineTuneSpec

#: The states of a job.
JOB_STATES = ("pending", "running", "succeeded", "failed")
#: Where jobs can run (``trainer.jobs.executor``).
EXECUTORS = ("local", "slurm")
#: The SLURM commands the slurm executor needs: submit (sbatch), run (srun, in the batch script), states (sacct).
SLURM_COMMANDS = ("sbatch", "srun", "sacct")


@dataclass
class JobsConfig:
    """Where the text trainers' fine-tune jobs run (``trainer.jobs``; the options of the sweeps' submitit launcher).

    A run setting: it does not change results, and it is left out of the run id.
    The SLURM options are ignored by the local executor, except ``timeout_min``
    and ``setup``.
    """

    executor: str = checked("local", choices=EXECUTORS)  # local: a process on this machine | slurm: sbatch (needs sbatch, srun and sacct)
    timeout_min: int = checked(720, ge=1)  # each job's time limit in minutes (SLURM --time; the local executor stops the job too)
    partition: Optional[str] = None  # slurm: --partition; null = the cluster's default
    qos: Optional[str] = None  # slurm: --qos
    account: Optional[str] = None  # slurm: --account
    constraint: Optional[str] = None  # slurm: --constraint
    exclude: Optional[str] = None  # slurm: --exclude (nodes)
    gres: Optional[str] = None  # slurm: --gres
    cpus_per_task: Optional[int] = checked(None, ge=1)  # slurm: --cpus-per-task, also the job's torch threads; null = the cluster's default
    gpus_per_node: Optional[int] = checked(None, ge=0)  # GPUs per job (slurm: --gpus-per-node); null: local jobs see the trainer's GPUs when run.device is cuda, slurm asks for none
    mem_gb: Optional[int] = checked(None, ge=1)  # slurm: --mem in GB; null = the cluster's default
    setup: list[str] = field(default_factory=list)  # shell lines run before each job (modules, the virtual environment, exports)
    additional_parameters: dict[str, Any] = field(default_factory=dict)  # other sbatch options: {mail-user: me@lab.org}
    poll_seconds: float = checked(0.5, gt=0)  # how often the trainer reads the jobs' states while it waits


def check_executor(jobs: Any, where: str = "trainer.jobs.executor") -> None:
    """Refuse, in one line, an executor this machine cannot use (``slurm`` without SLURM's commands).

    Raises
    ------
    ConfigError
        Naming the executor, the missing commands and what is allowed here.
    """
    executor = str(jobs.executor)
    if executor not in EXECUTORS:
        raise ConfigError(f"{where}={executor!r} is unknown; allowed: {', '.join(EXECUTORS)}")
    if executor == "slurm":
        missing = [command for command in SLURM_COMMANDS if shutil.which(command) is None]
        if missing:
            raise ConfigError(
                f"{where}=slurm needs SLURM's {', '.join(SLURM_COMMANDS)} on PATH, and this machine has no "
                f"{', '.join(missing)}; allowed here: local"
            )


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

    #: Seconds between two reads of the jobs' states in :meth:`wait`.
    poll_seconds: float = 0.5

    @abstractmethod
    def submit(self, spec: "FineTuneSpec") -> JobStatus:
        """Start ``spec`` unless a job with its id already succeeded or is running; its status."""

    @abstractmethod
    def status(self, job_id: str) -> JobStatus:
        """The job's current status (``pending`` if it was never submitted)."""

    def wait(self, job_ids: Iterable[str], poll_seconds: float | None = None, timeout: float | None = None) -> dict[str, JobStatus]:
        """Poll until every job has finished; their statuses.

        Raises
        ------
        FineTuneError
            If ``timeout`` seconds pass first.
        """
        job_ids = list(job_ids)
        poll_seconds = self.poll_seconds if poll_seconds is None else poll_seconds
        started = time.monotonic()
        while True:
            statuses = {job_id: self.status(job_id) for job_id in job_ids}
            if all(status.finished for status in statuses.values()):
                return statuses
            if timeout is not None and time.monotonic() - started > timeout:
                waiting = [job_id for job_id, status in statuses.items() if not status.finished]
                raise FineTuneError(f"fine-tune jobs {waiting} did not finish within {timeout:g} s")
            # A stop request does not wait for the jobs: they run on, and a resume adopts them.
            interrupts.sleep(poll_seconds, f"fine-tune jobs {job_ids}")


# ------------------------------------------------------------------ submitit's local executor, detached
def _controller_alive(pid: int, folder: Path) -> bool:
    """Whether submitit's local controller of a job in ``folder`` still runs as ``pid`` (not a zombie, not a reused pid)."""
    proc = Path(f"/proc/{pid}")
    if proc.exists():
        deadline = time.monotonic() + 2.0
        try:
            while True:
                if (proc / "stat").read_text().split(") ")[-1].startswith("Z"):
                    return False
                command = (proc / "cmdline").read_bytes()
                # Empty while the kernel is still replacing the process image (just after submission): read again.
                if command or time.monotonic() > deadline:
                    break
                time.sleep(0.02)
        except OSError:
            return False
        return b"submitit.local._local" in command and str(folder).encode() in command
    if not Path("/proc/self").exists():  # no /proc (macOS): the pid alone
        try:
            os.kill(pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    return False


class _LocalJob(LocalJob):
    """submitit's local job, also when re-attached by a later process (a resumed run).

    submitit's :class:`~submitit.local.local.LocalJob` knows its state only
    through the process handle of the process that submitted it; re-attached by
    its id (the controller's pid) and folder, it is running while that
    controller lives. Its result file is on this machine's disk, so nothing
    waits for it to appear.
    """

    _results_timeout_s = 0

    def get_info(self, mode: str = "force") -> dict[str, str]:
        if self._process is not None:
            return super().get_info(mode)
        if self.paths.result_pickle.exists():
            return {"jobState": "FINISHED"}
        if _controller_alive(int(self.job_id), self.paths.folder):
            return {"jobState": "RUNNING"}
        return {"jobState": "NO PROCESS AND NO RESULT"}

    #: Seconds a cancelled job's controller gets to stop its tasks before its whole process group is killed.
    cancel_grace_s: float = 5.0

    def cancel(self, check: bool = True) -> None:  # noqa: ARG002 - submitit's signature
        """Stop the job: SIGINT to its controller's process group, SIGKILL to the group if it still runs after a grace.

        The controller answers SIGINT by stopping its tasks (SIGINT, then
        SIGKILL); a task stuck in native code, or a group that ignores SIGINT,
        is killed after :attr:`cancel_grace_s` seconds, so that a cancelled job
        always ends (it is then reported failed, without a result).
        """
        group = int(self.job_id)
        try:
            os.killpg(group, signal.SIGINT)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + self.cancel_grace_s
        while time.monotonic() < deadline:
            if self._process is not None and self._process.poll() is not None:
                break
            if self._process is None and not _controller_alive(group, self.paths.folder):
                break
            time.sleep(0.05)
        try:
            os.killpg(group, signal.SIGKILL)  # the tasks left behind, or the controller itself
        except (ProcessLookupError, PermissionError):
            pass

    def __del__(self) -> None:
        # submitit's clean-up fails when the interpreter is shutting down (its modules' globals are gone).
        try:
            super().__del__()
        except Exception:  # noqa: BLE001
            pass


def _default_interrupt() -> None:
    """In a job's controller before it starts: SIGINT back to its default, also when the trainer ignores it.

    A trainer started in the background by a non-interactive shell (``nohup
    ... &``, many CI runners) inherits SIGINT ignored; the controller and its
    tasks would inherit that too, and a cancelled job would run on.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class _LocalExecutor(LocalExecutor):
    """submitit's local executor, with the job's controller in a session of its own.

    So that Ctrl-C in the trainer's terminal (sent to its whole process group)
    stops the trainer after its stage, as documented, and not the jobs, which a
    resumed run then adopts. Otherwise submitit's own ``_submit_command`` and
    ``start_controller``, which start the controller in the caller's session
    with the caller's standard streams (here ``controller.log`` in the job's folder).
    """

    job_class = _LocalJob

    def _submit_command(self, command: str) -> _LocalJob:
        ntasks = self.parameters.get("tasks_per_node", 1)
        n_gpus = self.parameters.get("gpus_per_node", 0)
        visible_gpus = self.parameters.get("visible_gpus", ())
        gpus = range(n_gpus) if visible_gpus == () else visible_gpus[:n_gpus]
        setup = self.parameters.get("setup", ())
        environment = {
            **os.environ,
            "SUBMITIT_LOCAL_NTASKS": str(ntasks),
            "SUBMITIT_LOCAL_COMMAND": command,
            "SUBMITIT_LOCAL_TIMEOUT_S": str(int(60 * self.parameters.get("timeout_min", 2.0))),
            "SUBMITIT_LOCAL_SIGNAL_DELAY_S": str(int(self.parameters.get("signal_delay_s", 30))),
            "SUBMITIT_LOCAL_NODEID": "0",
            "SUBMITIT_LOCAL_JOB_NUM_NODES": "1",
            "SUBMITIT_STDERR_TO_STDOUT": "1" if self.parameters.get("stderr_to_stdout", False) else "",
            "SUBMITIT_EXECUTOR": "local",
            "CUDA_VISIBLE_DEVICES": ",".join(str(gpu) for gpu in gpus),
            "SUBMITIT_LOCAL_WITH_SHELL": "1" if setup else "",
        }
        controller: Any = [sys.executable, "-m", "submitit.local._local", str(self.folder)]
        if setup:
            controller = " && ".join([*setup, subprocess.list2cmdline(controller)])
        # The controller's own output (a failing setup line, its traceback when cancelled) goes to the job's folder,
        # not to the terminal of a trainer that may be gone.
        with open(self.folder / "controller.log", "a") as output:
            process = subprocess.Popen(
                controller, shell=bool(setup), env=environment, start_new_session=True,
                stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
                preexec_fn=_default_interrupt,
            )
        return _LocalJob(folder=self.folder, job_id=str(process.pid), process=process, tasks=list(range(ntasks)))


def _local_gpus(jobs: JobsConfig, device: str) -> dict[str, Any]:
    """The local executor's GPU parameters: the configured count, else the trainer's own GPUs for a CUDA device."""
    if jobs.gpus_per_node is not None:
        return {"gpus_per_node": int(jobs.gpus_per_node)}
    if not device.startswith("cuda"):
        return {"gpus_per_node": 0}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [item.strip() for item in visible.split(",") if item.strip()]
        if all(item.isdigit() for item in ids):
            return {"gpus_per_node": len(ids), "visible_gpus": tuple(int(item) for item in ids)}
    import torch

    return {"gpus_per_node": torch.cuda.device_count()}


# ------------------------------------------------------------------ the backend
#: The marker that :func:`nip_like.text.worker.run_job` puts before a failed job's one-line error.
ERROR_MARKER = "JobFailed: "


class SubmititFineTuneBackend(FineTuneBackend):
    """Each job through a submitit executor, local or SLURM (see the module docstring).

    Parameters
    ----------
    root : Path
        The folder of the jobs' folders (``<run>/fine_tune``).
    jobs : JobsConfig, optional
        The executor and its options (``trainer.jobs``); the local executor's defaults if omitted.
    """

    def __init__(self, root: Path, jobs: Any = None) -> None:
        self.root = Path(root)
        self.jobs = jobs if jobs is not None else JobsConfig()
        check_executor(self.jobs)
        self.poll_seconds = float(self.jobs.poll_seconds)
        self._jobs: dict[str, Job] = {}  # the jobs this process submitted or re-attached, by our job id

    def folder(self, job_id: str) -> Path:
        """The job's folder (also submitit's folder for its attempts)."""
        return self.root / job_id

    def _executor(self, folder: Path, spec: "FineTuneSpec") -> LocalExecutor | SlurmExecutor:
        jobs = self.jobs
        setup = [str(line) for line in jobs.setup]
        if str(jobs.executor) == "local":
            executor = _LocalExecutor(folder)
            executor.update_parameters(
                timeout_min=int(jobs.timeout_min), stderr_to_stdout=True, setup=setup, **_local_gpus(jobs, spec.device)
            )
            return executor
        executor = SlurmExecutor(folder, max_num_timeout=0)
        parameters = {
            "job_name": spec.job_id,
            "time": int(jobs.timeout_min),
            "partition": jobs.partition,
            "qos": jobs.qos,
            "account": jobs.account,
            "constraint": jobs.constraint,
            "exclude": jobs.exclude,
            "gres": jobs.gres,
            "cpus_per_task": jobs.cpus_per_task,
            "gpus_per_node": jobs.gpus_per_node,
            "mem": None if jobs.mem_gb is None else f"{int(jobs.mem_gb)}GB",
            "setup": setup or None,
            "additional_parameters": dict(jobs.additional_parameters) or None,
            "stderr_to_stdout": True,
        }
        executor.update_parameters(**{key: value for key, value in parameters.items() if value is not None})
        return executor

    def submit(self, spec: "FineTuneSpec") -> JobStatus:
        from nip_like.checkpoint import write_text_atomic
        from nip_like.text.worker import run_job

        spec.check()
        current = self.status(spec.job_id)
        if current.state in ("succeeded", "running"):
            return current
        folder = self.folder(spec.job_id)
        folder.mkdir(parents=True, exist_ok=True)
        write_text_atomic(spec.to_json(), folder / "spec.json")
        try:
            job = self._executor(folder, spec).submit(run_job, str(folder))
        except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as error:  # sbatch refused it, ...
            raise FineTuneError(
                f"fine-tune job {spec.job_id} could not be submitted ({self.jobs.executor} executor): {one_line(error)}"
            ) from error
        self._jobs[spec.job_id] = job
        record = {"executor": str(self.jobs.executor), "job_id": str(job.job_id), "log": str(job.paths.stdout)}
        write_text_atomic(json.dumps(record, indent=2) + "\n", folder / "job.json")
        return JobStatus(spec.job_id, "running", log=record["log"])

    def _job(self, job_id: str) -> tuple[Job, str] | None:
        """The job's latest attempt (re-attached from ``job.json`` if another process submitted it) and its log."""
        record_file = self.folder(job_id) / "job.json"
        if not record_file.is_file():
            return None
        record = json.loads(record_file.read_text())
        job = self._jobs.get(job_id)
        if job is None or job.job_id != record["job_id"]:
            kind = _LocalJob if record["executor"] == "local" else SlurmJob
            job = self._jobs[job_id] = kind(folder=self.folder(job_id), job_id=record["job_id"])
        return job, record["log"]

    def status(self, job_id: str) -> JobStatus:
        attached = self._job(job_id)
        if attached is None:
            return JobStatus(job_id, "pending")
        job, log = attached
        if not job.done():
            return JobStatus(job_id, "running", log=log)
        error = job.exception()
        if error is None:
            return JobStatus(job_id, "succeeded", model=str(job.result()), log=log)
        if isinstance(error, FailedJobError):
            return JobStatus(job_id, "failed", error=_error_line(str(error)), log=log)
        state = job.state
        return JobStatus(
            job_id,
            "failed",
            error=f"the job ended without a result (submitit state {state}): killed from outside, out of memory or out of time?",
            log=log,
        )

    def cancel(self, job_id: str) -> None:
        """Stop a running job (it is then reported failed)."""
        attached = self._job(job_id)
        if attached is not None and not attached[0].done():
            attached[0].cancel(check=False)


def _error_line(message: str) -> str:
    """The one-line error of a job that raised, from submitit's message with its trace.

    :func:`~nip_like.text.worker.run_job` raises its error as one line after
    :data:`ERROR_MARKER`; a job that failed before it (its function could not
    be loaded) gives the trace's last line.
    """
    parts = message.split("----------------------")
    lines = [line.strip() for line in (parts[1] if len(parts) >= 3 else message).splitlines() if line.strip()]
    for line in reversed(lines):
        if ERROR_MARKER in line:
            return line.split(ERROR_MARKER, 1)[1]
    return lines[-1] if lines else "unknown error"
