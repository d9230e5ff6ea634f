"""The standard RL loop on TorchRL parts.

Collector -> advantage module (if any) -> layout of the rollouts by the loss
module -> replay buffer (TensorDict storage) -> epochs x minibatches ->
optimiser -> logs -> periodic evaluation and checkpoint; a test loop at the
end. A subclass implements only :meth:`TensorDictRlTrainer._get_loss_module_and_gae`.

The build order (``__init__``), the loop
(:meth:`TensorDictRlTrainer._run_train_loop`) and one iteration
(:meth:`TensorDictRlTrainer.train_iteration`) read top to bottom here; the
work of each part is in a sibling module: the build steps
(:mod:`~nip_like.trainers.rl_build`), collection
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
from nip_like.logging import MetricLogger
from nip_like.objectives.reference import ReferencePolicy
from nip_like.precision import float32_region
from nip_like.scenarios.base import Demonstrating, Labelled, Scenario, TensorGame
from nip_like.trainers import collection, update
from nip_like.trainers.base import IterationContext, TensorDictTrainer, attach_progress_bar
from nip_like.trainers.collector_state import in_flight
from nip_like.trainers.data_parallel import LossPasses
from nip_like.trainers.evaluation import RlEvaluation
from nip_like.trainers.grad_flags import requires_grad_kept
from nip_like.trainers.opponent_pool import build_opponent_pool, opponent_pool_problems
from nip_like.trainers.policy_hooks import PolicyHooks, policy_hooks
from nip_like.trainers.rl_build import RlBuildSteps
from nip_like.trainers.rl_state import RlCheckpoints, TrainState

__all__ = ["TensorDictRlTrainer", "log"]

#: Notes on how the run goes, printed on rank 0 by Hydra's job logging (and kept in the run's job log).
log = logging.getLogger(__name__)


class TensorDictRlTrainer(RlBuildSteps, RlEvaluation, RlCheckpoints, TensorDictTrainer):
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
    policy : ProbabilisticActor
        The agents' stacked policy (``("agents", ...)`` keys, see :mod:`nip_like.agent_modules`).
    value : TensorDictModule
        The agents' stacked value network.
    policy_hooks : PolicyHooks
        What the loop tells the policy and reads from it
        (:func:`~nip_like.trainers.policy_hooks.policy_hooks`: the policy
        itself for language-model agents, no-ops for tensor agents).
    agent_names : tuple of str
        Agents, in the order of the agent dimension.
    config : DictConfig
        The whole experiment config (``self.config.trainer`` holds the RL options).

    Notes
    -----
    The attributes above are ready when :meth:`_get_loss_module_and_gae` runs.
    The build steps (:class:`~nip_like.trainers.rl_build.RlBuildSteps`),
    evaluation and test (:class:`~nip_like.trainers.evaluation.RlEvaluation`)
    and the checkpoints (:class:`~nip_like.trainers.rl_state.RlCheckpoints`)
    are parts of this class, each in its own module.
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
        self.trainer_config = config.trainer
        self.device = torch.device(config.run.device)
        self.test_run = bool(config.run.test_run)
        self.test_episodes = int(config.trainer.num_test_episodes)
        self.accumulation = self._accumulation_steps()
        # The build order (its steps: rl_build): agents -> warm start -> reference -> loss -> optimiser -> collection.
        self.agent_names = scenario.agent_names
        self.agent_modules = scenario.make_agents()
        self.agent_modules.modules().to(self.device)
        self.policy = self.agent_modules.policy
        self.value = self.agent_modules.value
        #: What the loop tells the policy and reads from it (no-ops for tensor agents): see :mod:`~nip_like.trainers.policy_hooks`.
        self.policy_hooks: PolicyHooks = policy_hooks(self.policy)
        self._attach_inference_servers()
        self.pretrain_metrics = self.warm_start()
        # The initial policy, frozen: the common reference of objective/kl.
        self.reference_policy = ReferencePolicy(self.policy)
        # A sharded agent's automatic token budget is probed before sharding (its passes are then collectives).
        token_bytes = self.probe_token_bytes(sharded=True) if self.runs_sharded else None
        self.sharded = self.shard_agents()
        self._build_loss()
        self._build_optimizer()
        self.opponent_pool = build_opponent_pool(self.trainer_config.opponent_pool, self)
        with self.whole_weights():  # the collector runs the policy once to read its outputs
            self._build_collection()
        self.memory_metrics = self.set_token_budgets(token_bytes)
        self.buffer: TensorDictReplayBuffer | None = None
        self.state = TrainState()
        self.final_metrics: dict[str, float] = {}

    def whole_weights(self) -> Any:
        """A context in which sharded agents keep their weights whole (sampling, evaluation, test); else nothing."""
        return self.sharded.gathered() if self.sharded is not None else nullcontext()

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
            self._load_loss_module_state(best["trainer"]["loss_module"])
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
                        metrics.update(self.evaluate())
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
        """Collect one batch and optimise on it; return the iteration's metrics.

        One iteration of the train loop, without evaluation, checkpoint or
        the advance of ``state.iteration`` (the loop does those). Call it
        inside the train context (:meth:`_build_train_context`), as the loop
        does; tests call it to look at one iteration.
        """
        iteration = self.state.iteration
        started = time.perf_counter()
        dist = self.distributed
        # Collection: a batch, its finished episodes and their metrics.
        self.policy_hooks.pop_sampler_metrics()  # what evaluation sampled is not this iteration's
        # Sampling, advantages and the layout run with whole weights when the agents are sharded (run.fsdp):
        # the ranks' forward passes differ in number there.
        pool = self.opponent_pool
        with self.whole_weights():
            with pool.in_play() if pool is not None else nullcontext():
                batch = collection.collect(self._collector_iterator, self.device, dist, int(self.config.seed))
            collected = time.perf_counter()
            frames = batch.numel() * dist.world_size
            self.state.frames += frames
            episodes = dist.gather_cat(collection.finished_episodes(batch))
            metrics = {f"train/{k}": v for k, v in collection.episode_metrics(self.scenario, episodes).items()}
            metrics.update(self.policy_hooks.pop_sampler_metrics())
            if iteration == 0:
                metrics.update(self.pretrain_metrics)
                metrics.update(self.memory_metrics)
            if pool is not None:  # the pooled agent trains (and is diagnosed) on the episodes it played itself
                metrics.update(pool.record(batch, iteration))
            every = self._diagnostics_every
            if every and iteration % every == 0:
                diagnostics = collection.policy_diagnostics(batch, self.reference_policy, self.agent_names, self.scenario)
                metrics.update(dist.mean(diagnostics))

            # The loss's layout of the batch: advantages, then its items in the replay buffer.
            with torch.no_grad():
                if self.advantage_module is not None:
                    # In float32 under run.autocast_dtype too: GAE's discounted sums are a conv1d, which autocast
                    # would run in bfloat16 (advantages and value targets to ~3 significant digits).
                    with float32_region(self.device), requires_grad_kept(self.loss_module):  # frozen weights stay frozen
                        self.advantage_module(batch)
                self.loss_contract.start_iteration(iteration)
                # Every rank optimises on the whole batch's layout: the ranks' layouts, in rank order.
                data = dist.gather_cat(self.loss_contract.layout_rollouts(batch), self.loss_contract.join_layouts)
            metrics["train/layout_items"] = data.batch_size[0]
            metrics.update({f"train/{k}": v for k, v in dist.mean(self.loss_contract.layout_metrics()).items()})
        self.fill_buffer(data)

        # The update: epochs x minibatches for the agents this iteration trains, then the schedule's step.
        # Agents without an optimiser group (frozen co-players, a shared policy's sharer without a value head) train nothing.
        grouped = {group["agent"] for group in self.optimizer.param_groups}
        trained = tuple(name for name in self.update_schedule.trained_agents(iteration) if name in grouped)
        learning_rates = {f"lr/{group['agent']}": group["lr"] for group in self.optimizer.param_groups}
        loss_stats = self._optimize(trained) if trained and len(self.buffer) else {}
        if loss_stats:
            self.policy_hooks.weights_changed()  # inference servers get the new weights
        if loss_stats or self._schedule_stepped:
            self.scheduler.step()
        else:
            # The schedule follows iterations, also those that made no update; torch warns when its first step comes
            # before the optimiser's. Only then this block: every catch_warnings block makes Python show again the
            # warnings it has shown, so a block at every iteration would repeat any warning raised at every one.
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
                self.scheduler.step()
        self._schedule_stepped = True
        if pool is not None:
            pool.after_update(iteration + 1, in_flight(self.collector).get(keys.GROUP_ID_KEY))
        finished = time.perf_counter()

        metrics.update(loss_stats)
        metrics.update(
            {
                "train/frames": self.state.frames,
                "train/gradient_steps": self.state.gradient_steps,
                "train/iteration": iteration + 1,
                "SPS": frames / (finished - started),
                "timers/collect": collected - started,
                "timers/update": finished - collected,
            }
        )
        metrics.update(learning_rates)
        return metrics

    def fill_buffer(self, data: TensorDictBase) -> None:
        """Put the loss's layout of this iteration's batch in the replay buffer (:func:`~nip_like.trainers.update.fill_buffer`).

        A named step of :meth:`train_iteration`: the distributed tests record
        what fills it under torchrun and replay it in one process.
        """
        self.buffer = update.fill_buffer(self.buffer, data, self.trainer_config.minibatch_size, self.device)

    def _optimize(self, trained: tuple[str, ...]) -> dict[str, float]:
        """Optimise the ``trained`` agents on the buffer (:func:`~nip_like.trainers.update.optimize`); the update's statistics."""
        # LM agents count the padding of their scoring passes: only the update's are reported.
        self.policy_hooks.pop_padding_fraction()
        if self._loss_passes is None:
            # Under torchrun, DDP (replicated agents) or FSDP2 (run.fsdp) sums the ranks' gradients. Built here, where
            # every rank arrives together (rank 0 builds the trainer before the others), after the warm start.
            self._loss_passes = LossPasses(self.loss_module, self.distributed, lockstep=self.sharded is not None)
        records, norms = update.optimize(
            self._loss_passes,
            self.buffer,
            self.optimizer,
            trained,
            self.update_settings,
            self.distributed,
            self.state.iteration + 1,
            self._last_checkpoint_note,
        )
        self.state.gradient_steps += len(norms)
        stats = update.update_statistics(records, self.loss_contract)
        frozen = tuple(f"agents/{name}/" for name in self.policy_hooks.frozen_sources())
        stats = {name: value for name, value in stats.items() if not name.startswith(frozen)} if frozen else stats  # a frozen co-player trains nothing
        padding = self.policy_hooks.pop_padding_fraction()
        if padding is not None:
            stats["train/padding_fraction"] = padding
        stats = self.distributed.mean(stats, weight=len(records))
        stepped = [group["agent"] for group in self.optimizer.param_groups if group["agent"] in trained]  # the norms' order
        for name, values in zip(stepped, torch.stack(norms).mean(0).tolist()):
            stats[f"train/grad_norm/{name}"] = values
        update.check_parameters(
            self.optimizer,
            trained,
            self.update_settings.divergence_bound,
            self.state.iteration + 1,
            self._last_checkpoint_note,
            self.distributed,
        )
        return stats

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
