"""Run a sweep's jobs as subprocesses, a few at a time, behind one progress bar.

Each job is ``python -m nip_like <overrides> hydra.run.dir=<folder>`` (or
``python -m nip_like.resume <folder>`` for an interrupted one) on
``threads`` threads, with its standard output and error appended to
``stdout.log`` and ``stderr.log`` in its folder. A job that fails does not stop
the others; its last line of standard error is kept for the final list.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from tqdm.auto import tqdm

import nip_like
from nip_like.experiment import SUMMARY_FILE
from nip_like.sweeps.grid import Sweep, job_command, resume_command
from nip_like.sweeps.progress import PROGRESS_FILE_ENV, read_progress
from nip_like.sweeps.state import JobPlan, JobState, move_aside

#: Name of the progress file in a job folder (see nip_like.sweeps.progress).
PROGRESS_FILE = ".sweep_progress"

#: Seconds between two looks at the running jobs.
POLL_SECONDS = 0.25

#: Seconds a stopped job gets to exit after SIGINT before it is terminated.
STOP_GRACE_SECONDS = 10.0


@dataclass
class JobOutcome:
    """What happened to one job.

    Parameters
    ----------
    plan : JobPlan
        The job and what was planned for it.
    status : str
        ``skipped``, ``finished``, ``failed``, or after an interruption
        ``stopped`` (it was running) or ``not started``.
    message : str
        For a failure, the reason in one line (the job's last line of standard
        error); for a restarted job, where its old folder went.
    seconds : float
        Wall time of the job's process.
    """

    plan: JobPlan
    status: str
    message: str = ""
    seconds: float = 0.0


@dataclass
class SweepResult:
    """The outcome of every job, in grid order, and whether the sweep was interrupted."""

    outcomes: list[JobOutcome] = field(default_factory=list)
    interrupted: bool = False

    def with_status(self, status: str) -> list[JobOutcome]:
        """Return the outcomes with this status."""
        return [outcome for outcome in self.outcomes if outcome.status == status]


@dataclass
class _Running:
    plan: JobPlan
    process: subprocess.Popen
    stderr: IO[str]
    stderr_offset: int
    stdout: IO[str]
    progress: Path
    started: float
    note: str = ""


def _child_environment(threads: int, progress: Path) -> dict[str, str]:
    environment = dict(os.environ)
    # The jobs run the same nip_like as the sweep, whatever the installed one.
    package_root = str(Path(nip_like.__file__).resolve().parent.parent)
    paths = [package_root] + [p for p in environment.get("PYTHONPATH", "").split(os.pathsep) if p]
    environment["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        environment[variable] = str(threads)
    environment[PROGRESS_FILE_ENV] = str(progress)
    return environment


def last_line(text: str) -> str:
    """Return the last non-empty line of ``text`` (progress-bar redraws dropped)."""
    for line in reversed(text.replace("\r", "\n").splitlines()):
        if line.strip():
            return line.strip()
    return ""


class SweepRunner:
    """Run the planned jobs of a sweep.

    Parameters
    ----------
    sweep : Sweep
        The expanded sweep.
    plans : list of JobPlan
        Every job with its state (:func:`nip_like.sweeps.state.inspect_job`).
    max_parallel : int
        Jobs running at once.
    threads : int
        Threads per job (``run.num_threads`` and ``OMP_NUM_THREADS``).
    python : str
        The interpreter that runs the jobs.
    progress_bar : bool
        Draw the overall progress bar.
    """

    def __init__(
        self,
        sweep: Sweep,
        plans: list[JobPlan],
        max_parallel: int = 1,
        threads: int = 1,
        python: str = sys.executable,
        progress_bar: bool = True,
    ) -> None:
        self.sweep = sweep
        self.plans = plans
        self.max_parallel = max(1, int(max_parallel))
        self.threads = max(1, int(threads))
        self.python = python
        self.progress_bar = progress_bar
        self._outcomes: dict[int, JobOutcome] = {}
        self._done = {id(plan): plan.done for plan in plans}
        self._shown: tuple[int, str] | None = None

    def run(self) -> SweepResult:
        """Run every job that needs it; return the outcomes (interrupts are caught)."""
        pending: deque[JobPlan] = deque()
        for plan in self.plans:
            if plan.action == "skip":
                self._record(plan, "skipped")
            elif plan.action == "fail":
                self._record(plan, "failed", plan.detail)
            else:
                pending.append(plan)
        running: list[_Running] = []
        bar = tqdm(
            total=self.sweep.total_iterations,
            initial=sum(self._done.values()),
            unit="it",
            desc=f"Sweep {self.sweep.name}",
            disable=not self.progress_bar,
            dynamic_ncols=True,
        )
        for outcome in self._outcomes.values():
            if outcome.status == "failed":
                bar.write(f"failed   {outcome.plan.job.name}: {outcome.message}")
        interrupted = False
        try:
            while pending or running:
                while pending and len(running) < self.max_parallel:
                    running.append(self._start(pending.popleft(), bar))
                time.sleep(POLL_SECONDS)
                for job in list(running):
                    self._update_progress(job)
                    if job.process.poll() is not None:
                        running.remove(job)
                        self._finish(job, bar)
                self._refresh(bar, len(running))
        except KeyboardInterrupt:
            interrupted = True
            self._stop(running, pending)
        finally:
            bar.close()
        outcomes = [self._outcomes[id(plan)] for plan in self.plans if id(plan) in self._outcomes]
        return SweepResult(outcomes=outcomes, interrupted=interrupted)

    # ---------------------------------------------------------------- helpers
    def _record(self, plan: JobPlan, status: str, message: str = "", seconds: float = 0.0) -> None:
        self._outcomes[id(plan)] = JobOutcome(plan, status, message, seconds)

    def _start(self, plan: JobPlan, bar: tqdm) -> _Running:
        job = plan.job
        note = ""
        if plan.state == JobState.INCOMPLETE:
            moved = move_aside(job.folder, self.sweep.root)
            note = f"old folder moved to {moved}"
            bar.write(f"restart  {job.name} ({plan.detail}; {note})")
        if plan.state == JobState.INTERRUPTED:
            command = resume_command(job, self.python, self.threads)
        else:
            command = job_command(job, self.sweep, self.python, self.threads)
        job.folder.mkdir(parents=True, exist_ok=True)
        progress = job.folder / PROGRESS_FILE
        progress.unlink(missing_ok=True)  # a killed earlier attempt's count would be ahead of the checkpoint
        stdout = open(job.folder / "stdout.log", "a")
        stderr = open(job.folder / "stderr.log", "a")
        for handle in (stdout, stderr):
            handle.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(command)}\n")
            handle.flush()
        # In a process group of its own, a job gets Ctrl-C from the sweep only (see _stop), not also from the
        # terminal: a second SIGINT would stop it at once instead of at its next safe point.
        process = subprocess.Popen(
            command,
            stdout=stdout,
            stderr=stderr,
            env=_child_environment(self.threads, progress),
            text=True,
            process_group=0,
        )
        return _Running(plan, process, stderr, stderr.tell(), stdout, progress, time.perf_counter(), note)

    def _update_progress(self, job: _Running) -> None:
        done = read_progress(job.progress)
        if done is not None:
            self._done[id(job.plan)] = min(done, job.plan.job.iterations)

    def _refresh(self, bar: tqdm, running: int) -> None:
        failed = sum(outcome.status == "failed" for outcome in self._outcomes.values())
        finished = sum(outcome.status in ("finished", "skipped") for outcome in self._outcomes.values())
        postfix = f"jobs done {finished}/{len(self.plans)}, running {running}, failed {failed}"
        shown = (sum(self._done.values()), postfix)
        if shown != self._shown:  # redraw only on change, so that a log file gets few lines
            self._shown = shown
            bar.n = shown[0]
            bar.set_postfix_str(shown[1])

    def _finish(self, job: _Running, bar: tqdm | None) -> None:
        seconds = time.perf_counter() - job.started
        for handle in (job.stdout, job.stderr):
            handle.close()
        with open(job.plan.job.folder / "stderr.log") as handle:
            handle.seek(job.stderr_offset)
            error = last_line(handle.read())
        code = job.process.returncode
        name = job.plan.job.name
        write = bar.write if bar is not None else (lambda text: None)
        if code == 0 and (job.plan.job.folder / SUMMARY_FILE).is_file():
            self._done[id(job.plan)] = job.plan.job.iterations
            job.progress.unlink(missing_ok=True)
            self._record(job.plan, "finished", job.note, seconds)
            write(f"finished {name} ({seconds:.1f} s)")
        elif bar is None:
            self._record(job.plan, "stopped", "interrupted", seconds)
        else:
            message = error or f"exit status {code}"
            if code == 0:
                message = f"exited without writing {SUMMARY_FILE}"
            self._record(job.plan, "failed", message, seconds)
            write(f"failed   {name}: {message}")

    def _stop(self, running: list[_Running], pending: deque[JobPlan]) -> None:
        """Stop the running jobs after an interrupt; their checkpoints stay.

        Each job gets SIGINT and stops at its next safe point, writing its
        checkpoint (:mod:`nip_like.interrupts`); a second Ctrl-C while waiting
        is passed on, and the jobs stop at once. A job still running after
        :data:`STOP_GRACE_SECONDS` gets SIGTERM, then SIGKILL.
        """
        self._signal(running, signal.SIGINT)
        deadline = time.perf_counter() + STOP_GRACE_SECONDS
        for job in running:
            while True:
                try:
                    job.process.wait(timeout=max(0.0, deadline - time.perf_counter()))
                except KeyboardInterrupt:
                    self._signal(running, signal.SIGINT)
                    continue
                except subprocess.TimeoutExpired:
                    job.process.terminate()
                    try:
                        job.process.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        job.process.kill()
                        job.process.wait()
                break
            # A job that finished just before the interrupt counts as finished.
            self._finish(job, None)
        for plan in pending:
            self._record(plan, "not started")

    @staticmethod
    def _signal(running: list[_Running], signum: int) -> None:
        for job in running:
            if job.process.poll() is None:
                job.process.send_signal(signum)
