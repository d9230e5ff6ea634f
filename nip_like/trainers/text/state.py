"""The text trainers' experiment state: what is written after every stage, and where a resumed run starts.

The state (iteration, next stage, each model group's current model, job id
and job status, counters) goes to ``checkpoints/last.pt`` with the rest of the
checkpoint and, readable, to ``checkpoints/state.json``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from nip_like.checkpoint import write_text_atomic

#: The stages of an iteration, in order.
STAGES = ("sample_rollouts", "log_stats", "test", "create_fine_tune_jobs", "await_fine_tune_jobs")


@dataclass
class GroupState:
    """A model group's current model and its latest fine-tune job."""

    model: str  # folder (or served name) of the current model
    job_id: Optional[str] = None
    job_status: Optional[str] = None  # pending | running | succeeded | failed


@dataclass
class TextTrainState:
    """The experiment state, written after every stage."""

    iteration: int = 0  # the iteration in progress
    stage: str = "warm_start"  # the next stage to run: warm_start, one of STAGES, or final_test
    groups: dict[str, GroupState] = field(default_factory=dict)
    frames: int = 0  # environment steps sampled by the iterations so far (each round of each train episode)
    iteration_seconds: float = 0.0  # wall time of the current iteration's stages so far
    train_seconds: float = 0.0  # wall time in the stages, over all sessions
    rollouts_sha256: Optional[str] = None  # SHA-256 of the current iteration's rollouts file, once written

    def to_dict(self) -> dict[str, Any]:
        """The state as plain data (``checkpoints/state.json``)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> "TextTrainState":
        """The state written by :meth:`to_dict`."""
        groups = {name: GroupState(**group) for name, group in state["groups"].items()}
        return cls(**{**state, "groups": groups})

    def advance(self, stage: str, num_iterations: int) -> None:
        """Make ``stage`` the next one; ``next_iteration`` starts the next iteration (or the final test after the last)."""
        if stage == "next_iteration":
            self.iteration += 1
            self.rollouts_sha256 = None
            stage = STAGES[0] if self.iteration < num_iterations else "final_test"
        self.stage = stage


def total_stages(num_iterations: int) -> int:
    """The stages of a run: the warm start, every stage of every iteration, the final test."""
    return 1 + num_iterations * len(STAGES) + 1


def stages_done(state: TextTrainState, num_iterations: int) -> int:
    """The stages ``state`` has completed (for a resumed run's progress bar)."""
    if state.stage == "warm_start":
        return 0
    if state.stage == "final_test":
        return total_stages(num_iterations) - 1
    return 1 + state.iteration * len(STAGES) + STAGES.index(state.stage)


def write_readable_state(state: TextTrainState, checkpoint_dir: Path) -> None:
    """Write ``state`` as ``checkpoint_dir/state.json``, atomically."""
    write_text_atomic(json.dumps(state.to_dict(), indent=2) + "\n", checkpoint_dir / "state.json")
