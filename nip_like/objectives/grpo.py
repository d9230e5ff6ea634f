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
from nip_like.objectives.masking import per_agent_mean, set_per_agent
from nip_like.objectives.ppo import clipped_surrogate, importance_ratio
from nip_like.objectives.reference import ReferencePolicy, categorical_kl

REFERENCE_LOGITS_KEY = ("agents", "reference_logits")


@dataclass
class GRPOConfig(ObjectiveConfig):
    """Options of the GRPO objective: the keyword arguments of :class:`GRPOLoss` after the reference."""

    clip_epsilon: float = checked(0.2, gt=0)  # clip range of the probability ratio
    kl_coeff: float = checked(0.0, ge=0)  # weight of the KL(pi || initial policy) penalty; 0 disables it
    entropy_coeff: float = checked(0.01, ge=0)  # weight of the entropy bonus


class GRPOLoss(RolloutLoss):
    """Group Relative Policy Optimisation over whole episodes.

    Episodes that started on the same datapoint (one group, see
    ``trainer.group_size``) are compared: each agent's advantage for an episode
    is its return minus the group's mean return, divided by the group's sample
    standard deviation, and every active step of the episode gets it. A group
    of one, or a group whose returns do not vary, gets advantage 0. Only
    episodes that start and end inside the collected batch are used. The
    update is PPO's clipped surrogate, per agent over its active steps, with an
    optional penalty ``kl_coeff * KL(pi || pi_ref)`` to a reference policy.

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

    def __init__(
        self,
        actor_network: ProbabilisticActor,
        agent_names: tuple[str, ...],
        reference: ReferencePolicy | None = None,
        *,
        clip_epsilon: float = 0.2,
        kl_coeff: float = 0.0,
        entropy_coeff: float = 0.0,
    ) -> None:
        if kl_coeff > 0 and reference is None:
            raise ValueError("GRPOLoss needs a reference policy when kl_coeff > 0")
        super().__init__()
        self.actor_network = actor_network
        self.reference = reference
        self.agent_names = tuple(agent_names)
        self.clip_epsilon = clip_epsilon
        self.kl_coeff = kl_coeff
        self.entropy_coeff = entropy_coeff

    def layout_rollouts(self, batch: TensorDictBase) -> TensorDictBase:
        """Return the steps of complete episodes, each with its group-relative advantage."""
        found = complete_episodes(batch)
        advantage = group_relative(found.returns, found.groups)
        episode_order, order = found.episodes.sort()
        steps = batch[found.complete]
        episode = order[torch.searchsorted(episode_order, found.ids[found.complete])]
        steps.set(self.tensor_keys.advantage, advantage[episode].unsqueeze(-1))
        if self.kl_coeff > 0:
            steps.set(REFERENCE_LOGITS_KEY, self.reference.logits(steps))
        return steps

    def forward(self, tensordict: TensorDictBase) -> TensorDict:
        """Compute the clipped surrogate, entropy bonus and KL penalty on a minibatch of steps."""
        active = tensordict.get(self.tensor_keys.active)
        advantage = tensordict.get(self.tensor_keys.advantage).squeeze(-1)
        dist, ratio, kl_approx, clip_fraction = importance_ratio(
            self.actor_network, tensordict, self.tensor_keys, active, self.clip_epsilon
        )
        policy_loss = -per_agent_mean(clipped_surrogate(ratio, advantage, self.clip_epsilon), active)
        entropy = per_agent_mean(dist.entropy(), active)
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
            mask = tensordict.get(self.tensor_keys.action_mask)
            kl = per_agent_mean(categorical_kl(dist.logits, tensordict.get(REFERENCE_LOGITS_KEY), mask), active)
            output["loss_kl"] = self.kl_coeff * kl.sum()
            output["kl_reference"] = kl.detach().mean()
            per_agent["kl_reference"] = kl
        set_per_agent(output, self.agent_names, per_agent)
        return output
