"""What a job of a Hydra multirun does with a folder that already holds something.

A single run refuses a folder that holds a run. A sweep's job is different:
running the sweep again should finish only what is missing, so a multirun job
(``python -m nip_like +sweep=<name>``, on any launcher) looks at its folder
first, as the batch script does (:func:`nip_like.sweeps.state.folder_state`):

* finished with the same config: skipped;
* interrupted (a checkpoint, no summary): resumed from ``checkpoints/last.pt``;
  this is also what a SLURM job requeued after a timeout does;
* incomplete (failed before its first checkpoint): what it wrote moves to
  ``<sweep root>/_incomplete/`` and the job starts afresh;
* holding a run of another config, or in use by another process: the job
  fails, leaving the folder alone.

Ctrl-C stays the launcher's: a job does not turn it into a stop at the next safe
point (:mod:`nip_like.interrupts`), so one Ctrl-C stops the whole multirun at once,
and each job keeps its last checkpoint.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from nip_like.config import run_id
from nip_like.errors import SweepJobError
from nip_like.experiment import run_experiment
from nip_like.sweeps.progress import progress_from_environment
from nip_like.sweeps.state import JobState, folder_state, move_aside


#: Where a multirun records the ``.hydra/`` files its job folders held before it started.
HYDRA_FILES_RECORD = ".hydra_files_before_sweep.json"


def record_hydra_files(sweep_dir: Path) -> None:
    """Record the text of every job folder's ``.hydra/*.yaml`` under ``sweep_dir`` (a sweep is starting)."""
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        return
    files = {str(path.relative_to(sweep_dir)): path.read_text() for path in sweep_dir.glob("**/.hydra/*.yaml")}
    temporary = sweep_dir / f"{HYDRA_FILES_RECORD}.tmp"
    temporary.write_text(json.dumps(files))
    os.replace(temporary, sweep_dir / HYDRA_FILES_RECORD)


def restore_hydra_files(run_dir: Path, sweep_dir: Path) -> None:
    """Put back the ``.hydra/`` files of ``run_dir`` as the sweep found them (the job leaves its folder alone)."""
    record = Path(sweep_dir) / HYDRA_FILES_RECORD
    if not record.is_file():
        return
    prefix = str(Path(run_dir).resolve().relative_to(Path(sweep_dir).resolve()))
    for name, text in json.loads(record.read_text()).items():
        if Path(name).parent.parent == Path(prefix):
            (Path(sweep_dir) / name).write_text(text)


def run_multirun_job(config: DictConfig, run_dir: Path) -> dict[str, float] | None:
    """Run, resume or skip one job of a Hydra multirun in ``run_dir``.

    Returns
    -------
    dict or None
        The final test metrics, or ``None`` when the job had already finished.

    Raises
    ------
    SweepJobError
        If the folder holds a run of another config.
    """
    run_dir = Path(run_dir)
    state, detail = folder_state(run_dir, run_id(config), bool(config.run.test_run))
    if state in (JobState.CONFLICT, JobState.FINISHED):
        # The folder keeps the run it holds, .hydra/ included (Hydra rewrote it before this job started).
        restore_hydra_files(run_dir, Path(HydraConfig.get().sweep.dir))
    if state == JobState.CONFLICT:
        raise SweepJobError(detail)
    if state == JobState.FINISHED:
        print(f"Already finished, skipped: {run_dir}")
        return None
    if state == JobState.INTERRUPTED:
        print(f"Resuming from its last checkpoint: {run_dir}")
        return run_experiment(config, run_dir, resume=True, handle_signals=False, progress=progress_from_environment)
    if state == JobState.INCOMPLETE:
        # Hydra has already written this job's own files (.hydra/, the job log) into the folder.
        hydra = HydraConfig.get()
        keep = tuple(name for name in (hydra.output_subdir, f"{hydra.job.name}.log") if name)
        moved = move_aside(run_dir, Path(hydra.sweep.dir).absolute(), keep=keep)
        print(f"Restarting ({detail}; what it held moved to {moved}): {run_dir}")
    return run_experiment(config, run_dir, handle_signals=False, progress=progress_from_environment)
