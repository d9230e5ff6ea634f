"""Evaluation and test of the RL trainers: playing whole episodes, transcripts, the best checkpoint's bookkeeping.

:class:`RlEvaluation` is the part of
:class:`~nip_like.trainers.rl.TensorDictRlTrainer` that evaluates (periodic
evaluation, the best checkpoint) and tests (the final test loop); the
functions are its helpers (and those of other tensor trainers that play
episodes).
"""

from __future__ import annotations

import json
import math
from contextlib import ExitStack
from pathlib import Path

import torch
from tensordict import TensorDictBase

from nip_like.checkpoint import write_text_atomic
from nip_like.errors import ConfigError
from nip_like.interrupts import StopNow, StopRequested, stop_point, stop_requested
from nip_like.logging import MetricLogger
from nip_like.scenarios.base import TensorGame
from nip_like.trainers import collection
from nip_like.trainers.base import IterationContext, TensorDictTrainer, attach_progress_bar
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


class RlEvaluation(TensorDictTrainer):
    """Evaluation and test of :class:`~nip_like.trainers.rl.TensorDictRlTrainer`: the part of it that plays fixed episodes.

    Periodic evaluation on the scenario's eval split (with the best
    checkpoint's bookkeeping) and the test loop on :attr:`test_split` (the
    hook ``_run_test_loop`` that every tensor trainer writes, which
    :meth:`~nip_like.trainers.base.TensorDictTrainer.test` runs), both in the
    test context, with the agents and settings the RL trainer builds.
    """

    @property
    def num_test_iterations(self) -> int:
        """Test-loop iterations (1 in test-run mode)."""
        if self.test_run:
            return 1
        return math.ceil(self.test_episodes / self.trainer_config.test_batch_episodes)

    def evaluate(self) -> dict[str, float]:
        """Play ``trainer.eval.num_episodes`` episodes on fixed eval data; return ``eval/`` metrics.

        The same episodes at every evaluation. Call it inside the test context
        (:meth:`~nip_like.trainers.base.TensorDictTrainer._build_test_context`), as the train loop does.
        """
        dist = self.distributed
        num_episodes = dist.share(8 if self.test_run else self.trainer_config.eval.num_episodes, "trainer.eval.num_episodes")
        env = self.eval_envs.get(num_episodes)
        if env is None:  # built once for its number of episodes (a test run evaluates fewer)
            self.eval_envs.clear()
            env = self.eval_envs[num_episodes] = self.scenario.make_env(num_episodes, self.scenario.eval_split, 0, self.device)
        # The same episodes at every evaluation, and no draw from the training generators.
        env.rng.manual_seed(dist.seed(int(self.config.seed), "eval_env"))
        with dist.rank_rng(int(self.config.seed)):
            episodes = run_episodes(env, self.policy, self.scenario.protocol.num_rounds)
        episodes = dist.gather_cat(episodes)  # each rank played its share
        self._write_transcripts(episodes, f"eval_{self.state.iteration:06d}")
        return {f"eval/{k}": v for k, v in collection.episode_metrics(self.scenario, episodes).items()}

    def _write_transcripts(self, episodes: TensorDictBase, name: str) -> None:
        write_transcripts(
            self.scenario,
            episodes,
            name,
            int(self.trainer_config.eval.transcripts),
            self.run_dir,
            self.logger,
            self.state.iteration,
            writer=self.distributed.is_writer,
        )

    def check_eval_metric(self) -> None:
        """Refuse a ``trainer.eval.metric`` that evaluation does not report, before the first step.

        :meth:`~nip_like.trainers.rl.TensorDictRlTrainer.train` calls it when
        evaluation is on; a caller that builds a trainer may call it to learn
        of a wrong metric before any training.
        Plays one evaluation (on the generator state it would use anyway, and
        with the global generators forked and restored, so training is the same
        with or without this check) and looks the metric up among its results.
        """
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), ExitStack() as stack:
            self._build_test_context(stack, self.trainer_config.eval.deterministic)
            require_eval_metric(self.trainer_config.eval.metric, self.evaluate())

    def _track_best(self, metrics: dict[str, float]) -> None:
        """Note the evaluation in the state (best so far, early stopping); a new best writes ``best.pt``."""
        eval_config = self.trainer_config.eval
        require_eval_metric(eval_config.metric, metrics)
        value = metrics[eval_config.metric]
        if track_best(self.state, value, eval_config.mode, eval_config.early_stopping_patience):
            self.save_checkpoint("best")
        metrics["eval/best"] = self.state.best_metric

    def _run_test_loop(self) -> dict[str, float]:
        """The test loop (the hook of :meth:`~nip_like.trainers.base.TensorDictTrainer.test`): the ``test/...`` metrics.

        Plays :attr:`test_episodes` episodes on :attr:`test_split` (one batch
        in test-run mode), each datapoint ``trainer.test_rollouts`` times side
        by side, and writes their transcripts to ``transcripts/test.jsonl``.
        Runs in the test context, as every trainer's test loop;
        :meth:`~nip_like.trainers.rl.TensorDictRlTrainer.train` ends with the
        test and ``python -m nip_like.evaluate`` calls it on a saved state.
        """
        all_episodes = self._play_test_loop()
        self._write_transcripts(all_episodes, "test")
        metrics = {f"test/{k}": v for k, v in collection.episode_metrics(self.scenario, all_episodes).items()}
        return with_optimality(metrics, self.scenario.optimal_rewards() or {})

    def play_test_episodes(self) -> TensorDictBase:
        """The test's episodes, played in the test context: the ``"next"`` entries of each one's final step.

        The same episodes as :meth:`~nip_like.trainers.base.TensorDictTrainer.test`
        plays (same split, seed and number), for an analysis that needs more
        than their metrics (``python -m nip_like.analyse message-regression``).
        """
        with ExitStack() as stack:
            self._build_test_context(stack)
            return self._play_test_loop()

    @attach_progress_bar(lambda self: self.num_test_iterations)
    def _play_test_loop(self, iteration_context: IterationContext) -> TensorDictBase:
        iteration_context.set_description("Testing")
        dist = self.distributed
        rollouts = int(self.trainer_config.get("test_rollouts", 1))  # each datapoint played this many times, side by side
        batch = rollouts * max(1, 8 // rollouts) if self.test_run else self.trainer_config.test_batch_episodes
        batch_episodes = dist.share(batch, "trainer.test_batch_episodes")
        env = self.scenario.make_env(
            batch_episodes, self.test_split, dist.seed(int(self.config.seed), "test_env"), self.device, group_size=rollouts
        )
        episodes = []
        for _ in range(self.num_test_iterations):
            if dist.any(stop_requested()):  # training is done and saved: a resumed run tests again
                raise StopRequested(self.state.iteration, phase="test")
            with dist.rank_rng(int(self.config.seed)):
                try:
                    played = run_episodes(env, self.policy, self.scenario.protocol.num_rounds)
                except StopNow:  # in a long batch of episodes: the same stop, the batch dropped
                    raise StopRequested(self.state.iteration, phase="test") from None
            episodes.append(dist.gather_cat(played))  # each rank played its share of the batch
            iteration_context.step()
        all_episodes = torch.cat(episodes)
        return all_episodes if self.test_run else all_episodes[: self.test_episodes]
