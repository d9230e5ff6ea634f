"""GRPO: group-relative advantages, a clipped update, no critic."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.utils import NestedKey
from torchrl.modules import ProbabilisticActor

from nip_like import keys
from nip_like.allowed import checked
from nip_like.objectives.contract import ObjectiveConfig, RolloutLoss
from nip_like.objectives.episodes import complete_episodes, group_relative
from nip_like.objectives.masking import set_per_agent
from nip_like.objectives.options import check_options
from nip_like.objectives.ppo import clipped_surrogate, importance_ratio
from nip_like.objectives.reference import ReferencePolicy
from nip_like.objectives.action_scores import AGGREGATIONS, aggregate, sampler_weights, token_kl

#: The reference policy's log-probability of each action token, ``(*batch, agents, T)``.
REFERENCE_LOG_PROBS_KEY = ("agents", "reference_token_log_probs")


@dataclass
class GRPOConfig(ObjectiveConfig):
    """Options of the GRPO objective: the keyword arguments of :class:`GRPOLoss` after the reference."""

    clip_epsilon: float = checked(0.2, gt=0)  # clip range of the probability ratio
    kl_coeff: float = checked(0.0, ge=0)  # weight of the KL(pi || initial policy) penalty; 0 disables it
    # 0.01 (TorchRL's A2C/PPO default; TRL's GRPO has no entropy term): every documented GRPO run used it.
    # GRPOLoss's constructor reads it from here (it once said 0.0).
    entropy_coeff: float = checked(0.01, ge=0)  # weight of the entropy bonus
    loss_aggregation: str = checked("token_mean", choices=AGGREGATIONS)  # token_mean | sequence_mean over a message's tokens


class GRPOLoss(RolloutLoss):
    """Group Relative Policy Optimisation over whole episodes.

    Episodes that started on the same datapoint (one group, see
    ``trainer.group_size``) are compared: each agent's advantage for an episode
    is its return minus the group's mean return, divided by the group's sample
    standard deviation, and every active step of the episode gets it. A group
    of one, or a group whose returns do not vary, gets advantage 0. Only
    episodes that start and end inside the collected batch are used. The
    update is PPO's clipped surrogate, per agent over its active steps' tokens,
    with an optional penalty ``kl_coeff * KL(pi || pi_ref)`` to a reference
    policy, estimated per token on the sampled tokens
    (:func:`~nip_like.objectives.action_scores.token_kl`, TRL's estimator).

    The keyword options and their defaults are :class:`GRPOConfig`'s; a
    value outside a field's declared range is refused with a
    :class:`~nip_like.errors.ConfigError`.

    Parameters
    ----------
    actor_network : ProbabilisticActor
        The policy.
    agent_names : tuple of str
        Agents, for per-agent statistics.
    reference : ReferencePolicy, optional
        The reference of the KL penalty (needed when ``kl_coeff > 0``).
    clip_epsilon : float
        Clip range of the probability ratio.
    kl_coeff : float
        Weight of the KL penalty; 0 disables it.
    entropy_coeff : float
        Weight of the entropy bonus.
    loss_aggregation : str
        ``"token_mean"`` or ``"sequence_mean"``: how token-level terms are
        averaged (:func:`~nip_like.objectives.action_scores.aggregate`).
    """

    @dataclass
    class _AcceptedKeys:
        advantage: NestedKey = keys.ADVANTAGE_KEY
        action: NestedKey = keys.ACTION_KEY
        sample_log_prob: NestedKey = keys.LOG_PROB_KEY
        action_mask: NestedKey = keys.ACTION_MASK_KEY
        active: NestedKey = keys.ACTIVE_KEY

    default_keys = _AcceptedKeys
    needs_groups = True
    metric_names: ClassVar = {"kl_reference": "policy/kl_reference"}
    options_schema = GRPOConfig

    def __init__(
        self,
        actor_network: ProbabilisticActor,
        agent_names: tuple[str, ...],
        reference: ReferencePolicy | None = None,
        *,
        clip_epsilon: float = GRPOConfig.clip_epsilon,
        kl_coeff: float = GRPOConfig.kl_coeff,
        entropy_coeff: float = GRPOConfig.entropy_coeff,
        loss_aggregation: str = GRPOConfig.loss_aggregation,
    ) -> None:
        check_options(
            self,
            GRPOConfig,
            clip_epsilon=clip_epsilon,
            kl_coeff=kl_coeff,
            entropy_coeff=entropy_coeff,
            loss_aggregation=loss_aggregation,
        )
        if kl_coeff > 0 and reference is None:
            raise ValueError("GRPOLoss needs a reference policy when kl_coeff > 0")
        super().__init__()
        self.actor_network = actor_network
        self.reference = reference
        self.agent_names = tuple(agent_names)
        self.clip_epsilon = clip_epsilon
        self.kl_coeff = kl_coeff
        self.entropy_coeff = entropy_coeff
        self.loss_aggregation = loss_aggregation

    def layout_rollouts(self, batch: TensorDictBase) -> TensorDictBase:
        """Return the steps of complete episodes, each with its group-relative advantage."""
        found = complete_episodes(batch)
        advantage = group_relative(found.returns, found.groups)
        episode_order, order = found.episodes.sort()
        steps = batch[found.complete]
        episode = order[torch.searchsorted(episode_order, found.ids[found.complete])]
        steps.set(self.tensor_keys.advantage, advantage[episode].unsqueeze(-1))
        if self.kl_coeff > 0:
            steps.set(REFERENCE_LOG_PROBS_KEY, self.reference.scores(steps).token_log_probs)
        return steps

    def forward(self, tensordict: TensorDictBase) -> TensorDict:
        """Compute the clipped surrogate, entropy bonus and KL penalty on a minibatch of steps."""
        active = tensordict.get(self.tensor_keys.active)
        advantage = tensordict.get(self.tensor_keys.advantage).squeeze(-1)
        scores, ratio, log_ratio = importance_ratio(self.actor_network, tensordict, self.tensor_keys, active)
        mask, mode = scores.token_mask, self.loss_aggregation
        surrogate = clipped_surrogate(ratio, advantage.unsqueeze(-1), self.clip_epsilon)
        weights = sampler_weights(tensordict, surrogate)
        if weights is not None:
            surrogate = surrogate * weights
        policy_loss = -aggregate(surrogate, mask, active, mode)
        entropy = aggregate(scores.token_entropy, mask, active, mode)
        with torch.no_grad():
            kl_approx = aggregate((ratio - 1) - log_ratio, mask, active, mode)
            clip_fraction = aggregate(((ratio - 1).abs() > self.clip_epsilon).float(), mask, active, mode)
        output = TensorDict(
            {
                "loss_objective": policy_loss.sum(),
                "loss_entropy": -self.entropy_coeff * entropy.sum(),
                "entropy": entropy.detach().mean(),
                "kl_approx": kl_approx.mean(),
                "clip_fraction": clip_fraction.mean(),
            }
        )
        per_agent = {"loss_objective": policy_loss, "entropy": entropy}
        if self.kl_coeff > 0:
            kl_tokens = token_kl(scores.token_log_probs, tensordict.get(REFERENCE_LOG_PROBS_KEY))
            kl = aggregate(kl_tokens, mask, active, mode)
            output["loss_kl"] = self.kl_coeff * kl.sum()
            output["kl_reference"] = kl.detach().mean()
            per_agent["kl_reference"] = kl
        set_per_agent(output, self.agent_names, per_agent)
        return output
