"""The standard RL loop on TorchRL parts.

Collector -> advantage module (if any) -> layout of the rollouts by the loss
module -> replay buffer (TensorDict storage) -> epochs x minibatches ->
optimiser -> logs -> periodic evaluation and checkpoint; a test loop at the
end. A subclass implements only :meth:`TensorDictRlTrainer._get_loss_module_and_gae`.

The loop (:meth:`TensorDictRlTrainer._run_train_loop`) and one iteration
(:meth:`TensorDictRlTrainer.train_iteration`) read top to bottom here; the
work of each part is in a sibling module: collection
(:mod:`~nip_like.trainers.collection`), the update
(:mod:`~nip_like.trainers.update`), evaluation and test
(:mod:`~nip_like.trainers.evaluation`), the checkpoint's state
(:mod:`~nip_like.trainers.rl_state`).
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from abc import abstractmethod
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any, ClassVar, Iterator

import torch
from omegaconf import DictConfig, OmegaConf
from tensordict import TensorDictBase
from torch import nn
from torchrl.collectors import Collector
from torchrl.data import TensorDictReplayBuffer
from torchrl.envs.utils import ExplorationType
from torchrl.objectives import LossModule

from nip_like import keys
from nip_like.checkpoint import get_rng_states, load_checked, set_rng_states
from nip_like.errors import CheckpointError, ConfigError, ModelServerError
from nip_like.folders import resume_command
from nip_like.interrupts import StopRequested, stop_requested
from nip_like.lm.frozen import check_sources, source_record
from nip_like.trainers.opponent_pool import build_opponent_pool
from nip_like.lm.sharding import ShardedAgents, shard_like, shard_optimizer_state, whole
from nip_like.logging import MetricLogger
from nip_like.objectives.contract import LossContract, contract_of
from nip_like.objectives.reference import ReferencePolicy
from nip_like.optim import AgentUpdateSchedule, build_optimizer, build_scheduler
from nip_like.precision import float32_region
from nip_like.pretrain import pretrain_agents
from nip_like.scenarios.base import Demonstrating, Labelled, TensorGame
from nip_like.trainers import collection, evaluation, rl_state, update
from nip_like.trainers.base import IterationContext, TensorDictTrainer, attach_progress_bar
from nip_like.trainers.data_parallel import LossPasses
from nip_like.trainers.rl_state import TrainState
from nip_like.trainers.update import UpdateSettings

#: Notes on how the run goes, printed on rank 0 by Hydra's job logging (and kept in the run's job log).
log = logging.getLogger(__name__)


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
    policy : ProbabilisticActor
        The agents' stacked policy (``("agents", ...)`` keys, see :mod:`nip_like.agents`).
    value : TensorDictModule
        The agents' stacked value network.
    agent_names : tuple of str
        Agents, in the order of the agent dimension.
    config : DictConfig
        The whole experiment config (``self.config.trainer`` holds the RL options).

    Notes
    -----
    The attributes above are ready when :meth:`_get_loss_module_and_gae` runs.
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
        self._validate()
        # The build order: agents -> warm start -> reference -> loss -> optimiser -> collection.
        self.agent_names = scenario.agent_names
        self.agent_modules = scenario.make_agents()
        self.agent_modules.modules().to(self.device)
        self.policy = self.agent_modules.policy
        self.value = self.agent_modules.value
        self._attach_inference_servers()
        self.pretrain_metrics = self.warm_start()
        # The initial policy, frozen: the common reference of objective/kl.
        self.reference_policy = ReferencePolicy(self.policy)
        self.sharded = self.shard_agents()
        self._build_loss()
        self._build_optimiser()
        self.opponent_pool = build_opponent_pool(self.trainer_config.opponent_pool, self)
        with self.whole_weights():  # the collector runs the policy once to read its outputs
            self._build_collection()
        self.memory_metrics = self.set_token_budgets()
        self.buffer: TensorDictReplayBuffer | None = None
        self.state = TrainState()
        self.final_metrics: dict[str, float] = {}

    def _attach_inference_servers(self) -> None:
        """Give the LM agents with ``sampler.kind: server`` their inference servers (:mod:`nip_like.lm.server`)."""
        from nip_like.lm.server import InferenceServer, server_agents

        found = server_agents(self.scenario.lm_agent_configs())
        if not found:
            return
        agents = self.scenario.lm_agent_configs()
        self.policy.attach_servers(
            {
                name: InferenceServer(name, where, sampler, agents[name][1].pretrained_path, self.run_dir / "sampler")
                for name, (where, sampler) in found.items()
            }
        )

    def shard_agents(self) -> ShardedAgents | None:
        """The build order's FSDP2 step (``run.fsdp``): shard the LM agents over the ranks, after the reference is taken.

        None when the run does not shard (the default). The optimiser is built
        after this step, on the sharded parameters.
        """
        if not self.config.run.get("fsdp") or not self.distributed.enabled:
            return None
        # Rank 0 builds first (it writes the caches); from here on the build needs every rank at once.
        self.distributed.release_others()
        return ShardedAgents({name: self.policy.policy(name) for name in self.agent_names})

    def set_token_budgets(self) -> dict[str, float]:
        """The build order's last step: each LM agent's automatic ``max_tokens_per_micro_batch``, from a probe pass.

        For every language-model agent whose config leaves the budget null,
        one probe pass measures the activation bytes a token of its update
        keeps (:func:`~nip_like.lm.memory.activation_bytes_per_token`, under
        the run's autocast), and the memory free on the device (at most
        ``run.memory_limit_gib``), less every agent's gradients and optimiser
        state, sets the budget (:func:`~nip_like.lm.memory.automatic_budget`).
        A number in the config wins. Returns ``lm/memory/<agent>/...`` metrics
        (logged with the first iteration); nothing for other agents or sharded ones.
        """
        from nip_like.lm.memory import activation_bytes_per_token, automatic_budget, available_memory, size, trainable_bytes

        configs = self.scenario.lm_agent_configs()
        if not configs or self.sharded is not None or not hasattr(self.policy, "policy"):
            return {}
        held = sum(t.numel() * t.element_size() for t in (*self.policy.parameters(), *self.policy.buffers()))
        available = available_memory(self.device, self.config.run.get("memory_limit_gib"), held)
        # Each trainable parameter once: one model playing several roles (share_policy_with) trains once.
        reserved = trainable_bytes(nn.ModuleList([self.policy.policy(name) for name in configs]))
        width = int(getattr(self.train_env, "prompt_length", 0)) + int(self.policy.message_tokens)
        metrics: dict[str, float] = {}
        for name, (where, agent, _) in configs.items():
            policy = self.policy.policy(name)
            if agent.get("max_tokens_per_micro_batch") is not None or available is None:
                continue
            per_token = activation_bytes_per_token(policy, self.config.run.get("autocast_dtype"))
            budget = automatic_budget(per_token, available[0], reserved)
            if budget < width:
                raise ConfigError(
                    f"{where}: agent {name}'s update cannot fit in memory: {size(available[0])} is available "
                    f"({available[1]}), gradients and optimiser state take {size(reserved)} and a token of its update "
                    f"{per_token / 2**20:.2f} MiB, so a micro-batch holds {budget} tokens, under one row ({width}); lower "
                    f"{where}.lora.r or the model's size, or set {where}.gradient_checkpointing=true or run.autocast_dtype=bfloat16"
                )
            policy.max_tokens_per_micro_batch = budget
            metrics[f"lm/memory/{name}/budget_tokens"] = float(budget)
            metrics[f"lm/memory/{name}/activation_bytes_per_token"] = float(per_token)
        return metrics

    def whole_weights(self) -> Any:
        """A context in which sharded agents keep their weights whole (sampling, evaluation, test); else nothing."""
        return self.sharded.gathered() if self.sharded is not None else nullcontext()

    def _build_test_context(self, stack: ExitStack, deterministic: bool = True) -> None:
        super()._build_test_context(stack, deterministic)
        stack.enter_context(self.whole_weights())

    def close(self) -> None:
        """Stop the inference servers the run started and close their clients."""
        getattr(self.policy, "close_servers", lambda: None)()

    def warm_start(self) -> dict[str, float]:
        """The build order's warm start: fit the agents of ``trainer.pretrain.agents`` (cached), before the reference is taken.

        Returns the warm start's metrics (logged with the first iteration);
        nothing without ``trainer.pretrain.agents``. Agents whose LoRA adapters
        come after a full warm start get them here (LM agents only).
        """
        metrics = (
            pretrain_agents(self.config, self.scenario, self.agent_modules, self.device)
            if self.trainer_config.pretrain.agents
            else {}
        )
        getattr(self.policy, "after_warm_start", lambda: None)()
        return metrics

    def _build_loss(self) -> None:
        """The loss module and advantage module of :meth:`_get_loss_module_and_gae`, checked; the loss contract."""
        self.loss_module, self.advantage_module = self._get_loss_module_and_gae()
        if not isinstance(self.loss_module, LossModule):
            raise ConfigError(
                f"{type(self).__name__}._get_loss_module_and_gae must return a torchrl LossModule, "
                f"got {type(self.loss_module).__name__}"
            )
        self.loss_module.to(self.device)
        self.loss_contract: LossContract = contract_of(self.loss_module)
        if self.loss_contract.needs_groups and self.trainer_config.group_size < 2:
            raise ConfigError(
                f"trainer {self.trainer_config.trainer_type} compares episodes that started on the same datapoint: "
                f"set trainer.group_size >= 2, got {self.trainer_config.group_size}"
            )

    def _build_optimiser(self) -> None:
        """One parameter group per agent, the learning-rate schedule, which agents each iteration trains."""
        optimizer_config = self.trainer_config.optimizer
        # Owners before the agents that play their model (share_policy_with): a shared model trains in its owner's group.
        plays_another = lambda name: getattr(getattr(self.policy, "policy", lambda _: None)(name), "policy_owner", None) is not None  # noqa: E731
        names = sorted(self.agent_names, key=plays_another)
        agent_params = {name: list(self.agent_modules.agent_parameters(name)) for name in names}
        self.optimizer = build_optimizer(optimizer_config, agent_params)
        self.scheduler = build_scheduler(optimizer_config, self.optimizer, self.num_iterations)
        self._schedule_stepped = False  # whether the scheduler has stepped in this process (see train_iteration)
        self.update_schedule = AgentUpdateSchedule(self.trainer_config.agent_updates, self.agent_names)
        bound = self.trainer_config.divergence_bound
        self.update_settings = UpdateSettings(
            num_epochs=int(self.trainer_config.num_epochs),
            accumulation=self.accumulation,
            max_grad_norm=optimizer_config.max_grad_norm,
            divergence_bound=float(bound) if bound is not None else math.inf,
        )
        self._loss_passes: LossPasses | None = None  # built at the first update (see _optimise)
        # Read once: OmegaConf lookups are slow enough to show in the inner loop.
        self._diagnostics_every = int(self.config.logger.diagnostics_every)

    def _build_collection(self) -> None:
        """The train environments and their collector; the evaluation environments are built on first use."""
        seed = int(self.config.seed)
        # Under torchrun each rank collects its share of every batch, with its own seeds (nip_like.distributed).
        self.train_env = self.scenario.make_env(
            self.distributed.share(self.trainer_config.num_envs, "trainer.num_envs"),
            "train",
            self.distributed.seed(seed, "train_env"),
            self.device,
            group_size=int(self.trainer_config.group_size),
        )
        self.eval_env = None  # built on first use
        self.collector = Collector(
            self.train_env,
            self.policy,
            frames_per_batch=self.distributed.share(self.trainer_config.frames_per_batch, "trainer.frames_per_batch"),
            total_frames=-1,
            device=self.device,
            exploration_type=ExplorationType.RANDOM,
            auto_register_policy_transforms=False,
        )
        self._collector_iterator = iter(self.collector)

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
    def _validate(self) -> None:
        # Single fields are checked against their declared ranges when the experiment is built
        # (nip_like.allowed); what is left are the relations between fields.
        tc = self.trainer_config
        if tc.num_envs % tc.group_size:
            raise ConfigError(
                f"trainer.num_envs ({tc.num_envs}) must be a multiple of trainer.group_size ({tc.group_size})"
            )
        if (tc.num_envs // self.distributed.world_size) % tc.group_size:
            raise ConfigError(
                f"trainer.num_envs ({tc.num_envs}) over {self.distributed.world_size} ranks must leave each rank a "
                f"multiple of trainer.group_size ({tc.group_size})"
            )
        # Minibatches per optimiser step; null: one per rank (the ranks share each step's minibatches, whole).
        self.accumulation = update.accumulation_steps(tc.optimizer.grad_accumulation_steps, self.distributed.world_size)
        if tc.optimizer.grad_accumulation_steps is None and self.distributed.enabled and self.distributed.is_writer:
            log.info(
                "trainer.optimizer.grad_accumulation_steps is null: each optimiser step takes %d minibatches, one per "
                "rank, as one process does with grad_accumulation_steps=%d",
                self.accumulation,
                self.accumulation,
            )
        if tc.frames_per_batch % tc.num_envs:
            raise ConfigError(
                f"trainer.frames_per_batch ({tc.frames_per_batch}) must be a multiple of "
                f"trainer.num_envs ({tc.num_envs})"
            )
        if tc.minibatch_size > tc.frames_per_batch:
            raise ConfigError(
                f"trainer.minibatch_size ({tc.minibatch_size}) is larger than the batch "
                f"(trainer.frames_per_batch = {tc.frames_per_batch})"
            )
        if not tc.eval.metric.startswith("eval/"):
            raise ConfigError(f"trainer.eval.metric must name an evaluation metric (eval/...), got {tc.eval.metric!r}")
        if tc.eval.test_checkpoint == "best" and tc.eval.every == 0:
            raise ConfigError("trainer.eval.test_checkpoint=best needs evaluation: set trainer.eval.every > 0")

    @property
    def num_iterations(self) -> int:
        """Train-loop iterations (1 in test-run mode)."""
        return 1 if self.test_run else int(self.trainer_config.num_iterations)

    @property
    def num_test_iterations(self) -> int:
        """Test-loop iterations (1 in test-run mode)."""
        if self.test_run:
            return 1
        return math.ceil(self.test_episodes / self.trainer_config.test_batch_episodes)

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
        sampler_metrics = getattr(self.policy, "pop_sampler_metrics", dict)
        sampler_metrics()  # what evaluation sampled is not this iteration's
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
            metrics.update(sampler_metrics())
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
                    with float32_region(self.device):
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
        loss_stats = self._optimise(trained) if trained and len(self.buffer) else {}
        if loss_stats:
            getattr(self.policy, "weights_changed", lambda: None)()  # inference servers get the new weights
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
            pool.after_update(iteration + 1, self.collector._carrier.get(keys.GROUP_ID_KEY))
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

    def _optimise(self, trained: tuple[str, ...]) -> dict[str, float]:
        """Optimise the ``trained`` agents on the buffer (:func:`~nip_like.trainers.update.optimise`); the update's statistics."""
        # LM agents count the padding of their scoring passes: only the update's are reported.
        padding_fraction = getattr(self.policy, "pop_padding_fraction", lambda: None)
        padding_fraction()
        if self._loss_passes is None:
            # Under torchrun, DDP (replicated agents) or FSDP2 (run.fsdp) sums the ranks' gradients. Built here, where
            # every rank arrives together (rank 0 builds the trainer before the others), after the warm start.
            self._loss_passes = LossPasses(self.loss_module, self.distributed, lockstep=self.sharded is not None)
        records, norms = update.optimise(
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
        padding = padding_fraction()
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

    # -------------------------------------------------------------- evaluation
    def evaluate(self) -> dict[str, float]:
        """Play ``trainer.eval.num_episodes`` episodes on fixed eval data; return ``eval/`` metrics.

        The same episodes at every evaluation. Call it inside the test context
        (:meth:`_build_test_context`), as the train loop does.
        """
        dist = self.distributed
        num_episodes = dist.share(8 if self.test_run else self.trainer_config.eval.num_episodes, "trainer.eval.num_episodes")
        if self.eval_env is None or self.eval_env.num_envs != num_episodes:
            self.eval_env = self.scenario.make_env(num_episodes, self.scenario.eval_split, 0, self.device)
        # The same episodes at every evaluation, and no draw from the training generators.
        self.eval_env.rng.manual_seed(dist.seed(int(self.config.seed), "eval_env"))
        with dist.rank_rng(int(self.config.seed)):
            episodes = evaluation.run_episodes(self.eval_env, self.policy, self.scenario.protocol.num_rounds)
        episodes = dist.gather_cat(episodes)  # each rank played its share
        self._write_transcripts(episodes, f"eval_{self.state.iteration:06d}")
        return {f"eval/{k}": v for k, v in collection.episode_metrics(self.scenario, episodes).items()}

    def _write_transcripts(self, episodes: TensorDictBase, name: str) -> None:
        evaluation.write_transcripts(
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

        :meth:`train` calls it when evaluation is on; a caller that builds a
        trainer may call it to learn of a wrong metric before any training.
        Plays one evaluation (on the generator state it would use anyway, and
        with the global generators forked and restored, so training is the same
        with or without this check) and looks the metric up among its results.
        """
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), ExitStack() as stack:
            self._build_test_context(stack, self.trainer_config.eval.deterministic)
            evaluation.require_eval_metric(self.trainer_config.eval.metric, self.evaluate())

    def _track_best(self, metrics: dict[str, float]) -> None:
        """Note the evaluation in the state (best so far, early stopping); a new best writes ``best.pt``."""
        eval_config = self.trainer_config.eval
        evaluation.require_eval_metric(eval_config.metric, metrics)
        value = metrics[eval_config.metric]
        if evaluation.track_best(self.state, value, eval_config.mode, eval_config.early_stopping_patience):
            self.save_checkpoint("best")
        metrics["eval/best"] = self.state.best_metric

    def test(self) -> dict[str, float]:
        """Test the current agents on :attr:`test_split` in the test context; the ``test/...`` metrics.

        Plays :attr:`test_episodes` episodes (one batch in test-run mode) and
        writes their transcripts to ``transcripts/test.jsonl``. :meth:`train`
        ends with it; ``python -m nip_like.evaluate`` calls it on a saved state.
        """
        with ExitStack() as stack:
            self._build_test_context(stack)
            return self._run_test_loop()

    @attach_progress_bar(lambda self: self.num_test_iterations)
    def _run_test_loop(self, iteration_context: IterationContext) -> dict[str, float]:
        iteration_context.set_description("Testing")
        dist = self.distributed
        batch_episodes = dist.share(8 if self.test_run else self.trainer_config.test_batch_episodes, "trainer.test_batch_episodes")
        env = self.scenario.make_env(batch_episodes, self.test_split, dist.seed(int(self.config.seed), "test_env"), self.device)
        episodes = []
        for _ in range(self.num_test_iterations):
            if dist.any(stop_requested()):  # training is done and saved: a resumed run tests again
                raise StopRequested(self.state.iteration, phase="test")
            with dist.rank_rng(int(self.config.seed)):
                played = evaluation.run_episodes(env, self.policy, self.scenario.protocol.num_rounds)
            episodes.append(dist.gather_cat(played))  # each rank played its share of the batch
            iteration_context.step()
        all_episodes = torch.cat(episodes)
        if not self.test_run:
            all_episodes = all_episodes[: self.test_episodes]
        self._write_transcripts(all_episodes, "test")
        metrics = {f"test/{k}": v for k, v in collection.episode_metrics(self.scenario, all_episodes).items()}
        return evaluation.with_optimality(metrics, self.scenario.optimal_rewards() or {})

    # ------------------------------------------------------------ checkpoints
    def save_checkpoint(self, name: str = "last") -> Path:
        """Write the trainer state to ``checkpoints/<name>.pt``, and the agents in their own format.

        Agents that can write themselves as Hugging Face folders (a policy with
        ``save_pretrained``: language-model agents) are also saved under
        ``checkpoints/<name>/<agent>/`` (model, tokenizer, value head), beside
        the full trainer state that exact resumption reads.
        """
        path = super().save_checkpoint(name)
        save_pretrained = getattr(self.policy, "save_pretrained", None)
        # Sharded agents are made whole on every rank (a collective); rank 0 writes them.
        states = self.policy.whole_states() if self.sharded is not None else None
        if save_pretrained is not None and self.distributed.is_writer:
            save_pretrained(self.checkpoint_dir / name, states)
        return path

    def _frozen_keys(self) -> set[str]:
        return rl_state.frozen_keys(self.agent_modules.modules(), self.loss_module)

    def _load_loss_module_state(self, state: dict[str, Any]) -> None:
        if self.sharded is not None:  # a checkpoint holds whole tensors: each rank keeps its shards
            state = shard_like(state, self.loss_module.state_dict())
        rl_state.load_loss_module_state(self.loss_module, state, self._frozen_keys())

    def state_dict(self) -> dict[str, Any]:
        collection_state = rl_state.collection_state(self.collector, self.train_env)
        state = {
            # Without frozen agent weights, which the model folders hold already.
            "loss_module": rl_state.loss_module_state(self.loss_module, self._frozen_keys()),
            "reference_policy": self.reference_policy.state_dict(),
            "optimizer": self.optimizer.state_dict(),
        }
        if self.sharded is not None:  # whole tensors (every rank gathers): the file a replicated run writes
            state = whole(state)
        state |= {
            # Where frozen co-players were loaded from, with a checksum of the files read (their weights are not saved).
            "frozen_agents": source_record(getattr(self.policy, "frozen_sources", dict)()),
            "opponent_pool": self.opponent_pool.state_dict() if self.opponent_pool is not None else None,
            "scheduler": self.scheduler.state_dict(),
            "train_state": asdict(self.state),
            "rng": get_rng_states(),
        }
        if not self.distributed.enabled:
            return {**state, **collection_state}
        # Under torchrun each rank's collection (and its own random stream) is its own: one entry per rank.
        return {**state, "ranks": self.distributed.gather({**collection_state, "rank_rng": self.distributed.rng_state()})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        rl_state.check_ranks(state, self.distributed.world_size)
        collection_state = state["ranks"][self.distributed.rank] if "ranks" in state else state
        check_sources(state.get("frozen_agents", {}), getattr(self.policy, "frozen_sources", dict)())
        self._load_loss_module_state(state["loss_module"])
        self.reference_policy.load_state_dict(state["reference_policy"])
        optimizer_state = state["optimizer"]
        if self.sharded is not None:
            optimizer_state = shard_optimizer_state(optimizer_state, (p for g in self.optimizer.param_groups for p in g["params"]))
        self.optimizer.load_state_dict(optimizer_state)
        self.scheduler.load_state_dict(state["scheduler"])
        self.state = TrainState(**state["train_state"])
        if self.opponent_pool is not None:
            if state.get("opponent_pool") is None:
                raise CheckpointError("the checkpoint was written without trainer.opponent_pool: resume with the same settings")
            self.opponent_pool.load_state_dict(state["opponent_pool"], self.state.iteration)
        rl_state.load_collection_state(self.collector, self.train_env, collection_state, self.device)
        self.distributed.set_rng_state(collection_state.get("rank_rng"))
        set_rng_states(state["rng"])
        self.progress_initial = {"_run_train_loop": self.state.iteration}
