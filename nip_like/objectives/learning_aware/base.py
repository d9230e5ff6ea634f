"""The base of the learning-aware losses (:class:`LearningAwareLoss`), its options and its rollout layout.

:class:`LearningAwareLoss` holds the estimators, the layout of whole padded
episodes, the critic and the way the update is returned; a subclass adds the
second-order part of the update. Notation: :mod:`nip_like.objectives.learning_aware`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, ClassVar

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModule
from tensordict.utils import NestedKey
from torch import nn
from torchrl.objectives import ValueEstimators
from torchrl.objectives.utils import distance_loss
from torchrl.objectives.value import GAE

from nip_like import keys
from nip_like.allowed import checked
from nip_like.distributed import concatenated
from nip_like.objectives.contract import ObjectiveConfig, RolloutLoss
from nip_like.objectives.episodes import complete_episodes, lengthened
from nip_like.objectives.learning_aware.second_order import (
    Vector,
    _dot,
    _flat,
    actor_parameters,
    twice_differentiable,
)
from nip_like.objectives.masking import per_agent_mean, set_per_agent, standardize_per_agent
from nip_like.objectives.options import check_options
from nip_like.objectives.ppo import CRITIC_LOSS_TYPES, PPOConfig, clipped_surrogate
from nip_like.objectives.action_scores import behaviour_token_log_probs, critic_value, score_actions

#: ``(episodes, time)`` booleans of the episode layout: the step is part of its episode (not padding).
VALID_KEY = "valid_step"


# ------------------------------------------------------------------ schemas
@dataclass
class LearningAwareConfig(ObjectiveConfig):
    """Options every learning-aware objective shares (the keyword arguments of :class:`LearningAwareLoss`)."""

    entropy_coeff: float = checked(0.01, ge=0)  # weight of each agent's entropy in its own objective (enters the second-order terms too)
    critic_coeff: float = checked(0.5, ge=0)  # weight of the value loss
    loss_critic_type: str = checked("l2", choices=CRITIC_LOSS_TYPES)  # l1 | l2 | smooth_l1
    normalize_advantage: bool = False  # standardise advantages per agent (rescales every gradient, so off by default)
    gamma: float = checked(0.99, ge=0, le=1)  # discount factor of GAE
    lmbda: float = checked(0.95, ge=0, le=1)  # GAE lambda
    cover_episodes: bool = True  # cut each epoch's episodes into round(episodes / minibatch_size) minibatches of nearly equal sizes, every episode in one; false: minibatches of exactly minibatch_size episodes, the rest left out of the epoch
    truncated_episodes: bool = False  # also lay out the episodes that start in the batch and end after it (their steps so far, with GAE's bootstrapped advantages)


# ------------------------------------------------------------------ layout
def joined_episodes(parts: list[TensorDictBase]) -> TensorDictBase:
    """Padded episodes of several batches (the ranks'), each padded to the longest of all, concatenated."""
    length = max(part.batch_size[1] for part in parts)
    return concatenated([lengthened(part, length, 0, (VALID_KEY, keys.ACTIVE_KEY)) for part in parts])


def padded_episodes(batch: TensorDictBase, truncated: bool = False) -> TensorDictBase:
    """The complete episodes of a collected ``(env, time)`` batch, padded to one length.

    Parameters
    ----------
    batch : TensorDictBase
        As collected, with the round (``("state", "round")``) and done flags.
    truncated : bool
        Also the episodes that start in the batch and end after it: their
        steps up to the batch's end (GAE bootstraps their advantages from the
        value after the last one). Episodes that started before the batch are
        left out either way: their first steps are in the batch before.

    Returns
    -------
    TensorDictBase
        Batch shape ``(episodes, T)``, ``T`` the longest episode; step ``t``
        of an episode is its round ``t``. Padding repeats an episode's first
        step with :data:`VALID_KEY` false and every agent inactive.
    """
    found = complete_episodes(batch)
    kept = found.complete
    if truncated:
        kept = (batch.get(keys.ROUND_KEY) == 0).long().cumsum(-1) > 0  # every step from an episode's start on
    steps = batch[kept]
    _, episode = found.ids[kept].unique(return_inverse=True)
    position = batch.get(keys.ROUND_KEY)[kept]
    num_episodes = int(episode.max()) + 1 if episode.numel() else 0
    length = int(position.max()) + 1 if position.numel() else 1
    slot = episode * length + position
    first = torch.full((num_episodes,), steps.batch_size[0], dtype=torch.long, device=slot.device)
    first = first.scatter_reduce(0, episode, torch.arange(steps.batch_size[0], device=slot.device), "amin")
    padded = steps[first.repeat_interleave(length)].clone()
    valid = torch.zeros(num_episodes * length, dtype=torch.bool, device=slot.device)
    valid[slot] = True
    padded[slot] = steps
    padded.set(VALID_KEY, valid)
    padded.set(keys.ACTIVE_KEY, padded.get(keys.ACTIVE_KEY) & valid.unsqueeze(-1))
    return padded.reshape(num_episodes, length)


# -------------------------------------------------------------------- loss
class LearningAwareLoss(RolloutLoss):
    """Base of the learning-aware losses: estimators, layout, critic and the way the update is returned.

    A subclass implements :meth:`_corrections`, the part of each agent's
    update beyond its own gradient (see :mod:`nip_like.objectives.learning_aware`).

    The keyword options and their defaults are :class:`LearningAwareConfig`'s
    (and a subclass's schema's); ``clip_epsilon`` allows what PPO's does. A
    value outside a field's declared range is refused with a
    :class:`~nip_like.errors.ConfigError`.

    Parameters
    ----------
    actor_network : ProbabilisticActor or an actor with ``score_actions``
        The agents' policy; each agent's parameters are those of its network
        in the actor's :class:`~nip_like.agent_modules.PerAgent` modules, and must be
        twice differentiable.
    critic_network : TensorDictModule
        The value network (``("agents", "state_value")``), GAE's baseline.
    agent_names : tuple of str
        Agents, in the order of the agent dimension.
    leader_order : tuple of tuple of str, optional
        Groups of agents, leaders first (a protocol's ``leader_order``); an
        agent's followers are the agents of all later groups.
    lr_factors : dict, optional
        Each agent's learning-rate factor (its learning rate over the base
        one); LOLA and SOS assume agent ``j`` learns with step size
        ``alpha_j = lookahead_lr * lr_factors[j]``. 1 for an agent left out.
    entropy_coeff, critic_coeff : float
        Weights of the entropy (in every agent's objective) and of the value loss.
    loss_critic_type : str
        ``"l1"``, ``"l2"`` or ``"smooth_l1"``.
    normalize_advantage : bool
        Standardise advantages per agent over the valid steps.
    gamma, lmbda : float
        GAE's discount and lambda (:attr:`value_estimator`).
    clip_epsilon : float, optional
        Clip each agent's own term as PPO does (the P-forms); ``None`` does not clip.
    cover_episodes : bool
        Ask the trainer for minibatches that cover every episode in every
        epoch (:attr:`cover_episodes`; the trainer reads it).
    truncated_episodes : bool
        Lay out also the episodes cut off by the batch's end (:func:`padded_episodes`).

    Notes
    -----
    The output holds ``loss_objective`` (the agents' own surrogates, gradient
    ``xi``), ``loss_shaping`` (value 0, gradient the learning-aware part of
    the update), ``loss_entropy`` and ``loss_critic``, the statistics
    ``entropy``, ``clip_fraction``, ``shaping_norm`` (the norm of the
    learning-aware part over all agents), ``episodes`` and ``frames`` (the
    minibatch's episodes and their steps) and each subclass's own, and per
    agent ``("agents", <name>, ...)``. Their logged names are declared in
    :attr:`metric_names`. Outside gradient mode (``torch.no_grad``) the
    second-order terms are not computed and ``loss_shaping`` is 0. The
    critic is fitted on the episodes' steps, not on their padding.
    """

    @dataclass
    class _AcceptedKeys:
        advantage: NestedKey = keys.ADVANTAGE_KEY
        value_target: NestedKey = keys.VALUE_TARGET_KEY
        value: NestedKey = keys.VALUE_KEY
        action: NestedKey = keys.ACTION_KEY
        sample_log_prob: NestedKey = keys.LOG_PROB_KEY
        active: NestedKey = keys.ACTIVE_KEY
        valid: NestedKey = VALID_KEY
        reward: NestedKey = keys.REWARD_KEY
        done: NestedKey = keys.DONE_KEY
        terminated: NestedKey = keys.TERMINATED_KEY

    default_keys = _AcceptedKeys
    default_value_estimator = ValueEstimators.GAE
    metric_names: ClassVar = {
        "shaping_norm": "learning_aware/shaping_norm",
        "lookahead_norm": "learning_aware/lookahead_norm",
        "sos_p": "learning_aware/sos_p",
        "ihvp_residual": "learning_aware/ihvp_residual",
        "own_grad_norm": "learning_aware/own_grad_norm",
        "episodes": "learning_aware/episodes",
        "frames": "learning_aware/frames",
    }
    #: Whether the loss needs a leader order whatever its options (SPG).
    needs_leader_order: ClassVar[bool] = False
    options_schema = LearningAwareConfig

    def __init__(
        self,
        actor_network: nn.Module,
        critic_network: TensorDictModule,
        agent_names: tuple[str, ...],
        *,
        leader_order: tuple[tuple[str, ...], ...] | None = None,
        lr_factors: dict[str, float] | None = None,
        entropy_coeff: float = LearningAwareConfig.entropy_coeff,
        critic_coeff: float = LearningAwareConfig.critic_coeff,
        loss_critic_type: str = LearningAwareConfig.loss_critic_type,
        normalize_advantage: bool = LearningAwareConfig.normalize_advantage,
        gamma: float = LearningAwareConfig.gamma,
        lmbda: float = LearningAwareConfig.lmbda,
        clip_epsilon: float | None = None,
        cover_episodes: bool = LearningAwareConfig.cover_episodes,
        truncated_episodes: bool = LearningAwareConfig.truncated_episodes,
    ) -> None:
        check_options(
            self,
            LearningAwareConfig,
            entropy_coeff=entropy_coeff,
            critic_coeff=critic_coeff,
            loss_critic_type=loss_critic_type,
            gamma=gamma,
            lmbda=lmbda,
        )
        # The PPO-clipped forms' clip range allows what PPO's does (None: not clipped).
        check_options(self, PPOConfig, clip_epsilon=clip_epsilon)
        super().__init__()
        self.actor_network = actor_network
        self.critic_network = critic_network
        self.agent_names = tuple(agent_names)
        self.leader_order = tuple(tuple(group) for group in leader_order) if leader_order is not None else None
        if self.needs_leader_order and self.leader_order is None:
            raise ValueError(f"{type(self).__name__} needs a leader_order (groups of agents, leaders first)")
        if self.leader_order is not None:
            listed = sorted(name for group in self.leader_order for name in group)
            if listed != sorted(self.agent_names) or len(self.leader_order) < 2:
                raise ValueError(
                    f"leader_order must split the agents {list(self.agent_names)} into at least two groups, "
                    f"got {self.leader_order}"
                )
        factors = dict(lr_factors or {})
        unknown = sorted(set(factors) - set(self.agent_names))
        if unknown:
            raise ValueError(f"lr_factors names {unknown}; the agents are {list(self.agent_names)}")
        self.lr_factors = {name: float(factors.get(name, 1.0)) for name in self.agent_names}
        self.entropy_coeff = float(entropy_coeff)
        self.critic_coeff = float(critic_coeff)
        self.loss_critic_type = loss_critic_type
        self.normalize_advantage = bool(normalize_advantage)
        self.clip_epsilon = clip_epsilon
        #: Whether each epoch's minibatches should cover every episode (sizes nearly equal, about ``minibatch_size``).
        self.cover_episodes = bool(cover_episodes)
        self.truncated_episodes = bool(truncated_episodes)
        self.parameters_of = actor_parameters(actor_network, self.agent_names)
        #: ``iteration -> agents trained on it``; set by the trainer to follow its update schedule.
        self.update_schedule: Callable[[int], tuple[str, ...]] | None = None
        self.learning_agents: tuple[str, ...] = self.agent_names
        self._last_layout: dict[str, float] = {}
        self.make_value_estimator(gamma=gamma, lmbda=lmbda)

    # ------------------------------------------------------------ contract
    def make_value_estimator(self, value_type: ValueEstimators | None = None, **hyperparams) -> None:
        """Build the GAE advantage estimator that reads this loss's keys."""
        value_type = value_type or self.default_value_estimator
        if value_type != ValueEstimators.GAE:
            raise NotImplementedError(f"{type(self).__name__} supports GAE only, not {value_type}")
        hyperparams.setdefault("deactivate_vmap", True)
        self._value_estimator = GAE(value_network=self.critic_network, **hyperparams)
        self._forward_value_estimator_keys()

    def layout_rollouts(self, batch: TensorDictBase) -> TensorDictBase:
        """Whole episodes, padded (:func:`padded_episodes`): one buffer item per episode."""
        episodes = padded_episodes(batch, truncated=self.truncated_episodes)
        valid = episodes.get(VALID_KEY)
        steps = int(valid.sum())
        self._last_layout = {
            "episodes": float(episodes.batch_size[0]),
            "episode_length": steps / valid.shape[0] if valid.shape[0] else 0.0,
            "frames_laid_out": steps / batch.numel() if batch.numel() else 0.0,
        }
        return episodes

    def layout_metrics(self) -> dict[str, float]:
        """Number and mean length of the episodes laid out, and the share of the batch's frames they hold."""
        return dict(self._last_layout)

    def join_layouts(self, parts: list[TensorDictBase]) -> TensorDictBase:
        """The ranks' padded episodes as one layout (:func:`joined_episodes`)."""
        return joined_episodes(parts)

    def start_iteration(self, iteration: int) -> None:
        """Note which agents learn on this iteration (the others are not anticipated to move)."""
        if self.update_schedule is not None:
            self.learning_agents = tuple(self.update_schedule(iteration))

    # ------------------------------------------------------------- forward
    def forward(self, tensordict: TensorDictBase) -> TensorDict:
        """Compute the loss terms and statistics on a minibatch of padded episodes (attention on the math kernel)."""
        with twice_differentiable():
            return self._forward(tensordict)

    def _forward(self, tensordict: TensorDictBase) -> TensorDict:
        valid = tensordict.get(self.tensor_keys.valid)
        active = tensordict.get(self.tensor_keys.active) & valid.unsqueeze(-1)
        advantage = tensordict.get(self.tensor_keys.advantage).squeeze(-1)
        stepwise = valid.unsqueeze(-1).expand_as(advantage)
        if self.normalize_advantage:
            advantage = standardize_per_agent(advantage, stepwise)
        advantage = torch.where(stepwise, advantage, torch.zeros_like(advantage))

        scores = score_actions(self.actor_network, tensordict, with_value=True)
        difference = scores.token_log_probs - behaviour_token_log_probs(tensordict)
        log_ratio = torch.where(scores.token_mask, difference, torch.zeros_like(difference)).sum(-1)
        log_ratio = torch.where(active, log_ratio, torch.zeros_like(log_ratio))  # (E, T, N)
        step_entropy = torch.where(scores.token_mask, scores.token_entropy, torch.zeros_like(scores.token_entropy)).sum(-1)
        entropy = torch.where(active, step_entropy, torch.zeros_like(step_entropy)).sum(1).mean(0)  # (N,)

        # Each agent's own first-order surrogate: its ratio times its advantage on its active steps.
        ratio = log_ratio.exp()
        if self.clip_epsilon is None:
            own_gain = ratio * advantage
        else:
            own_gain = clipped_surrogate(ratio, advantage, self.clip_epsilon)
        own = torch.where(active, own_gain, torch.zeros_like(own_gain)).sum(1).mean(0)  # (N,)
        own_losses = -(own + self.entropy_coeff * entropy)
        with torch.no_grad():
            clipped = (ratio - 1).abs() > (self.clip_epsilon if self.clip_epsilon is not None else math.inf)
            clip_fraction = per_agent_mean(clipped.float().flatten(0, 1), active.flatten(0, 1))

        # The joint estimator (Loaded DiCE with importance weights), for the second-order terms.
        step_log_weight = log_ratio.sum(-1)  # (E, T)
        cumulative = step_log_weight.cumsum(1)
        weight_difference = cumulative.exp() - (cumulative - step_log_weight).exp()
        joint = (weight_difference.unsqueeze(-1) * advantage).sum(1).mean(0)  # (N,)
        joint_losses = -(joint + self.entropy_coeff * entropy)

        output = TensorDict(
            {
                "loss_objective": -own.sum(),
                "loss_entropy": -self.entropy_coeff * entropy.sum(),
                "entropy": entropy.detach().mean(),
                "clip_fraction": clip_fraction.mean(),
                "episodes": advantage.new_tensor(float(valid.shape[0])),
                "frames": valid.sum().to(advantage.dtype),
            }
        )
        statistics = {"loss_objective": -own.detach(), "entropy": entropy.detach(), "clip_fraction": clip_fraction}

        corrections: dict[str, Vector] = {}
        if torch.is_grad_enabled() and joint_losses.requires_grad:
            corrections, extra = self._corrections(joint_losses, own_losses, log_ratio)
            for key, value in extra.items():
                if isinstance(value, dict):
                    statistics[key] = advantage.new_tensor([value.get(name, 0.0) for name in self.agent_names])
                else:
                    output[key] = advantage.new_tensor(value)
        shaping = advantage.new_zeros(())
        norms = []
        for name in self.agent_names:
            correction = corrections.get(name)
            if correction is None:
                norms.append(advantage.new_zeros(()))
                continue
            shaping = shaping + _dot(self.parameters_of[name], [c.detach() for c in correction])
            norms.append(_flat(correction).detach().norm())
        norms = torch.stack(norms)
        output["loss_shaping"] = shaping - shaping.detach()
        output["shaping_norm"] = norms.norm()
        statistics["shaping_norm"] = norms

        # The critic on the valid steps only (a third of a minibatch's steps can be padding, which counts for nothing).
        if scores.value is not None:
            value = critic_value(self.critic_network, tensordict, scores, self.tensor_keys.value)[valid]
        else:
            steps = tensordict.select(*self.critic_network.in_keys)[valid]
            value = critic_value(self.critic_network, steps, scores, self.tensor_keys.value)
        target = tensordict.get(self.tensor_keys.value_target)[valid]
        distance = distance_loss(value, target, self.loss_critic_type).squeeze(-1)  # (valid steps, N)
        value_loss = per_agent_mean(distance, torch.ones_like(distance, dtype=torch.bool))
        output["loss_critic"] = self.critic_coeff * value_loss.sum()
        statistics["loss_critic"] = value_loss
        set_per_agent(output, self.agent_names, statistics)
        return output

    # ------------------------------------------------------ second order
    def _corrections(
        self, joint_losses: torch.Tensor, own_losses: torch.Tensor, log_ratio: torch.Tensor
    ) -> tuple[dict[str, Vector], dict[str, float | dict[str, float]]]:
        """Each learning agent's update beyond its own gradient, and statistics (a subclass's hook).

        Parameters
        ----------
        joint_losses : torch.Tensor
            ``(N,)`` the losses ``L_k`` from the joint estimator, with graphs
            through every agent's parameters.
        own_losses : torch.Tensor
            ``(N,)`` each agent's own surrogate loss (clipped in the P-forms),
            whose gradient in its own parameters is ``xi``.
        log_ratio : torch.Tensor
            ``(E, T, N)`` each agent's log-probability ratio of its actions,
            the only way the parameters reach the joint estimator: column
            ``k`` depends on agent ``k``'s parameters only (per-agent
            networks, :func:`~nip_like.objectives.learning_aware.second_order.actor_parameters`).
            A second derivative that crosses agents factors through it
            (:meth:`_vjp`, :meth:`_through`).

        Returns
        -------
        tuple
            Per agent the correction (a list of tensors shaped like its
            parameters), and statistics: a float for the whole minibatch or a
            dict of floats by agent.
        """
        raise NotImplementedError

    def _grad(self, value: torch.Tensor, agent: str, create_graph: bool = False) -> Vector:
        """``d value / d theta_agent``, zeros where it does not depend on them."""
        params = self.parameters_of[agent]
        if not value.requires_grad:
            return [torch.zeros_like(p) for p in params]
        return list(
            torch.autograd.grad(
                value, params, retain_graph=True, create_graph=create_graph, allow_unused=True, materialize_grads=True
            )
        )

    def _vjp(
        self, cotangent: torch.Tensor, log_ratio: torch.Tensor, agents, create_graph: bool = False
    ) -> dict[str, Vector]:
        """Per agent ``k`` of ``agents``: ``J_k^T cotangent[..., k]``, ``J_k`` the Jacobian of ``log_ratio[..., k]`` in its parameters.

        One backward pass through the agents' networks; ``cotangent`` may be
        a leaf that requires gradients (``create_graph``: the result is then
        linear in it, and differentiating it in the cotangent gives
        Jacobian-vector products ``J_k v``).
        """
        agents = list(agents)
        params = [p for name in agents for p in self.parameters_of[name]]
        if not params or not log_ratio.requires_grad:
            return {name: [torch.zeros_like(p) for p in self.parameters_of[name]] for name in agents}
        grads = torch.autograd.grad(
            log_ratio,
            params,
            grad_outputs=cotangent,
            retain_graph=True,
            create_graph=create_graph,
            allow_unused=True,
            materialize_grads=True,
        )
        out, start = {}, 0
        for name in agents:
            count = len(self.parameters_of[name])
            out[name] = list(grads[start : start + count])
            start += count
        return out

    @staticmethod
    def _through(value: torch.Tensor, tensor: torch.Tensor, create_graph: bool = False) -> torch.Tensor:
        """``d value / d tensor`` for an intermediate ``tensor`` of ``value``'s graph (zeros where it does not depend on it)."""
        if not value.requires_grad:
            return torch.zeros_like(tensor)
        (grad,) = torch.autograd.grad(
            value, tensor, retain_graph=True, create_graph=create_graph, allow_unused=True, materialize_grads=True
        )
        return grad

    def followers(self, agent: str) -> tuple[str, ...]:
        """The agents of the groups after ``agent``'s in :attr:`leader_order` (none without one)."""
        if self.leader_order is None:
            return ()
        for index, group in enumerate(self.leader_order):
            if agent in group:
                return tuple(name for later in self.leader_order[index + 1 :] for name in later)
        return ()

    def _trained(self) -> tuple[str, ...]:
        return tuple(name for name in self.agent_names if name in self.learning_agents and self.parameters_of[name])
