"""Learning-aware trainers: SPG, LOLA and SOS, and their PPO-clipped forms (PSPG, POLA, PSOS).

One short class each over :class:`LearningAwareTrainer`, which builds the
loss of :mod:`nip_like.objectives.learning_aware` with what the loss needs
from the experiment: the protocol's leader order, each agent's learning-rate
factor and the update schedule. It refuses, before any work, a trainer that
needs leaders and followers on a protocol without them, and agents whose
policies cannot be differentiated twice.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from omegaconf import DictConfig
from torchrl.data import TensorDictReplayBuffer

from nip_like import keys
from nip_like.errors import ConfigError
from nip_like.objectives.learning_aware.base import LearningAwareLoss
from nip_like.objectives.learning_aware.opponent_shaping import (
    LOLAConfig,
    LOLALoss,
    POLAConfig,
    PSOSConfig,
    SOSConfig,
    SOSLoss,
)
from nip_like.objectives.learning_aware.second_order import actor_parameters, twice_differentiable
from nip_like.objectives.learning_aware.stackelberg import PSPGConfig, SPGConfig, SPGLoss
from nip_like.objectives.action_scores import score_actions
from nip_like.registry import register_trainer
from nip_like.trainers import update
from nip_like.trainers.rl import TensorDictRlTrainer


class LearningAwareTrainer(TensorDictRlTrainer):
    """A trainer whose loss accounts for how the other agents learn (options under ``trainer.objective``).

    Subclasses set :attr:`loss_class`; the PPO-clipped forms are registered
    with a schema that has ``clip_epsilon``.
    """

    shards_lm_agents = False  # its lookahead steps the agents outside the standard update

    #: The loss module class, called with the objective's options.
    loss_class: ClassVar[type[LearningAwareLoss]]

    @classmethod
    def validate(cls, config: DictConfig, scenario) -> list[str]:
        """The RL loop's checks, and what this trainer cannot differentiate through: shared policies, opponent pools, a protocol without leaders where the objective needs them."""
        problems = super().validate(config, scenario)
        trainer_type = config.trainer.trainer_type
        if scenario is not None:
            sharers = sorted(name for name, owner in getattr(scenario, "policy_owners", dict)().items() if owner != name)
            if sharers:
                problems.append(
                    f"trainer {trainer_type} differentiates each agent's update through the others' parameters; "
                    f"{', '.join(sharers)} play(s) another agent's model (share_policy_with), one set of parameters: use a standard "
                    f"trainer, or share_base_with (an adapter per agent)"
                )
            options = config.trainer.get("objective")
            if cls._needs_leader_order(options) and scenario.protocol.leader_order is None:
                why = "leaders differentiate through their followers" if cls.loss_class.needs_leader_order else (
                    "trainer.objective.anticipate=followers"
                )
                problems.append(
                    f"trainer {trainer_type} needs a protocol with leaders and followers ({why}); "
                    f"protocol {scenario.protocol.name} declares none (the interactive-proof protocols with provers do, and "
                    f"matrix_game with protocol.leader=row)"
                )
        if config.trainer.opponent_pool.get("agent"):
            problems.append(
                f"trainer {trainer_type} differentiates through the other agents' updates, which a snapshot "
                f"from trainer.opponent_pool does not make: use a standard trainer, or set trainer.opponent_pool.agent=null"
            )
        options = config.trainer.get("objective")
        if options is not None and options.get("ihvp_method") == "low_rank" and float(options.ihvp_damping) == 0:
            # The low-rank inverse divides by |eigenvalue| + damping; a flat direction would divide by 0.
            problems.append("trainer.objective.ihvp_damping must be > 0 with ihvp_method=low_rank, got 0")
        return problems

    @property
    def _name(self) -> str:
        return str(self.trainer_config.trainer_type) if hasattr(self, "trainer_config") else self.loss_class.__name__

    @classmethod
    def _needs_leader_order(cls, options: Any) -> bool:
        return cls.loss_class.needs_leader_order or (options is not None and options.get("anticipate") == "followers")

    def _get_loss_module_and_gae(self):
        options = self.objective_options
        optimizer = self.trainer_config.optimizer
        base_lr = float(optimizer.lr)
        factors = {name: float(optimizer.agent_lr.get(name, base_lr)) / base_lr for name in self.agent_names}
        if "lookahead_lr" in options and options["lookahead_lr"] is None:
            options["lookahead_lr"] = base_lr  # agents assume the others learn at their optimiser's rates
        try:
            parameters = actor_parameters(self.policy, self.agent_names)
        except ValueError as error:
            raise ConfigError(f"trainer {self._name} needs each agent's own policy parameters: {error}") from error
        check_second_order(self._name, self.policy, self.scenario, parameters, self.device)
        loss = self.loss_class(
            self.policy,
            self.value,
            self.agent_names,
            leader_order=self.scenario.protocol.leader_order,
            lr_factors=factors,
            **options,
        )
        # The update schedule is built after the loss: look it up when an iteration starts.
        loss.update_schedule = lambda iteration: self.update_schedule.trained_agents(iteration)
        return loss, loss.value_estimator

    # ------------------------------------------------------- the episodes used
    def fill_buffer(self, data) -> TensorDictReplayBuffer:
        """The standard buffer of the episodes; with ``cover_episodes``, minibatches that hold every episode every epoch.

        ``trainer.minibatch_size`` counts episodes, and a batch rarely holds a
        multiple of it: each epoch then takes ``round(episodes /
        minibatch_size)`` minibatches of nearly equal sizes
        (:func:`~nip_like.trainers.update.covering`) instead of leaving the
        remainder out.
        """
        buffer = super().fill_buffer(data)
        return update.covering(buffer) if self.loss_module.cover_episodes else buffer

    def _optimize(self, trained: tuple[str, ...]) -> dict[str, float]:
        """The standard update, and ``train/frames_used``: the share of the collected frames in an epoch's minibatches."""
        stats = super()._optimize(trained)
        frames = stats.get(self.loss_contract.metric_name("frames"))  # valid steps per minibatch, on average
        if frames is not None:
            collected = int(self.trainer_config.frames_per_batch)
            stats["train/frames_used"] = frames * update.minibatches_per_epoch(self.buffer) / collected
        return stats


def check_second_order(trainer: str, policy, scenario, parameters: dict[str, list], device: torch.device) -> None:
    """Refuse, in one line, agents whose policies cannot be differentiated twice.

    A policy module may declare ``supports_second_order = False``; otherwise
    two environments play one episode and each agent's log-probability of its
    actions is differentiated twice in its parameters (attention on the math
    kernel, as in the loss), which fails at once for an operation without a
    second derivative. The global random state is
    restored afterwards, so the run is the same with or without the check.

    Raises
    ------
    ConfigError
        Naming the trainer, the agent and the first line of the reason.
    """
    for module in policy.modules():
        if getattr(module, "supports_second_order", True) is False:
            raise ConfigError(
                f"trainer {trainer} needs second derivatives of the policies, which {type(module).__name__} "
                "declares it cannot give (supports_second_order = False)"
            )
    env = scenario.make_env(2, "train", 0, device)
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), twice_differentiable():
        with torch.no_grad():
            steps = env.rollout(scenario.protocol.num_rounds, policy, break_when_any_done=False).reshape(-1)
        agent = None
        try:
            scores = score_actions(policy, steps)
            active = steps.get(keys.ACTIVE_KEY)
            log_prob = torch.where(active, scores.log_prob, torch.zeros_like(scores.log_prob))
            for index, agent in enumerate(scenario.agent_names):
                params = parameters.get(agent, [])
                if not params or not bool(active[:, index].any()):
                    continue
                first = torch.autograd.grad(
                    log_prob[:, index].sum(),
                    params,
                    retain_graph=True,
                    create_graph=True,
                    allow_unused=True,
                    materialize_grads=True,
                )
                # Only parameters with a non-zero first derivative: a softmax policy's log-probability is not
                # linear in them, so each must be reached again by the second derivative.
                moving = [(param, g) for param, g in zip(params, first) if bool(g.detach().abs().sum() > 0)]
                if not moving:
                    continue
                square = torch.stack([(g * g).sum() for _, g in moving]).sum()
                second = (
                    torch.autograd.grad(square, [p for p, _ in moving], retain_graph=True, allow_unused=True)
                    if square.requires_grad
                    else [None] * len(moving)
                )
                if any(g is None for g in second):
                    raise RuntimeError(
                        "the first derivative does not depend on the parameters again "
                        "(an operation with a first derivative only, such as a once_differentiable function)"
                    )
        except RuntimeError as error:
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            who = f"agent {agent}'s policy" if agent is not None else "the policy"
            raise ConfigError(
                f"trainer {trainer} needs second derivatives of the policies, but {who} cannot give them ({reason})"
            ) from error


@register_trainer("spg", objective=SPGConfig)
class SpgTrainer(LearningAwareTrainer):
    """Stackelberg policy gradient: leaders differentiate through their followers' best responses."""

    loss_class = SPGLoss


@register_trainer("pspg", objective=PSPGConfig)
class PspgTrainer(LearningAwareTrainer):
    """Stackelberg policy gradient with PPO's clipped surrogate for each agent's own term."""

    loss_class = SPGLoss


@register_trainer("lola", objective=LOLAConfig)
class LolaTrainer(LearningAwareTrainer):
    """LOLA: each agent differentiates through the others' anticipated gradient step."""

    loss_class = LOLALoss


@register_trainer("pola", objective=POLAConfig)
class PolaTrainer(LearningAwareTrainer):
    """LOLA with PPO's clipped surrogate for each agent's own term."""

    loss_class = LOLALoss


@register_trainer("sos", objective=SOSConfig)
class SosTrainer(LearningAwareTrainer):
    """Stable opponent shaping: LOLA's shaping, scaled down where it would stop convergence."""

    loss_class = SOSLoss


@register_trainer("psos", objective=PSOSConfig)
class PsosTrainer(LearningAwareTrainer):
    """Stable opponent shaping with PPO's clipped surrogate for each agent's own term."""

    loss_class = SOSLoss
