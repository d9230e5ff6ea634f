"""Evaluation and test of the RL trainers: playing whole episodes, transcripts, the best checkpoint's bookkeeping.

:class:`RlEvaluator` is the plain object with which
:class:`~nip_like.trainers.rl.TensorDictRlTrainer` evaluates (periodic
evaluation) and tests (the batches of the final test loop); the functions are
its helpers (and those of other tensor trainers that play episodes):
:func:`track_best` keeps the best checkpoint's bookkeeping.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDictBase

from nip_like.checkpoint import write_text_atomic
from nip_like.errors import ConfigError
from nip_like.interrupts import StopNow, StopRequested, stop_point, stop_requested
from nip_like.logging import MetricLogger
from nip_like.scenarios.base import TensorGame
from nip_like.trainers import collection
from nip_like.trainers.collection import finished_episodes
from nip_like.trainers.rl_state import TrainState


#: Playing evaluation or test episodes, as a stop request in the middle of it is reported.
EPISODES_PHASE = "the episodes of an evaluation or test"


def _episode_stop_point(env, tensordict: TensorDictBase) -> None:
    """The rollout's callback after each step: :func:`~nip_like.interrupts.stop_point`."""
    stop_point(EPISODES_PHASE)


def run_episodes(env, policy, num_steps: int) -> TensorDictBase:
    """Play ``num_steps`` steps in every environment of ``env``; each environment's first finished episode.

    A stop request that has waited its grace (:func:`~nip_like.interrupts.stop_point`)
    ends the rollout after a step, the episodes dropped.
    """
    rollout = env.rollout(num_steps, policy, break_when_any_done=False, auto_reset=True, callback=_episode_stop_point)
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


class RlEvaluator:
    """What an RL trainer plays to evaluate and test its agents: fixed episodes of its scenario, by its policy.

    A plain object over the trainer's parts: the scenario, the policy (the
    stacked agents of :class:`~nip_like.trainers.rl_build.RlAgents`), the
    run's options and rank context, and where transcripts go. The trainer
    (:class:`~nip_like.trainers.rl.TensorDictRlTrainer`) enters the test
    context around each call and draws the test loop's progress bar.

    Parameters
    ----------
    scenario : TensorGame
        The game: its eval and test splits, episode metrics and transcripts.
    policy : Module
        The agents' stacked policy.
    config : DictConfig
        The whole experiment config (``trainer``, ``seed``, ``run.test_run``).
    device : torch.device
        Where the environments run.
    dist : Distributed
        The rank context: each rank plays its share of the episodes.
    run_dir : Path
        The run folder (``transcripts/``).
    logger : MetricLogger
        Where the transcripts are logged as text.
    """

    def __init__(self, scenario: TensorGame, policy, config, device: torch.device, dist, run_dir: Path, logger: MetricLogger) -> None:
        self.scenario, self.policy, self.config, self.device = scenario, policy, config, device
        self.dist, self.run_dir, self.logger = dist, Path(run_dir), logger
        #: The evaluation's environments, by their number of episodes (built on first use).
        self.eval_envs: dict[int, Any] = {}

    @property
    def test_run(self) -> bool:
        """Whether every loop runs once (``run.test_run``): a few episodes instead of the configured numbers."""
        return bool(self.config.run.test_run)

    def evaluate(self, iteration: int) -> dict[str, float]:
        """Play ``trainer.eval.num_episodes`` episodes on fixed eval data; return ``eval/`` metrics.

        The same episodes at every evaluation, and no draw from the training
        generators. Call it inside the test context, as the train loop does;
        the transcripts are ``transcripts/eval_<iteration>.jsonl``.
        """
        dist, seed = self.dist, int(self.config.seed)
        num_episodes = dist.share(8 if self.test_run else self.config.trainer.eval.num_episodes, "trainer.eval.num_episodes")
        env = self.eval_envs.get(num_episodes)
        if env is None:  # built once for its number of episodes (a test run evaluates fewer)
            self.eval_envs.clear()
            env = self.eval_envs[num_episodes] = self.scenario.make_env(num_episodes, self.scenario.eval_split, 0, self.device)
        env.rng.manual_seed(dist.seed(seed, "eval_env"))
        with dist.rank_rng(seed):
            episodes = run_episodes(env, self.policy, self.scenario.protocol.num_rounds)
        episodes = dist.gather_cat(episodes)  # each rank played its share
        self.write_transcripts(episodes, f"eval_{iteration:06d}", iteration)
        return {f"eval/{k}": v for k, v in collection.episode_metrics(self.scenario, episodes).items()}

    def num_test_batches(self, test_episodes: int) -> int:
        """Batches of ``trainer.test_batch_episodes`` the test plays for ``test_episodes`` episodes (1 in test-run mode)."""
        return 1 if self.test_run else math.ceil(test_episodes / self.config.trainer.test_batch_episodes)

    def test_env(self, split: str):
        """This rank's environments of one test batch on ``split``, each datapoint ``trainer.test_rollouts`` times side by side."""
        rollouts = int(self.config.trainer.get("test_rollouts", 1))
        batch = rollouts * max(1, 8 // rollouts) if self.test_run else self.config.trainer.test_batch_episodes
        batch_episodes = self.dist.share(batch, "trainer.test_batch_episodes")
        seed = self.dist.seed(int(self.config.seed), "test_env")
        return self.scenario.make_env(batch_episodes, split, seed, self.device, group_size=rollouts)

    def play_test_batch(self, env, iteration: int) -> TensorDictBase:
        """One batch of test episodes on ``env``, all ranks' (a stop request ends it: ``StopRequested`` at ``iteration``)."""
        dist = self.dist
        if dist.any(stop_requested()):  # training is done and saved: a resumed run tests again
            raise StopRequested(iteration, phase="test")
        with dist.rank_rng(int(self.config.seed)):
            try:
                played = run_episodes(env, self.policy, self.scenario.protocol.num_rounds)
            except StopNow:  # in a long batch of episodes: the same stop, the batch dropped
                raise StopRequested(iteration, phase="test") from None
        return dist.gather_cat(played)  # each rank played its share of the batch

    def test_metrics(self, episodes: TensorDictBase, iteration: int) -> dict[str, float]:
        """The ``test/...`` metrics of the test's ``episodes`` (with each agent's optimality); their transcripts to ``transcripts/test.jsonl``."""
        self.write_transcripts(episodes, "test", iteration)
        metrics = {f"test/{k}": v for k, v in collection.episode_metrics(self.scenario, episodes).items()}
        return with_optimality(metrics, self.scenario.optimal_rewards() or {})

    def write_transcripts(self, episodes: TensorDictBase, name: str, iteration: int) -> None:
        """:func:`write_transcripts` of up to ``trainer.eval.transcripts`` of ``episodes``, by the writer rank."""
        count = int(self.config.trainer.eval.transcripts)
        write_transcripts(self.scenario, episodes, name, count, self.run_dir, self.logger, iteration, self.dist.is_writer)
