"""The fine-tune stages: datasets, job specs, submitting the groups' jobs and awaiting them.

A group's job at an iteration has a stable name (``it0003-verifier``; the warm
start's is ``warm-verifier``) that places its model folder and derives its
seed, and a stable id (the run id, then the name) under which a resumed run
adopts it. A failed job stops the run with its error and log path.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Mapping

from nip_like.checkpoint import write_text_atomic
from nip_like.errors import ConfigError, FineTuneError
from nip_like.text.jobs import FineTuneBackend, JobStatus, JobsConfig
from nip_like.trainers.text.state import GroupState


def job_name(group: str, iteration: int, warm_start: bool = False) -> str:
    """``group``'s job at ``iteration`` within the run: ``it0003-verifier``; the warm start's: ``warm-verifier``."""
    return f"warm-{group}" if warm_start else f"it{iteration:04d}-{group}"


def job_threads(jobs: JobsConfig, num_threads: int | None, num_groups: int) -> int | None:
    """Threads per job.

    On SLURM ``jobs.cpus_per_task``, else ``num_threads`` (``run.num_threads``),
    else torch's default on the job's node; locally ``num_threads``, else this
    machine's cores shared among the groups' concurrent jobs.
    """
    slurm = str(jobs.executor) == "slurm"
    if slurm and jobs.cpus_per_task:
        return int(jobs.cpus_per_task)
    if num_threads:
        return int(num_threads)
    return None if slurm else max(1, (os.cpu_count() or 1) // num_groups)


def write_dataset(run_dir: Path, name: str, records: list[dict]) -> Path:
    """Write fine-tune records (JSONL) to ``run_dir/datasets/<name>.jsonl``, atomically."""
    path = Path(run_dir) / "datasets" / f"{name}.jsonl"
    write_text_atomic("".join(json.dumps(record) + "\n" for record in records), path)
    return path


def sft_record(turn: dict, reply: str | None = None) -> dict:
    """A turn as an SFT record in TRL's conversational format: the chat, then the reply as the assistant's."""
    return {"messages": [*turn["chat"], {"role": "assistant", "content": turn["reply"] if reply is None else reply}]}


def submit_jobs(backend: FineTuneBackend, groups: dict[str, GroupState], specs: Mapping) -> None:
    """Submit ``specs`` (group -> :class:`~nip_like.text.fine_tune.FineTuneSpec`) and note each job in its group's state.

    Groups without a job keep their model. Leave scripted players' groups
    out of ``specs``: they are never fine-tuned.
    """
    for group, spec in specs.items():
        if group not in groups:
            raise ConfigError(f"a fine-tune job for {group!r}, which is not a model group: {sorted(groups)}")
        status = backend.submit(spec)
        groups[group].job_id = spec.job_id
        groups[group].job_status = status.state
    for group in set(groups) - set(specs):
        groups[group].job_id = None
        groups[group].job_status = None


def await_jobs(backend: FineTuneBackend, groups: dict[str, GroupState], timeout: float | None) -> list[tuple[str, JobStatus]]:
    """Wait for the groups' jobs and note their states; switch each group to its new model unless a job failed.

    Returns
    -------
    list of (str, JobStatus)
        The groups whose job failed, with its status; when not empty, no
        group's model has changed.
    """
    pending = {group: state.job_id for group, state in groups.items() if state.job_id is not None}
    statuses = backend.wait(pending.values(), timeout=timeout)
    failed = [(group, statuses[job_id]) for group, job_id in pending.items() if statuses[job_id].state == "failed"]
    for group, job_id in pending.items():
        groups[group].job_status = statuses[job_id].state
    if failed:
        return failed
    for group, job_id in pending.items():
        groups[group].model = statuses[job_id].model
        groups[group].job_id = None
    return []


def failure(group: str, status: JobStatus) -> FineTuneError:
    """The one-line error of ``group``'s failed job: its id, error and log."""
    return FineTuneError(f"fine-tune job {status.job_id} (group {group}) failed: {status.error}; log: {status.log}")
