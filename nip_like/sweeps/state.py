"""What a job's folder holds, and so what a sweep does with the job.

=================  ===========================================  ===========
state              the folder                                   action
=================  ===========================================  ===========
``new``            does not exist, or holds only logs           run
``finished``       has ``summary.json`` of the job's config     skip
``interrupted``    has ``checkpoints/last.pt``, no summary      resume
``incomplete``     has the run's ``config.yaml`` but no         move aside,
                   checkpoint (a run that failed or was         then run
                   stopped before its first checkpoint)
``conflict``       holds a run of another config                fail
``bad config``     (the job's config does not compose)          fail
=================  ===========================================  ===========

The batch script (:mod:`nip_like.sweeps.runner`) and the jobs of a Hydra
multirun (:mod:`nip_like.sweeps.multirun`) act on the same states, so either
can finish a sweep that the other started.

A run's config is told apart by its run id (:func:`nip_like.config.run_id`,
the hyper-parameters) and by ``run.test_run``, which a run id ignores. An
incomplete folder is never deleted: it moves to
``<sweep root>/_incomplete/<folder name>.<n>``.
"""

from __future__ import annotations

import enum
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from nip_like.checkpoint import load_checked
from nip_like.config import run_id
from nip_like.experiment import CONFIG_FILE, SUMMARY_FILE
from nip_like.run_lock import in_use_message, lock_holder
from nip_like.sweeps.grid import Job

#: Folder (inside the sweep root) where incomplete job folders are moved.
INCOMPLETE_DIR = "_incomplete"


class JobState(enum.Enum):
    """What a job's folder holds."""

    NEW = "new"
    FINISHED = "finished"
    INTERRUPTED = "interrupted"
    INCOMPLETE = "incomplete"
    CONFLICT = "conflict"
    BAD_CONFIG = "bad config"


#: What the sweep does in each state.
ACTIONS = {
    JobState.NEW: "run",
    JobState.FINISHED: "skip",
    JobState.INTERRUPTED: "resume",
    JobState.INCOMPLETE: "restart",
    JobState.CONFLICT: "fail",
    JobState.BAD_CONFIG: "fail",
}


@dataclass
class JobPlan:
    """A job, the state of its folder and what the sweep will do.

    Parameters
    ----------
    job : Job
        The grid point.
    state : JobState
        What its folder holds.
    done : int
        Iterations already completed: all of them for a finished job, the last
        checkpoint's train iterations for an interrupted one.
    detail : str
        A short explanation (the error of a failing job).
    """

    job: Job
    state: JobState
    done: int = 0
    detail: str = ""

    @property
    def action(self) -> str:
        """``run``, ``skip``, ``resume``, ``restart`` or ``fail``."""
        return ACTIONS[self.state]


def _folder_run(folder: Path) -> tuple[str | None, bool]:
    """Return the run id and test-run flag of the run a folder holds.

    The run id comes from ``summary.json`` when the run finished, otherwise
    from the config it keeps.
    """
    config = OmegaConf.load(folder / CONFIG_FILE)
    test_run = bool(OmegaConf.select(config, "run.test_run", default=False))
    summary = folder / SUMMARY_FILE
    if summary.is_file():
        return json.loads(summary.read_text()).get("run_id"), test_run
    return run_id(config), test_run


def folder_state(folder: Path, job_run_id: str | None, test_run: bool) -> tuple[JobState, str]:
    """Return what a job folder holds, and a short explanation.

    Parameters
    ----------
    folder : Path
        The job's run folder.
    job_run_id : str
        The run id of the job's config.
    test_run : bool
        Whether the job runs in test-run mode.

    Notes
    -----
    A folder that another process is running in (it holds the folder's
    ``run.lock``, :mod:`nip_like.run_lock`) is a conflict, whatever it holds.
    A folder without the run's ``config.yaml`` (one that Hydra or the sweep
    script has just made, holding only logs) counts as new: nothing of a run
    is in it yet.
    """
    folder = Path(folder)
    holder = lock_holder(folder)
    if holder is not None:  # another process is running in it: leave it alone
        return JobState.CONFLICT, in_use_message(folder, holder)
    finished = (folder / SUMMARY_FILE).is_file()
    last = folder / "checkpoints" / "last.pt"
    if not finished and not last.is_file():
        if (folder / CONFIG_FILE).is_file():
            return JobState.INCOMPLETE, "no checkpoint yet"
        return JobState.NEW, ""
    try:
        folder_run = _folder_run(folder)
    except Exception as error:  # an unreadable config or summary: leave the folder alone
        return JobState.CONFLICT, f"{folder} holds an unreadable run ({type(error).__name__})"
    if folder_run != (job_run_id, test_run):
        return JobState.CONFLICT, (
            f"{folder} holds a run of another config (run id {folder_run[0]}, this job's is {job_run_id}); "
            f"give the sweep another folder or move this one away"
        )
    if finished:
        return JobState.FINISHED, ""
    return JobState.INTERRUPTED, "from its last checkpoint"


def inspect_job(job: Job) -> JobPlan:
    """Return what ``job``'s folder holds and what to do with it."""
    if job.error is not None:
        return JobPlan(job, JobState.BAD_CONFIG, detail=job.error)
    state, detail = folder_state(job.folder, job.run_id, job.test_run)
    done = {JobState.FINISHED: job.iterations}.get(state, 0)
    if state == JobState.INTERRUPTED:
        done = checkpoint_iteration(job.folder / "checkpoints" / "last.pt")
    return JobPlan(job, state, done=done, detail=detail)


def checkpoint_iteration(path: Path) -> int:
    """Return the train iteration a checkpoint was written at (0 if it cannot be read)."""
    try:
        return int(load_checked(path)["trainer"]["train_state"]["iteration"])
    except Exception:  # the resume itself reports an unreadable checkpoint in one line
        return 0


def move_aside(folder: Path, root: Path, keep: tuple[str, ...] = ()) -> Path:
    """Move an incomplete job folder to ``<root>/_incomplete/<name>.<n>`` and return where.

    Parameters
    ----------
    folder : Path
        The job folder, inside ``root``.
    root : Path
        The sweep root.
    keep : tuple of str
        Names of entries to leave in place (a running Hydra job's own
        ``.hydra`` and log); when given, the folder stays and only its other
        entries move.
    """
    target_dir = Path(root) / INCOMPLETE_DIR
    target_dir.mkdir(parents=True, exist_ok=True)
    stem = str(Path(folder).relative_to(root)).replace("/", "_")
    number = 1
    while (target_dir / f"{stem}.{number}").exists():
        number += 1
    target = target_dir / f"{stem}.{number}"
    if not keep:
        shutil.move(str(folder), str(target))
        return target
    target.mkdir()
    for entry in Path(folder).iterdir():
        if entry.name not in keep:
            shutil.move(str(entry), str(target / entry.name))
    return target
