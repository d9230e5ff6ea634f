"""The test stage: which iterations test, playing the test split, and the saved metrics of each test.

Every test plays the same lists with the same seed (and, with local models,
decodes the same replies greedily); a test's metrics go to
``tests/iteration_<i>.json`` and its transcripts beside them, so a resumed run
or the final test reuses a test already run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from tensordict import TensorDict

from nip_like.checkpoint import write_text_atomic
from nip_like.text.rollouts import save_rollouts
from nip_like.trainers.text.sampling import rollout_metrics


def tests_now(scheme: str, iteration: int, num_iterations: int) -> bool:
    """Whether the test stage of ``iteration`` runs under ``scheme`` (none, all, last, first_and_last)."""
    last = num_iterations - 1
    return (
        scheme == "all"
        or (scheme == "last" and iteration == last)
        or (scheme == "first_and_last" and iteration in (0, last))
    )


def test_path(run_dir: Path, iteration: int) -> Path:
    """Where the metrics of iteration ``iteration``'s test are saved: ``tests/iteration_<i>.json``."""
    return Path(run_dir) / "tests" / f"iteration_{iteration:04d}.json"


def run_test(
    path: Path,
    play: Callable[[], TensorDict],
    log: Callable[[dict[str, float]], None],
    agent_names: list[str],
    num_rounds: int,
) -> dict[str, float]:
    """The metrics of the test saved at ``path``, or of a new one: played by ``play()``, logged by ``log``, saved there."""
    if path.is_file():
        return json.loads(path.read_text())
    rollouts = play()
    metrics = rollout_metrics(rollouts, agent_names)
    save_rollouts(rollouts, agent_names, num_rounds, path.with_suffix(".jsonl"))
    log(metrics)
    write_text_atomic(json.dumps(metrics, indent=2) + "\n", path)
    return metrics
