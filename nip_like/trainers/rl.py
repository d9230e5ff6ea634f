"""The standard RL loop on TorchRL parts.

Collector -> advantage module (if any) -> layout of the rollouts by the loss
module -> replay buffer (TensorDict storage) -> epochs x minibatches ->
optimiser -> logs -> periodic evaluation and checkpoint; a test loop at the
end. A subclass implements only :meth:`TensorDictRlTrainer._get_loss_module_and_gae`.

The trainer holds its config, scenario, logger and run folder, two frozen
records of what it works with (:class:`~nip_like.trainers.rl_build.RlAgents`,
then :class:`~nip_like.trainers.rl_build.RlParts`, both made by the builder
:mod:`~nip_like.trainers.rl_build` in the build order), its counters
(:class:`~nip_like.trainers.rl_state.TrainState`) and the replay buffer. The
loop (:meth:`TensorDictRlTrainer._run_train_loop`) and one iteration
(:meth:`TensorDictRlTrainer.train_iteration`: collect, lay out, update) read
top to bottom here; the work of each step is in a sibling module: collection
(:mod:`~nip_like.trainers.collection`), the update
(:mod:`~nip_like.trainers.update`), evaluation and test
(:mod:`~nip_like.trainers.evaluation`), the checkpoints and their state
(:mod:`~nip_like.trainers.rl_state`). The loop reaches its policy's
language-model hooks only through the declared
:class:`~nip_like.trainers.policy_hooks.PolicyHooks`, and the collector's
in-flight episodes only through :mod:`~nip_like.trainers.collector_state`.
"""

from __future__ import annotations

import logging
import time
import warnings
from abc import abstractmethod
from contextlib import ExitStack, contextmanager, nullcontext
from pathlib import Path
from typing import Any, ClassVar, Iterator

import torch
from omegaconf import DictConfig, OmegaConf
from tensordict import TensorDictBase
from torch import nn
from torchrl.data import TensorDictReplayBuffer
from torchrl.objectives import LossModule

from nip_like import distributed, keys
from nip_like.checkpoint import load_checked
from nip_like.errors import ModelServerError
from nip_like.folders import resume_command
from nip_like.interrupts import StopNow
from nip_like.logging import MetricLogger
from nip_like.precision import float32_region
from nip_like.scenarios.base import Demonstrating, Labelled, Scenario, TensorGame
from nip_like.trainers import collection, update
from nip_like.trainers.base import IterationContext, TensorDictTrainer, attach_progress_bar
from nip_like.trainers.collector_state import in_flight
from nip_like.trainers.evaluation import RlEvaluator, require_eval_metric, track_best
from nip_like.trainers.grad_flags import requires_grad_kept
from nip_like.trainers.opponent_pool import opponent_pool_problems
from nip_like.trainers.rl_build import RlAgents, RlParts, build_agents, build_parts
from nip_like.trainers.rl_state import TrainState, load_loss_state, load_rl_state, rl_state_dict, save_agent_folders

__all__ = ["TensorDictRlTrainer", "log"]

#: Notes on how the run goes, printed on rank 0 by Hydra's job logging (and kept in the run's job log).
log = logging.getLogger(__name__)


class _part:
    """A read-only name of the trainer for one field of its records (``agents`` or ``parts``)."""

    def __init__(self, record: str, field: str, doc: str) -> None:
        self.record, self.field, self.__doc__ = record, field, doc

    def __get__(self, trainer: Any, owner: type | None = None) -> Any:
        return self if trainer is None else getattr(getattr(trainer, self.record), self.field)

    def __set__(self, trainer: Any, value: Any) -> None:
        raise AttributeError(f"the trainer's parts are built once; {self.field} is {self.record}.{self.field}")


class TensorDictRlTrainer(TensorDictTrainer):
    """Standard on-policy RL trainer; subclasses supply the loss module.

    The trainer talks to the loss through the declared loss contract
    (:mod:`nip_like.objectives.contract`): the loss lays collected rollouts out
    in the replay buffer (transitions by default; preference pairs, episodes,
    groups for other losses), reports statistics of that layout, says whether
    it needs grouped rollouts, gets a hook before each iteration and names its
    metrics. A loss that does not subclass
    :class:`~nip_like.objectives.contract.RolloutLoss` gets the defaults. The
    trainer never tests which algorithm it runs.

    A subclass builds its loss from :attr:`objective_options`, the options
    under ``trainer.objective`` checked against the schema the trainer is
    registered with (``@register_trainer(name, objective=Schema)``).

    Attributes
    ----------
    config : DictConfig
        The whole experiment config (``self.config.trainer`` holds the RL options).
    agents : RlAgents
        The agents, warm-started (:func:`~nip_like.trainers.rl_build.build_agents`):
        ready when :meth:`_get_loss_module_and_gae` runs.
    parts : RlParts
        The loss, optimiser, schedule, collection and the rest, built from the
        agents and the loss (:func:`~nip_like.trainers.rl_build.build_parts`).
    state : TrainState
        The loop's counters, saved in checkpoints.
    buffer : TensorDictReplayBuffer or None
        The loss's layout of the last batch.
    evaluator : RlEvaluator
        What plays the evaluation and test episodes (:mod:`~nip_like.trainers.evaluation`).

    Notes
    -----
    The trainer's names for its parts (:attr:`policy`, :attr:`value`,
    :attr:`agent_names`, :attr:`reference_policy`, :attr:`loss_module`,
    :attr:`optimizer`, :attr:`collector`, ...) read the two records; the
    policy, value, agent names, scenario and device are ready when
    :meth:`_get_loss_module_and_gae` runs. Evaluation and test play through
    :attr:`evaluator` (:class:`~nip_like.trainers.evaluation.RlEvaluator`, a
    plain object over the scenario and the policy); what the checkpoints hold is
    written and read by functions of the records (:mod:`~nip_like.trainers.rl_state`).
    """

    samples_from_servers = True
    #: Whether ``run.fsdp`` may shard this trainer's LM agents (:mod:`nip_like.lm.sharding`): its update is the standard one.
    shards_lm_agents: ClassVar[bool] = True

    @classmethod
    def requirements(cls, config: DictConfig) -> dict[str, tuple[type | tuple[type, ...], ...]]:
        """:attr:`requires`, and with ``trainer.pretrain.agents`` demonstrations or labelled data to fit them to."""
        requirements = super().requirements(config)
        if config.trainer.pretrain.agents:
            requirements["trainer.pretrain.agents"] = ((Demonstrating, Labelled),)
        return requirements

    def __init__(self, config, scenario: TensorGame, run_dir: Path, logger: MetricLogger) -> None:
        super().__init__(config, scenario, run_dir, logger)
        self.test_episodes = int(config.trainer.num_test_episodes)
        # The build order (rl_build): agents -> warm start -> reference -> (shards) -> loss -> optimiser -> collection.
        self.agents: RlAgents = build_agents(config, scenario, self.run_dir, self.device, self.distributed)
        built = self._get_loss_module_and_gae()
        self.parts: RlParts = build_parts(
            config, scenario, self.agents, built, type(self).__name__, self.run_dir, self.device, self.distributed,
            self.num_iterations, self._accumulation_steps(),
        )
        self.state = TrainState()
        self.buffer: TensorDictReplayBuffer | None = None
        self.final_metrics: dict[str, float] = {}
        self.evaluator = RlEvaluator(scenario, self.agents.policy, config, self.device, self.distributed, self.run_dir, logger)

    # ------------------------------------------------------------- the parts
    @property
    def device(self) -> torch.device:
        """The run's device (``run.device``)."""
        return torch.device(self.config.run.device)

    @property
    def agent_names(self) -> tuple[str, ...]:
        """Agents, in the order of the agent dimension."""
        return self.scenario.agent_names

    agent_modules = _part("agents", "modules", "The agents' stacked policy and value networks (:class:`~nip_like.agent_modules.AgentModules`).")
    policy = _part("agents", "policy", "The agents' stacked policy (``(\"agents\", ...)`` keys, see :mod:`nip_like.agent_modules`).")
    value = _part("agents", "value", "The agents' stacked value network.")
    policy_hooks = _part("agents", "hooks", "What the loop tells the policy and reads from it (no-ops for tensor agents).")
    reference_policy = _part("agents", "reference", "The initial policy, frozen: the common reference of ``objective/kl``.")
    sharded = _part("agents", "sharded", "The FSDP2 units of the LM agents (``run.fsdp``), or None.")
    pretrain_metrics = _part("agents", "warm_start_metrics", "The warm start's metrics, logged with the first iteration.")
    loss_module = _part("parts", "loss_module", "The loss module of :meth:`_get_loss_module_and_gae`.")
    advantage_module = _part("parts", "advantage_module", "Its advantage module (GAE), or None.")
    loss_contract = _part("parts", "loss_contract", "How the loop talks to the loss (:mod:`nip_like.objectives.contract`).")
    optimizer = _part("parts", "optimizer", "The optimiser: one parameter group per agent that trains.")
    scheduler = _part("parts", "scheduler", "The learning-rate schedule, stepped once an iteration.")
    update_schedule = _part("parts", "update_schedule", "Which agents each iteration trains.")
    update_settings = _part("parts", "update_settings", "Epochs, accumulation, clipping and the divergence bound of the update.")
    train_env = _part("parts", "train_env", "This rank's train environments.")
    collector = _part("parts", "collector", "TorchRL's collector over the train environments.")
    _collector_iterator = _part("parts", "batches", "The collector's batches, one an iteration.")
    opponent_pool = _part("parts", "opponent_pool", "The opponent pool (``trainer.opponent_pool.agent``), or None.")
    memory_metrics = _part("parts", "memory_metrics", "The LM agents' automatic token budgets, logged with the first iteration.")

    def whole_weights(self) -> Any:
        """A context in which sharded agents keep their weights whole (sampling, evaluation, test); else nothing."""
        return self.agents.whole_weights()

    def _build_test_context(self, stack: ExitStack, deterministic: bool = True) -> None:
        super()._build_test_context(stack, deterministic)
        stack.enter_context(self.whole_weights())

    def close(self) -> None:
        """Stop the inference servers the run started and close their clients."""
        self.policy_hooks.close_servers()

    # ---------------------------------------------------------------- the hook
    @abstractmethod
    def _get_loss_module_and_gae(self) -> tuple[LossModule, nn.Module | None]:
        """Return the loss module and, optionally, an advantage module (e.g. GAE).

        The advantage module, if any, is called on each collected batch (under
        ``torch.no_grad``) before the loss module lays it out in the buffer.
        """

    @property
    def objective_options(self) -> dict[str, Any]:
        """The objective's options (``trainer.objective``) as keyword arguments of its loss.

        Checked against the trainer's objective schema when the experiment is
        built (:func:`nip_like.experiment.build_trainer`); empty for a trainer
        registered without one.
        """
        options = self.trainer_config.get("objective")
        return OmegaConf.to_container(options, resolve=True) if options is not None else {}

    # ----------------------------------------------------------- configuration
    @classmethod
    def validate(cls, config: DictConfig, scenario: Scenario | None) -> list[str]:
        """The relations between the RL loop's fields (each field's range is its schema's), and the opponent pool against the game."""
        tc = config.trainer
        world_size = distributed.launched_world_size()
        problems = []
        if tc.num_envs % tc.group_size:
            problems.append(f"trainer.num_envs ({tc.num_envs}) must be a multiple of trainer.group_size ({tc.group_size})")
        elif (tc.num_envs // world_size) % tc.group_size:
            problems.append(
                f"trainer.num_envs ({tc.num_envs}) over {world_size} ranks must leave each rank a "
                f"multiple of trainer.group_size ({tc.group_size})"
            )
        if tc.frames_per_batch % tc.num_envs:
            problems.append(
                f"trainer.frames_per_batch ({tc.frames_per_batch}) must be a multiple of trainer.num_envs ({tc.num_envs})"
            )
        if tc.minibatch_size > tc.frames_per_batch:
            problems.append(
                f"trainer.minibatch_size ({tc.minibatch_size}) is larger than the batch "
                f"(trainer.frames_per_batch = {tc.frames_per_batch})"
            )
        rollouts = int(tc.get("test_rollouts", 1))  # a run folder from before the option has none: 1
        for name in ("num_test_episodes", "test_batch_episodes"):
            if tc[name] % rollouts:
                problems.append(f"trainer.{name} ({tc[name]}) must be a multiple of trainer.test_rollouts ({rollouts})")
        if world_size > 1 and not tc.test_batch_episodes % rollouts and (tc.test_batch_episodes // world_size) % rollouts:
            problems.append(
                f"trainer.test_batch_episodes ({tc.test_batch_episodes}) over {world_size} ranks must leave each rank a "
                f"multiple of trainer.test_rollouts ({rollouts})"
            )
        if not tc.eval.metric.startswith("eval/"):
            problems.append(f"trainer.eval.metric must name an evaluation metric (eval/...), got {tc.eval.metric!r}")
        if tc.eval.test_checkpoint == "best" and tc.eval.every == 0:
            problems.append("trainer.eval.test_checkpoint=best needs evaluation: set trainer.eval.every > 0")
        if scenario is not None and tc.opponent_pool.get("agent"):
            problems += opponent_pool_problems(tc.opponent_pool, scenario, world_size)
        return problems

    def _accumulation_steps(self) -> int:
        """Minibatches per optimiser step; ``grad_accumulation_steps`` null: one per rank (the ranks share each step's minibatches, whole)."""
        steps = self.trainer_config.optimizer.grad_accumulation_steps
        accumulation = update.accumulation_steps(steps, self.distributed.world_size)
        if steps is None and self.distributed.enabled and self.distributed.is_writer:
            log.info(
                "trainer.optimizer.grad_accumulation_steps is null: each optimiser step takes %d minibatches, one per "
                "rank, as one process does with grad_accumulation_steps=%d",
                accumulation,
                accumulation,
            )
        return accumulation

    @property
    def num_iterations(self) -> int:
        """Train-loop iterations (1 in test-run mode)."""
        return 1 if self.test_run else int(self.trainer_config.num_iterations)

    def trainable_modules(self) -> list[nn.Module]:
        return [self.loss_module]

    # ---------------------------------------------------------------- training
    def train(self) -> dict[str, float]:
        """Run the train loop, then the test loop; return the test metrics."""
        if self.state.iteration < self.num_iterations and not self.state.stopped_early:
            if self.trainer_config.eval.every:
                self.check_eval_metric()
            with ExitStack() as stack:
                self._build_train_context(stack)
                self._run_train_loop()
        if self.trainer_config.eval.test_checkpoint == "best" and self.state.best_iteration is not None:
            best = load_checked(self.checkpoint_dir / "best.pt", self.run_id)
            load_loss_state(self.agents, self.parts, best["trainer"]["loss_module"])
        self.final_metrics = self.test()
        self.logger.log(self.final_metrics, step=self.state.iteration)
        return self.final_metrics

    @attach_progress_bar(lambda self: self.num_iterations)
    def _run_train_loop(self, iteration_context: IterationContext) -> None:
        iteration_context.set_description("Training")
        eval_every = self.trainer_config.eval.every
        checkpoint_every = self.config.run.checkpoint_every
        while self.state.iteration < self.num_iterations:
            started = time.perf_counter()
            with self._server_failures_name_the_checkpoint():
                metrics = self.train_iteration()
                self.state.iteration += 1
                iteration = self.state.iteration
                last = iteration == self.num_iterations
                if eval_every and (iteration % eval_every == 0 or last):
                    with ExitStack() as stack:
                        self._build_test_context(stack, self.trainer_config.eval.deterministic)
                        try:
                            metrics.update(self.evaluate())
                        except StopNow as stop:  # the iteration is counted already: say which one it follows
                            stop.during = f"in the evaluation after iteration {iteration}"
                            raise
                    self._track_best(metrics)
            self.state.train_seconds += time.perf_counter() - started
            metrics["timers/iteration"] = time.perf_counter() - started
            self.logger.log(metrics, step=iteration)
            iteration_context.set_postfix(**{k: f"{v:.3g}" for k, v in metrics.items() if k in self._postfix_keys})
            iteration_context.step()
            stop = self.state.stopped_early
            checkpoint = last or stop or bool(checkpoint_every and iteration % checkpoint_every == 0)
            if checkpoint:
                self.save_checkpoint("last")
            if stop:
                break
            self.stop_if_requested(iteration, checkpointed=checkpoint)

    _postfix_keys = ("train/reward", "eval/reward", "loss/policy")

    def train_iteration(self) -> dict[str, float]:
        """Collect one batch, lay it out, update on it; return the iteration's metrics.

        One iteration of the train loop in its three named steps
        (:meth:`collect_rollouts`, :meth:`lay_out_rollouts`, :meth:`update_agents`), without
        evaluation, checkpoint or the advance of ``state.iteration`` (the loop
        does those). Call it inside the train context
        (:meth:`_build_train_context`), as the loop does; tests call it to
        look at one iteration.
        """
        started, frames_before = time.perf_counter(), self.state.frames
        self.policy_hooks.pop_sampler_metrics()  # what evaluation sampled is not this iteration's
        # Sampling, advantages and the layout run with whole weights when the agents are sharded (run.fsdp):
        # the ranks' forward passes differ in number there.
        with self.whole_weights():
            batch, metrics = self.collect_rollouts()
            collected = time.perf_counter()
            data, layout_metrics = self.lay_out_rollouts(batch)
        metrics.update(layout_metrics)
        self.buffer = self.fill_buffer(data)
        metrics.update(self.update_agents())
        finished = time.perf_counter()
        metrics.update(
            {
                "train/frames": self.state.frames,
                "train/gradient_steps": self.state.gradient_steps,
                "train/iteration": self.state.iteration + 1,
                "SPS": (self.state.frames - frames_before) / (finished - started),  # every rank's frames
                "timers/collect": collected - started,
                "timers/update": finished - collected,
            }
        )
        return metrics

    def collect_rollouts(self) -> tuple[TensorDictBase, dict[str, float]]:
        """Step 1 of an iteration: this rank's batch from the collector, and the metrics of its finished episodes.

        With an opponent pool, the pooled seats play this iteration's draws and
        the pool records the episodes; every ``trainer.diagnostics_every``
        iterations, the policy's divergence from its reference is measured on
        the batch. Counts the batch's frames (all ranks') in ``state.frames``.
        """
        iteration, dist, parts = self.state.iteration, self.distributed, self.parts
        pool = parts.opponent_pool
        with pool.in_play() if pool is not None else nullcontext():
            batch = collection.collect(parts.batches, self.device, dist, int(self.config.seed))
        self.state.frames += batch.numel() * dist.world_size
        episodes = dist.gather_cat(collection.finished_episodes(batch))
        metrics = {f"train/{k}": v for k, v in collection.episode_metrics(self.scenario, episodes).items()}
        metrics.update(self.policy_hooks.pop_sampler_metrics())
        if iteration == 0:
            metrics.update(self.agents.warm_start_metrics)
            metrics.update(parts.memory_metrics)
        if pool is not None:  # the pooled agent trains (and is diagnosed) on the episodes it played itself
            metrics.update(pool.record(batch, iteration))
        every = parts.diagnostics_every
        if every and iteration % every == 0:
            diagnostics = collection.policy_diagnostics(batch, self.agents.reference, self.agent_names, self.scenario)
            metrics.update(dist.mean(diagnostics))
        return batch, metrics

    def lay_out_rollouts(self, batch: TensorDictBase) -> tuple[TensorDictBase, dict[str, float]]:
        """Step 2: the loss's layout of ``batch`` (advantages first, if any), all ranks' in rank order, and its metrics.

        Every rank optimises on the whole batch's layout, so each one gathers
        the others'. Runs without gradients.
        """
        parts, dist = self.parts, self.distributed
        with torch.no_grad():
            if parts.advantage_module is not None:
                # In float32 under run.autocast_dtype too: GAE's discounted sums are a conv1d, which autocast
                # would run in bfloat16 (advantages and value targets to ~3 significant digits).
                with float32_region(self.device), requires_grad_kept(parts.loss_module):  # frozen weights stay frozen
                    parts.advantage_module(batch)
            contract = parts.loss_contract
            contract.start_iteration(self.state.iteration)
            data = dist.gather_cat(contract.layout_rollouts(batch), contract.join_layouts)
        metrics = {"train/layout_items": data.batch_size[0]}
        metrics.update({f"train/{k}": v for k, v in dist.mean(contract.layout_metrics()).items()})
        return data, metrics

    def update_agents(self) -> dict[str, float]:
        """Step 3: epochs x minibatches on :attr:`buffer` for the agents this iteration trains, then the schedule's step.

        Agents without an optimiser group (frozen co-players, a shared
        policy's sharer without a value head) train nothing. Returns the
        update's statistics and the learning rates it used (``lr/<agent>``).
        """
        iteration, parts = self.state.iteration, self.parts
        grouped = {group["agent"] for group in parts.optimizer.param_groups}
        trained = tuple(name for name in parts.update_schedule.trained_agents(iteration) if name in grouped)
        learning_rates = {f"lr/{group['agent']}": group["lr"] for group in parts.optimizer.param_groups}
        stats = self._optimize(trained) if trained and len(self.buffer) else {}
        if stats:
            self.agents.hooks.weights_changed()  # inference servers get the new weights
        if stats or parts.scheduler.last_epoch > 0:
            parts.scheduler.step()
        else:
            # The schedule follows iterations, also those that made no update; torch warns when the schedule's first
            # step (last_epoch 0) comes before the optimiser's. Only then this block: every catch_warnings block makes
            # Python show again the warnings it has shown, so a block at every iteration would repeat any warning
            # raised at every one.
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
                parts.scheduler.step()
        if parts.opponent_pool is not None:
            parts.opponent_pool.after_update(iteration + 1, in_flight(parts.collector).get(keys.GROUP_ID_KEY))
        return {**stats, **learning_rates}

    def fill_buffer(self, data: TensorDictBase) -> TensorDictReplayBuffer:
        """The replay buffer holding the loss's layout of this iteration's batch (:func:`~nip_like.trainers.update.fill_buffer`).

        The last buffer, refilled where it fits. A named step of
        :meth:`train_iteration`, which keeps what it returns as :attr:`buffer`:
        the distributed tests record what fills it under torchrun and replay
        it in one process.
        """
        return update.fill_buffer(self.buffer, data, self.trainer_config.minibatch_size, self.device)

    def _optimize(self, trained: tuple[str, ...]) -> dict[str, float]:
        """Optimise the ``trained`` agents on the buffer (:func:`~nip_like.trainers.update.optimize`); the update's statistics."""
        parts, hooks = self.parts, self.agents.hooks
        # LM agents count the padding of their scoring passes: only the update's are reported.
        hooks.pop_padding_fraction()
        records, norms = update.optimize(
            parts.loss_passes,
            self.buffer,
            parts.optimizer,
            trained,
            parts.update_settings,
            self.distributed,
            self.state.iteration + 1,
            self._last_checkpoint_note,
        )
        self.state.gradient_steps += len(norms)
        stats = update.update_statistics(records, parts.loss_contract)
        frozen = tuple(f"agents/{name}/" for name in hooks.frozen_sources())
        stats = {name: value for name, value in stats.items() if not name.startswith(frozen)} if frozen else stats  # a frozen co-player trains nothing
        padding = hooks.pop_padding_fraction()
        if padding is not None:
            stats["train/padding_fraction"] = padding
        stats = self.distributed.mean(stats, weight=len(records))
        stepped = [group["agent"] for group in parts.optimizer.param_groups if group["agent"] in trained]  # the norms' order
        for name, values in zip(stepped, torch.stack(norms).mean(0).tolist()):
            stats[f"train/grad_norm/{name}"] = values
        update.check_parameters(
            parts.optimizer,
            trained,
            parts.update_settings.divergence_bound,
            self.state.iteration + 1,
            self._last_checkpoint_note,
            self.distributed,
        )
        return stats

    # ------------------------------------------------------------ checkpoints
    def save_checkpoint(self, name: str = "last") -> Path:
        """Write the trainer state to ``checkpoints/<name>.pt``, and the agents in their own format.

        Agents that write themselves in their own format (the policy hook
        :meth:`~nip_like.trainers.policy_hooks.PolicyHooks.save_pretrained`:
        language-model agents, as Hugging Face folders) are also saved under
        ``checkpoints/<name>/<agent>/`` (model, tokenizer, value head), beside
        the full trainer state that exact resumption reads.
        """
        path = super().save_checkpoint(name)
        save_agent_folders(self.agents, self.checkpoint_dir / name, self.distributed)
        return path

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint holds (:func:`~nip_like.trainers.rl_state.rl_state_dict`)."""
        return rl_state_dict(self.agents, self.parts, self.state, self.distributed)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a checkpoint's state (:func:`~nip_like.trainers.rl_state.load_rl_state`); the progress bar resumes there."""
        load_rl_state(self.agents, self.parts, self.state, state, self.distributed, self.device)
        self.progress_initial["_run_train_loop"] = self.state.iteration

    # ------------------------------------------------------ evaluation and test
    def evaluate(self) -> dict[str, float]:
        """Play ``trainer.eval.num_episodes`` episodes on fixed eval data (:meth:`RlEvaluator.evaluate <nip_like.trainers.evaluation.RlEvaluator.evaluate>`); the ``eval/`` metrics.

        Call it inside the test context (:meth:`_build_test_context`), as the train loop does.
        """
        return self.evaluator.evaluate(self.state.iteration)

    def check_eval_metric(self) -> None:
        """Refuse a ``trainer.eval.metric`` that evaluation does not report, before the first step.

        :meth:`train` calls it when evaluation is on; a caller that builds a
        trainer may call it to learn of a wrong metric before any training.
        Plays one evaluation (on the generator state it would use anyway, and
        with the global generators forked and restored, so training is the
        same with or without this check) and looks the metric up among its results.
        """
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), ExitStack() as stack:
            self._build_test_context(stack, self.trainer_config.eval.deterministic)
            require_eval_metric(self.trainer_config.eval.metric, self.evaluate())

    def _track_best(self, metrics: dict[str, float]) -> None:
        """Note the evaluation in the state (best so far, early stopping); a new best writes ``best.pt``."""
        eval_config = self.trainer_config.eval
        require_eval_metric(eval_config.metric, metrics)
        if track_best(self.state, metrics[eval_config.metric], eval_config.mode, eval_config.early_stopping_patience):
            self.save_checkpoint("best")
        metrics["eval/best"] = self.state.best_metric

    @property
    def num_test_iterations(self) -> int:
        """Test-loop iterations: batches of ``trainer.test_batch_episodes`` (1 in test-run mode)."""
        return self.evaluator.num_test_batches(self.test_episodes)

    def _run_test_loop(self) -> dict[str, float]:
        """The test loop (the hook of :meth:`~nip_like.trainers.base.TensorDictTrainer.test`): the ``test/...`` metrics.

        Plays :attr:`test_episodes` episodes on :attr:`test_split` (one batch
        in test-run mode), each datapoint ``trainer.test_rollouts`` times side
        by side, and writes their transcripts to ``transcripts/test.jsonl``.
        :meth:`train` ends with the test and ``python -m nip_like.evaluate``
        calls it on a saved state.
        """
        return self.evaluator.test_metrics(self._play_test_loop(), self.state.iteration)

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
        env = self.evaluator.test_env(self.test_split)
        episodes = []
        for _ in range(self.num_test_iterations):
            episodes.append(self.evaluator.play_test_batch(env, self.state.iteration))
            iteration_context.step()
        all_episodes = torch.cat(episodes)
        return all_episodes if self.test_run else all_episodes[: self.test_episodes]

    @contextmanager
    def _server_failures_name_the_checkpoint(self) -> Iterator[None]:
        """An inference server lost mid-iteration stops the run in one line that names the checkpoint to resume from."""
        try:
            yield
        except ModelServerError as error:
            raise ModelServerError(
                f"{error}; {self._last_checkpoint_note()}; once the server answers, resume with: {resume_command(self.run_dir)}"
            ) from None

    def _last_checkpoint_note(self) -> str:
        last = self.checkpoint_dir / "last.pt"
        return f"the last checkpoint is {last}" if last.is_file() else "no checkpoint was written yet"
