"""Evaluation and test of the RL trainers: playing whole episodes, transcripts, the best checkpoint's bookkeeping.

Helpers of :class:`~nip_like.trainers.rl.TensorDictRlTrainer`'s periodic
evaluation and final test (and of other tensor trainers that play episodes).
"""

from __future__ import annotations

import json
from pathlib import Path

from tensordict import TensorDictBase

from nip_like.checkpoint import write_text_atomic
from nip_like.errors import ConfigError
from nip_like.logging import MetricLogger
from nip_like.scenarios.base import TensorGame
from nip_like.trainers.collection import finished_episodes
from nip_like.trainers.rl_state import TrainState


def run_episodes(env, policy, num_steps: int) -> TensorDictBase:
    """Play ``num_steps`` steps in every environment of ``env``; each environment's first finished episode."""
    rollout = env.rollout(num_steps, policy, break_when_any_done=False, auto_reset=True)
    return finished_episodes(rollout, first_only=True)


def write_transcripts(
    scenario: TensorGame,
    episodes: TensorDictBase,
    name: str,
    count: int,
    run_dir: Path,
    logger: MetricLogger,
    step: int,
    writer: bool = True,
) -> None:
    """Write the scenario's transcripts of up to ``count`` of ``episodes`` to ``transcripts/<name>.jsonl`` (if it has any).

    Also logs them, readable, as the text ``transcripts/<kind>`` (``eval``, ``test``) at ``step``.
    Only the ``writer`` rank writes.
    """
    records = scenario.transcripts(episodes, count)
    if not records or not writer:
        return
    text = "".join(json.dumps(record) + "\n" for record in records)
    write_text_atomic(text, Path(run_dir) / "transcripts" / f"{name}.jsonl")
    readable = "\n\n".join(scenario.transcript_text(record) for record in records)
    logger.log_text(f"transcripts/{name.split('_')[0]}", readable + "\n", step=step)


def require_eval_metric(metric: str, metrics: dict[str, float]) -> None:
    """Refuse a ``trainer.eval.metric`` that is not among an evaluation's ``metrics``."""
    if metric not in metrics:
        raise ConfigError(
            f"trainer.eval.metric {metric!r} is not among the evaluation metrics "
            f"{sorted(k for k in metrics if k.startswith('eval/'))}"
        )


def track_best(state: TrainState, value: float, mode: str, patience: int) -> bool:
    """Note an evaluation's ``value`` in ``state`` (best so far, or one more without improvement); whether it is the best.

    ``mode``: ``max`` or ``min``. After ``patience`` evaluations without
    improvement (0: never) ``state.stopped_early`` is set.
    """
    best = state.best_metric
    improved = best is None or (value > best if mode == "max" else value < best)
    if improved:
        state.best_metric = value
        state.best_iteration = state.iteration
        state.evals_without_improvement = 0
    else:
        state.evals_without_improvement += 1
        if patience and state.evals_without_improvement >= patience:
            state.stopped_early = True
    return improved


def with_optimality(metrics: dict[str, float], optimum: dict[str, float]) -> dict[str, float]:
    """``metrics`` (``test/...``) with each agent's reward as a share of the scenario's ``optimum`` where it is positive."""
    for name, best in optimum.items():
        if f"test/agents/{name}/reward" in metrics and best > 0:
            metrics[f"test/agents/{name}/optimality"] = metrics[f"test/agents/{name}/reward"] / best
    return metrics
