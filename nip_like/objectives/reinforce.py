"""REINFORCE: Monte-Carlo returns of complete episodes, with an optional learned baseline."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModule
from tensordict.utils import NestedKey
from torchrl.modules import ProbabilisticActor

from nip_like import keys
from nip_like.allowed import checked
from nip_like.objectives.contract import ObjectiveConfig, RolloutLoss
from nip_like.objectives.episodes import episode_ids
from nip_like.objectives.masking import per_agent_mean, set_per_agent, standardize_per_agent
from nip_like.objectives.options import check_options
from nip_like.objectives.action_scores import critic_value, sampler_weights, score_actions

RETURN_KEY = ("agents", "return")


def returns_to_go(reward: torch.Tensor, done: torch.Tensor, gamma: float) -> torch.Tensor:
    """Discounted returns from each step to the end of its episode.

    Parameters
    ----------
    reward : torch.Tensor
        ``(env, time, ...)`` rewards.
    done : torch.Tensor
        ``(env, time)`` booleans: the episode ends after this step.
    gamma : float
        Discount factor.

    Returns
    -------
    torch.Tensor
        Same shape as ``reward``. Steps of an episode cut off by the end of the
        batch get the return of the part inside it.
    """
    carry = done.reshape(*done.shape, *([1] * (reward.ndim - done.ndim)))
    returns = torch.zeros_like(reward)
    following = torch.zeros_like(reward[:, 0])
    for step in range(reward.shape[1] - 1, -1, -1):
        following = reward[:, step] + gamma * following * (~carry[:, step])
        returns[:, step] = following
    return returns


@dataclass
class ReinforceConfig(ObjectiveConfig):
    """Options of the REINFORCE objective: the keyword arguments of :class:`MultiAgentReinforceLoss`."""

    baseline: bool = True  # subtract a learned value baseline (the agents' value networks)
    gamma: float = checked(0.99, ge=0, le=1)  # discount factor of the returns
    # 0.01 (TorchRL's A2C default; its ReinforceLoss has no entropy term): every documented REINFORCE run used it.
    # MultiAgentReinforceLoss's constructor reads it from here (it once said 0.0).
    entropy_coeff: float = checked(0.01, ge=0)  # weight of the entropy bonus
    critic_coeff: float = checked(0.5, ge=0)  # weight of the baseline's regression loss
    normalize_advantage: bool = True  # standardise advantages per agent over its active steps


class MultiAgentReinforceLoss(RolloutLoss):
    """REINFORCE per agent over its active steps, with an optional value baseline.

    An action's log-probability is the sum over its tokens (one for a
    categorical action, a message's for a language-model agent). The
    advantage of a step is its discounted return-to-go, minus the critic's
    value when a critic is given (the critic then learns the returns by
    regression over every step). Only episodes that start and end inside the
    collected batch are used, so every return is a true Monte-Carlo return.
    The keyword options and their defaults are :class:`ReinforceConfig`'s;
    a value outside a field's declared range is refused with a
    :class:`~nip_like.errors.ConfigError`.

    Parameters
    ----------
    actor_network : ProbabilisticActor
        The policy.
    critic_network : TensorDictModule, optional
        The value network, the baseline when ``baseline`` is true.
    agent_names : tuple of str
        Agents, for per-agent statistics.
    baseline : bool
        Subtract the critic's value from the returns (and train it); false, or
        no critic, gives plain REINFORCE.
    gamma : float
        Discount factor.
    entropy_coeff, critic_coeff : float
        Weights of the entropy bonus and of the baseline's regression loss.
    normalize_advantage : bool
        Standardise advantages per agent over its active steps.
    """

    @dataclass
    class _AcceptedKeys:
        action: NestedKey = keys.ACTION_KEY
        value: NestedKey = keys.VALUE_KEY
        active: NestedKey = keys.ACTIVE_KEY
        returns: NestedKey = RETURN_KEY
        reward: NestedKey = keys.REWARD_KEY

    default_keys = _AcceptedKeys
    options_schema = ReinforceConfig

    def __init__(
        self,
        actor_network: ProbabilisticActor,
        critic_network: TensorDictModule | None,
        agent_names: tuple[str, ...],
        *,
        baseline: bool = ReinforceConfig.baseline,
        gamma: float = ReinforceConfig.gamma,
        entropy_coeff: float = ReinforceConfig.entropy_coeff,
        critic_coeff: float = ReinforceConfig.critic_coeff,
        normalize_advantage: bool = ReinforceConfig.normalize_advantage,
    ) -> None:
        check_options(self, ReinforceConfig, gamma=gamma, entropy_coeff=entropy_coeff, critic_coeff=critic_coeff)
        super().__init__()
        self.actor_network = actor_network
        self.critic_network = critic_network if baseline else None
        self.agent_names = tuple(agent_names)
        self.gamma = gamma
        self.entropy_coeff = entropy_coeff
        self.critic_coeff = critic_coeff
        self.normalize_advantage = normalize_advantage

    def layout_rollouts(self, batch: TensorDictBase) -> TensorDictBase:
        """Return the steps of complete episodes with their returns-to-go."""
        _, complete = episode_ids(batch)
        reward = batch.get(("next", *self.tensor_keys.reward))
        returns = returns_to_go(reward, batch.get(("next", "done")).squeeze(-1), self.gamma)
        steps = batch[complete]
        steps.set(self.tensor_keys.returns, returns[complete])
        return steps

    def forward(self, tensordict: TensorDictBase) -> TensorDict:
        """Compute the policy-gradient, entropy and baseline terms on a minibatch of steps."""
        active = tensordict.get(self.tensor_keys.active)
        returns = tensordict.get(self.tensor_keys.returns).squeeze(-1)
        output = TensorDict()
        advantage = returns
        scores = score_actions(self.actor_network, tensordict, with_value=self.critic_network is not None)
        if self.critic_network is not None:
            value = critic_value(self.critic_network, tensordict, scores, self.tensor_keys.value).squeeze(-1)
            value_loss = per_agent_mean((value - returns) ** 2)
            output["loss_critic"] = self.critic_coeff * value_loss.sum()
            advantage = returns - value.detach()
        if self.normalize_advantage:
            advantage = standardize_per_agent(advantage, active)
        message_log_prob = scores.log_prob
        weights = sampler_weights(tensordict, scores.token_log_probs)
        if weights is not None:
            message_log_prob = torch.where(scores.token_mask, scores.token_log_probs * weights, 0.0).sum(-1)
        log_prob = torch.where(active, message_log_prob, torch.zeros_like(message_log_prob))
        policy_loss = -per_agent_mean(log_prob * advantage, active)
        # A message's entropy: the sum of its tokens' entropies (one term for a categorical action).
        message_entropy = torch.where(scores.token_mask, scores.token_entropy, 0.0).sum(-1)
        entropy = per_agent_mean(message_entropy, active)
        output["loss_objective"] = policy_loss.sum()
        output["loss_entropy"] = -self.entropy_coeff * entropy.sum()
        output["entropy"] = entropy.detach().mean()
        set_per_agent(output, self.agent_names, {"loss_objective": policy_loss, "entropy": entropy})
        return output
