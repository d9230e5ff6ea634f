"""The standard RL loop on TorchRL parts.

Collector -> advantage module (if any) -> layout of the rollouts by the loss
module -> replay buffer (TensorDict storage) -> epochs x minibatches ->
optimiser -> logs -> periodic evaluation and checkpoint; a test loop at the
end. A subclass implements only :meth:`TensorDictRlTrainer._get_loss_module_and_gae`.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from abc import abstractmethod
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDictBase
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, SamplerWithoutReplacement, TensorDictReplayBuffer
from torchrl.envs.utils import ExplorationType
from torchrl.objectives import LossModule

from nip_like import keys
from nip_like.checkpoint import get_rng_states, load_checked, set_rng_states, write_text_atomic
from nip_like.errors import CheckpointError, ConfigError, TrainingError
from nip_like.interrupts import StopRequested, stop_requested
from nip_like.logging import MetricLogger
from nip_like.objectives.contract import LossContract, contract_of
from nip_like.objectives.masking import per_agent_mean
from nip_like.objectives.reference import ReferencePolicy, divergence_from_reference
from nip_like.pretrain import pretrain_agents
from nip_like.optim import AgentUpdateSchedule, build_optimizer, build_scheduler
from nip_like.scenarios.base import Demonstrating, Labelled, TensorGame
from nip_like.trainers.base import IterationContext, TensorDictTrainer, attach_progress_bar


@dataclass
class TrainState:
    """Counters of the train loop, saved in checkpoints."""

    iteration: int = 0  # completed iterations
    frames: int = 0  # environment steps collected
    gradient_steps: int = 0  # optimiser steps taken
    best_metric: float | None = None  # best evaluation metric so far
    best_iteration: int | None = None  # iteration of the best evaluation
    evals_without_improvement: int = 0  # for early stopping
    stopped_early: bool = False  # whether early stopping ended training
    train_seconds: float = 0.0  # wall time spent in the train loop, over all sessions


def finished_episodes(rollout: TensorDictBase, first_only: bool = False) -> TensorDictBase:
    """Return the ``"next"`` entries of the last step of each finished episode.

    Parameters
    ----------
    rollout : TensorDictBase
        Batch shape ``(env, time)``.
    first_only : bool
        Keep only each environment's first finished episode (evaluation runs
        reset finished environments and would otherwise count some twice).
    """
    done = rollout.get(("next", "done")).squeeze(-1)
    if first_only:
        done = done & (done.cumsum(-1) == 1)
    return rollout.get("next")[done]


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
        self._validate()
        self.agent_names = scenario.agent_names
        self.agent_modules = scenario.make_agents()
        self.agent_modules.modules().to(self.device)
        self.policy = self.agent_modules.policy
        self.value = self.agent_modules.value
        # Optional supervised pretraining (cached); the reference below is then the pretrained policy.
        self.pretrain_metrics = (
            pretrain_agents(config, scenario, self.agent_modules, self.device)
            if self.trainer_config.pretrain.agents
            else {}
        )
        # Agents whose LoRA adapters come after a full warm start get them now (LM agents only).
        getattr(self.policy, "after_warm_start", lambda: None)()
        # The initial policy, frozen: the common reference of objective/kl.
        self.reference_policy = ReferencePolicy(self.policy)

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
        optimizer_config = self.trainer_config.optimizer
        agent_params = {name: list(self.agent_modules.agent_parameters(name)) for name in self.agent_names}
        self.optimizer = build_optimizer(optimizer_config, agent_params)
        self.scheduler = build_scheduler(optimizer_config, self.optimizer, self.num_iterations)
        self.update_schedule = AgentUpdateSchedule(self.trainer_config.agent_updates, self.agent_names)
        # Read once: OmegaConf lookups are slow enough to show in the inner loop.
        self._max_grad_norm = optimizer_config.max_grad_norm
        self._accumulation = int(optimizer_config.grad_accumulation_steps)
        self._diagnostics_every = int(config.logger.diagnostics_every)
        bound = self.trainer_config.divergence_bound
        self._divergence_bound = float(bound) if bound is not None else math.inf

        seed = int(config.seed)
        # Under torchrun each rank collects its share of every batch, with its own seeds (nip_like.distributed).
        self.train_env = scenario.make_env(
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
        self.buffer: TensorDictReplayBuffer | None = None
        self.state = TrainState()
        self.final_metrics: dict[str, float] = {}

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
        accumulation = tc.optimizer.grad_accumulation_steps
        if accumulation % self.distributed.world_size:
            raise ConfigError(
                f"trainer.optimizer.grad_accumulation_steps ({accumulation}) must be a multiple of the number of "
                f"ranks ({self.distributed.world_size}): the ranks share each optimiser step's minibatches"
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
        return math.ceil(self.trainer_config.num_test_episodes / self.trainer_config.test_batch_episodes)

    def trainable_modules(self) -> list[nn.Module]:
        return [self.loss_module]

    # ---------------------------------------------------------------- training
    def train(self) -> dict[str, float]:
        """Run the train loop, then the test loop; return the test metrics."""
        if self.state.iteration < self.num_iterations and not self.state.stopped_early:
            if self.trainer_config.eval.every:
                self._check_eval_metric()
            with ExitStack() as stack:
                self._build_train_context(stack)
                self._run_train_loop()
        if self.trainer_config.eval.test_checkpoint == "best" and self.state.best_iteration is not None:
            best = load_checked(self.checkpoint_dir / "best.pt", self.run_id)
            self._load_loss_module_state(best["trainer"]["loss_module"])
        with ExitStack() as stack:
            self._build_test_context(stack)
            self.final_metrics = self._run_test_loop()
        self.logger.log(self.final_metrics, step=self.state.iteration)
        return self.final_metrics

    @attach_progress_bar(lambda self: self.num_iterations)
    def _run_train_loop(self, iteration_context: IterationContext) -> None:
        iteration_context.set_description("Training")
        eval_every = self.trainer_config.eval.every
        checkpoint_every = self.config.run.checkpoint_every
        while self.state.iteration < self.num_iterations:
            started = time.perf_counter()
            metrics = self._train_iteration()
            self.state.iteration += 1
            iteration = self.state.iteration
            last = iteration == self.num_iterations
            if eval_every and (iteration % eval_every == 0 or last):
                with ExitStack() as stack:
                    self._build_test_context(stack, self.trainer_config.eval.deterministic)
                    metrics.update(self._evaluate())
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

    def _train_iteration(self) -> dict[str, float]:
        """Collect one batch and optimise on it; return the iteration's metrics."""
        iteration = self.state.iteration
        started = time.perf_counter()
        dist = self.distributed
        with torch.no_grad(), dist.rank_rng(int(self.config.seed)):
            batch = next(self._collector_iterator).to(self.device)
        collected = time.perf_counter()
        frames = batch.numel() * dist.world_size
        self.state.frames += frames
        episodes = dist.gather_cat(finished_episodes(batch))
        metrics = {f"train/{k}": v for k, v in self._episode_metrics(episodes).items()}
        if iteration == 0:
            metrics.update(self.pretrain_metrics)
        every = self._diagnostics_every
        if every and iteration % every == 0:
            metrics.update(dist.mean(self._policy_diagnostics(batch)))

        with torch.no_grad():
            if self.advantage_module is not None:
                self.advantage_module(batch)
            self.loss_contract.start_iteration(iteration)
            # Every rank optimises on the whole batch's layout: the ranks' layouts, in rank order.
            data = dist.gather_cat(self.loss_contract.layout_rollouts(batch))
        metrics["train/layout_items"] = data.batch_size[0]
        metrics.update({f"train/{k}": v for k, v in dist.mean(self.loss_contract.layout_metrics()).items()})
        self._fill_buffer(data)

        trained = self.update_schedule.trained_agents(iteration)
        learning_rates = {f"lr/{group['agent']}": group["lr"] for group in self.optimizer.param_groups}
        loss_stats = self._optimise(trained) if trained and len(self.buffer) else {}
        with warnings.catch_warnings():
            # The schedule follows iterations, also those that made no update.
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
            self.scheduler.step()
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

    def _policy_diagnostics(self, batch: TensorDictBase) -> dict[str, float]:
        """KL from the initial policy and entropy of the collecting policy, over active steps.

        See :func:`~nip_like.objectives.reference.divergence_from_reference`:
        exact for categorical actions, per-token estimates on the sampled
        tokens for messages; the same for every objective.
        """
        active = batch.get(keys.ACTIVE_KEY)
        kl, entropy = divergence_from_reference(batch, self.reference_policy)
        kl, entropy = per_agent_mean(kl, active), per_agent_mean(entropy, active)
        metrics = {"objective/kl": kl.mean().item(), "objective/entropy": entropy.mean().item()}
        for index, name in enumerate(self.agent_names):
            metrics[f"agents/{name}/objective/kl"] = kl[index].item()
            metrics[f"agents/{name}/objective/entropy"] = entropy[index].item()
        metrics.update(self.scenario.policy_metrics(batch))
        return metrics

    def _fill_buffer(self, data: TensorDictBase) -> None:
        # One buffer item per element of the first batch dimension (a
        # transition, a segment, a pair, a group: whatever the loss laid out).
        # A layout smaller than a minibatch (preference pairs can be few) is
        # one minibatch; an empty one leaves nothing to optimise.
        size = data.batch_size[0]
        capacity = max(size, 1)  # a storage needs room for one item even when the layout is empty
        minibatch_size = min(self.trainer_config.minibatch_size, capacity)
        if self.buffer is None or self.buffer.storage.max_size != capacity or self.buffer.batch_size != minibatch_size:
            self.buffer = TensorDictReplayBuffer(
                storage=LazyTensorStorage(capacity, device=self.device),
                sampler=SamplerWithoutReplacement(drop_last=True),
                batch_size=minibatch_size,
            )
        self.buffer.empty()
        if size:
            self.buffer.extend(data)

    def _optimise(self, trained: tuple[str, ...]) -> dict[str, float]:
        # Statistics stay tensors until the end of the iteration: converting
        # them per minibatch costs more than the bookkeeping is worth.
        num_minibatches = len(self.buffer) // self.buffer.batch_size
        # Gradients of `accumulation` minibatches make one step; when the
        # layout's size leaves a shorter last window, it steps on its own mean.
        starts = range(0, num_minibatches, self._accumulation)
        windows = [min(self._accumulation, num_minibatches - start) for start in starts]
        window_of = [length for length in windows for _ in range(length)]
        records = []
        norms = []
        # LM agents count the padding of their scoring passes: only the update's are reported.
        padding_fraction = getattr(self.policy, "pop_padding_fraction", lambda: None)
        padding_fraction()
        self.optimizer.zero_grad(set_to_none=True)
        owns = self.distributed.owns
        for epoch in range(self.trainer_config.num_epochs):
            position = 0
            for minibatch in range(num_minibatches):
                sample = self.buffer.sample()  # every rank draws every minibatch: the same stream on each
                if owns(position):  # under torchrun, the ranks take a window's minibatches in turn
                    losses = self.loss_module(sample)
                    loss = sum(losses.get(key) for key in losses.keys() if key.startswith("loss_"))
                    if not loss.abs() <= self._divergence_bound:  # also true for NaN
                        value = loss.item()
                        what = f"became {value}" if not math.isfinite(value) else f"exploded to {value:.4g}"
                        raise TrainingError(
                            f"the loss {what} at iteration {self.state.iteration + 1}, epoch {epoch + 1}, "
                            f"minibatch {minibatch + 1} ({self._loss_terms(losses)}){self._bound_note(value)}; "
                            f"{self._last_checkpoint_note()}"
                        )
                    (loss / window_of[minibatch]).backward()
                    records.append(losses.detach())
                position += 1
                if position == window_of[minibatch]:
                    norms.append(self._optimizer_step(trained))
                    position = 0
        stats = {
            self._stat_name(key): float(value.float().mean())
            for key, value in torch.stack(records).items(include_nested=True, leaves_only=True)
        } if records else {}
        padding = padding_fraction()
        if padding is not None:
            stats["train/padding_fraction"] = padding
        stats = self.distributed.mean(stats, weight=len(records))
        for name, values in zip(trained, torch.stack(norms).mean(0).tolist()):
            stats[f"train/grad_norm/{name}"] = values
        self._check_parameters(trained)
        return stats

    def _check_parameters(self, trained: tuple[str, ...]) -> None:
        """Stop if a trained agent's parameters left the divergence bound (or became non-finite)."""
        if not trained:
            return
        groups = [group for group in self.optimizer.param_groups if group["agent"] in trained]
        largest = torch.stack([torch.stack([p.detach().abs().max() for p in g["params"]]).max() for g in groups])
        worst = int(largest.nan_to_num(math.inf).argmax())
        value = largest[worst].item()
        if not value <= self._divergence_bound:
            raise TrainingError(
                f"the parameters of agent {groups[worst]['agent']} reached magnitude {value:.4g} at iteration "
                f"{self.state.iteration + 1}{self._bound_note(value)}; {self._last_checkpoint_note()}"
            )

    def _bound_note(self, value: float) -> str:
        if math.isfinite(value):
            return f", beyond trainer.divergence_bound={self._divergence_bound:g} (a lower learning rate may help)"
        return ""

    def _optimizer_step(self, trained: tuple[str, ...]) -> torch.Tensor:
        """Clip each trained agent's gradient, step, and return their norms (in ``trained`` order)."""
        norms = []
        for group in self.optimizer.param_groups:
            if group["agent"] not in trained:
                for param in group["params"]:
                    param.grad = None
                continue
            self.distributed.sum_gradients(group["params"])
            grads = [param for param in group["params"] if param.grad is not None]
            if self._max_grad_norm is not None:
                norms.append(torch.nn.utils.clip_grad_norm_(grads, self._max_grad_norm))
            else:
                norms.append(torch.nn.utils.get_total_norm([param.grad for param in grads]))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.gradient_steps += 1
        return torch.stack(norms)

    def _last_checkpoint_note(self) -> str:
        last = self.checkpoint_dir / "last.pt"
        return f"the last checkpoint is {last}" if last.is_file() else "no checkpoint was written yet"

    def _stat_name(self, key: str | tuple[str, ...]) -> str:
        if isinstance(key, str):
            return self.loss_contract.metric_name(key)
        if key[0] == "agents" and len(key) == 3:
            return f"agents/{key[1]}/{self.loss_contract.metric_name(key[2])}"
        return "train/" + "/".join(key)

    @staticmethod
    def _loss_terms(losses: TensorDictBase) -> str:
        return ", ".join(
            f"{key}={float(value.detach()):.4g}" for key, value in losses.items() if key.startswith("loss_")
        )

    def _episode_metrics(self, episodes: TensorDictBase) -> dict[str, float]:
        count = episodes.batch_size.numel()  # TensorDict.numel() is 1 for an empty batch
        if count == 0:
            return {}
        metrics = self.scenario.episode_metrics(episodes)
        metrics["episodes"] = count
        return metrics

    # -------------------------------------------------------------- evaluation
    def _run_episodes(self, env, num_steps: int) -> TensorDictBase:
        rollout = env.rollout(num_steps, self.policy, break_when_any_done=False, auto_reset=True)
        return finished_episodes(rollout, first_only=True)

    def _evaluate(self) -> dict[str, float]:
        """Play ``trainer.eval.num_episodes`` episodes on fixed eval data; return ``eval/`` metrics."""
        dist = self.distributed
        num_episodes = dist.share(8 if self.test_run else self.trainer_config.eval.num_episodes, "trainer.eval.num_episodes")
        if self.eval_env is None or self.eval_env.num_envs != num_episodes:
            self.eval_env = self.scenario.make_env(num_episodes, self.scenario.eval_split, 0, self.device)
        # The same episodes at every evaluation, and no draw from the training generators.
        self.eval_env.rng.manual_seed(dist.seed(int(self.config.seed), "eval_env"))
        with dist.rank_rng(int(self.config.seed)):
            episodes = self._run_episodes(self.eval_env, self.scenario.protocol.num_rounds)
        episodes = dist.gather_cat(episodes)  # each rank played its share
        self._write_transcripts(episodes, f"eval_{self.state.iteration:06d}")
        return {f"eval/{k}": v for k, v in self._episode_metrics(episodes).items()}

    def _write_transcripts(self, episodes: TensorDictBase, name: str) -> None:
        """Write the scenario's transcripts of ``episodes`` to ``transcripts/<name>.jsonl`` (if it has any)."""
        records = self.scenario.transcripts(episodes, int(self.trainer_config.eval.transcripts))
        if not records or not self.distributed.is_writer:
            return
        text = "".join(json.dumps(record) + "\n" for record in records)
        write_text_atomic(text, self.run_dir / "transcripts" / f"{name}.jsonl")
        readable = "\n\n".join(self.scenario.transcript_text(record) for record in records)
        self.logger.log_text(f"transcripts/{name.split('_')[0]}", readable + "\n", step=self.state.iteration)

    def _check_eval_metric(self) -> None:
        """Refuse a ``trainer.eval.metric`` that evaluation does not report, before the first step.

        Plays one evaluation (on the generator state it would use anyway, and
        with the global generators forked and restored, so training is the same
        with or without this check) and looks the metric up among its results.
        """
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), ExitStack() as stack:
            self._build_test_context(stack, self.trainer_config.eval.deterministic)
            self._require_eval_metric(self._evaluate())

    def _require_eval_metric(self, metrics: dict[str, float]) -> None:
        """Refuse a ``trainer.eval.metric`` that is not among an evaluation's ``metrics``."""
        metric = self.trainer_config.eval.metric
        if metric not in metrics:
            raise ConfigError(
                f"trainer.eval.metric {metric!r} is not among the evaluation metrics "
                f"{sorted(k for k in metrics if k.startswith('eval/'))}"
            )

    def _track_best(self, metrics: dict[str, float]) -> None:
        eval_config = self.trainer_config.eval
        self._require_eval_metric(metrics)
        value = metrics[eval_config.metric]
        best = self.state.best_metric
        improved = best is None or (value > best if eval_config.mode == "max" else value < best)
        if improved:
            self.state.best_metric = value
            self.state.best_iteration = self.state.iteration
            self.state.evals_without_improvement = 0
            self.save_checkpoint("best")
        else:
            self.state.evals_without_improvement += 1
            patience = eval_config.early_stopping_patience
            if patience and self.state.evals_without_improvement >= patience:
                self.state.stopped_early = True
        metrics["eval/best"] = self.state.best_metric

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
                played = self._run_episodes(env, self.scenario.protocol.num_rounds)
            episodes.append(dist.gather_cat(played))  # each rank played its share of the batch
            iteration_context.step()
        all_episodes = torch.cat(episodes)
        if not self.test_run:
            all_episodes = all_episodes[: self.trainer_config.num_test_episodes]
        self._write_transcripts(all_episodes, "test")
        metrics = {f"test/{k}": v for k, v in self._episode_metrics(all_episodes).items()}
        optimum = self.scenario.optimal_rewards()
        if optimum:
            for name, best in optimum.items():
                if f"test/agents/{name}/reward" in metrics and best > 0:
                    metrics[f"test/agents/{name}/optimality"] = metrics[f"test/agents/{name}/reward"] / best
        return metrics

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
        if save_pretrained is not None and self.distributed.is_writer:
            save_pretrained(self.checkpoint_dir / name)
        return path

    def _frozen_keys(self) -> set[str]:
        """Keys of the loss module's state that hold frozen agent weights (a LoRA agent's base model)."""
        frozen = {param.data_ptr() for param in self.agent_modules.modules().parameters() if not param.requires_grad}
        if not frozen:
            return set()
        return {key for key, value in self.loss_module.state_dict(keep_vars=True).items() if value.data_ptr() in frozen}

    def _loss_module_state(self) -> dict[str, Any]:
        """The loss module's state without frozen agent weights, which the model folders hold already."""
        frozen = self._frozen_keys()
        return {key: value for key, value in self.loss_module.state_dict().items() if key not in frozen}

    def _load_loss_module_state(self, state: dict[str, Any]) -> None:
        frozen = self._frozen_keys()
        missing, unexpected = self.loss_module.load_state_dict(state, strict=not frozen)
        if set(missing) - frozen or unexpected:
            raise CheckpointError(
                f"the checkpoint does not fit this run's agents: missing {sorted(set(missing) - frozen)[:3]}, "
                f"unexpected {sorted(unexpected)[:3]}"
            )

    def state_dict(self) -> dict[str, Any]:
        collection = {
            "collector": self.collector.state_dict(),
            # The collector's current TensorDict holds every in-flight episode
            # (the environments keep their state in it), so restoring it
            # continues collection exactly.
            "collector_carrier": self.collector._carrier.clone(),
            "env_rng": self.train_env.get_rng_state(),
        }
        state = {
            "loss_module": self._loss_module_state(),
            "reference_policy": self.reference_policy.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "train_state": asdict(self.state),
            "rng": get_rng_states(),
        }
        if not self.distributed.enabled:
            return {**state, **collection}
        # Under torchrun each rank's collection (and its own random stream) is its own: one entry per rank.
        return {**state, "ranks": self.distributed.gather({**collection, "rank_rng": self.distributed.rng_state()})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ranks = len(state.get("ranks", [None]))
        if ranks != self.distributed.world_size:
            raise CheckpointError(
                f"the checkpoint was written by a run of {ranks} rank(s); resume it with as many "
                f"(torchrun --nproc_per_node={ranks}), not {self.distributed.world_size}"
            )
        collection = state["ranks"][self.distributed.rank] if "ranks" in state else state
        self._load_loss_module_state(state["loss_module"])
        self.reference_policy.load_state_dict(state["reference_policy"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.state = TrainState(**state["train_state"])
        self.collector.load_state_dict(collection["collector"])
        self.collector._carrier.update(collection["collector_carrier"].to(self.device))
        self.train_env.set_rng_state(collection["env_rng"])
        self.distributed.set_rng_state(collection.get("rank_rng"))
        set_rng_states(state["rng"])
        self.progress_initial = {"_run_train_loop": self.state.iteration}
