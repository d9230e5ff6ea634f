"""Multi-agent PPO with inactive agents masked out of the learning signal."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModule
from tensordict.utils import NestedKey
from torchrl.modules import ProbabilisticActor
from torchrl.objectives import ValueEstimators
from torchrl.objectives.utils import distance_loss
from torchrl.objectives.value import GAE

from nip_like import keys
from nip_like.allowed import checked
from nip_like.objectives.contract import ObjectiveConfig, RolloutLoss
from nip_like.objectives.masking import per_agent_mean, set_per_agent, standardize_per_agent
from nip_like.objectives.options import check_options
from nip_like.objectives.reference import categorical_kl
from nip_like.objectives.action_scores import (
    AGGREGATIONS,
    ActionScores,
    critic_value,
    aggregate,
    behaviour_token_log_probs,
    sampler_weights,
    score_actions,
    token_kl,
)

PPO_VARIANTS = ("clip", "kl")
#: Distances the value loss can use.
CRITIC_LOSS_TYPES = ("l1", "l2", "smooth_l1")


@dataclass
class PPOConfig(ObjectiveConfig):
    """Options of the PPO objective: the keyword arguments of :class:`MultiAgentPPOLoss`."""

    variant_field: ClassVar[str | None] = "variant"

    variant: str = checked("clip", choices=PPO_VARIANTS)  # clip (clipped surrogate) | kl (adaptive KL penalty)
    clip_epsilon: float = checked(0.2, gt=0)  # clip range of the probability ratio (clip variant)
    kl_beta: float = checked(1.0, ge=0)  # initial KL-penalty coefficient (kl variant)
    kl_target: float = checked(0.01, gt=0)  # target KL per update; beta adapts towards it (kl variant)
    kl_adaptive: bool = True  # adapt beta after each minibatch (kl variant)
    entropy_coeff: float = checked(0.01, ge=0)  # weight of the entropy bonus
    critic_coeff: float = checked(0.5, ge=0)  # weight of the value loss
    normalize_advantage: bool = True  # standardise advantages per agent over its active steps
    loss_critic_type: str = checked("smooth_l1", choices=CRITIC_LOSS_TYPES)  # l1 | l2 | smooth_l1
    gamma: float = checked(0.99, ge=0, le=1)  # discount factor of GAE
    lmbda: float = checked(0.95, ge=0, le=1)  # GAE lambda
    loss_aggregation: str = checked("token_mean", choices=AGGREGATIONS)  # token_mean | sequence_mean over a message's tokens


class MultiAgentPPOLoss(RolloutLoss):
    """PPO over the stacked ``("agents", ...)`` layout, one term per agent.

    Policy and entropy terms average, for each agent, over the steps where it
    was active (``("agents", "active")``); an inactive agent's action enters no
    log-probability, ratio, entropy or loss. The value loss averages over every
    step: a state's value does not depend on who acts in it. Each total loss is
    the sum of the agents' terms, so that one agent's share of the batch does not
    scale another's gradient. The keyword options and their defaults are
    :class:`PPOConfig`'s; a value outside a field's declared range is refused
    with a :class:`~nip_like.errors.ConfigError`.

    Parameters
    ----------
    actor_network : ProbabilisticActor
        The policy; must write ``("agents", "logits")``.
    critic_network : TensorDictModule
        The value network; writes ``("agents", "state_value")``.
    agent_names : tuple of str
        Names of the agents, for per-agent statistics.
    variant : str
        ``"clip"`` (clipped surrogate) or ``"kl"`` (KL penalty to the behaviour
        policy, with a coefficient that adapts towards ``kl_target``).
    clip_epsilon : float
        Clip range of the ratio (clip variant).
    kl_beta, kl_target : float
        Initial penalty coefficient and target KL (kl variant).
    kl_adaptive : bool
        Double or halve ``kl_beta`` when the KL leaves ``[target/1.5, 1.5 target]``.
    entropy_coeff, critic_coeff : float
        Weights of the entropy bonus and the value loss.
    normalize_advantage : bool
        Standardise advantages per agent over its active steps.
    loss_critic_type : str
        ``"l1"``, ``"l2"`` or ``"smooth_l1"``.
    gamma, lmbda : float
        Discount and lambda of the GAE advantage module built with the loss
        (:attr:`value_estimator`; :meth:`make_value_estimator` rebuilds it).
    loss_aggregation : str
        For actions that are token sequences: the ratio, surrogate, entropy
        and statistics are per token, averaged ``"token_mean"`` (over all of
        an agent's tokens) or ``"sequence_mean"`` (per message, then over
        messages); see :func:`~nip_like.objectives.action_scores.aggregate`. A
        categorical action is one token, and both give the same loss.

    Notes
    -----
    The output holds ``loss_objective``, ``loss_critic`` and ``loss_entropy``
    (sum them to train), the statistics ``entropy``, ``kl_approx``,
    ``clip_fraction``, ``explained_variance`` and ``kl_beta``, and the same per
    agent under ``("agents", <name>, <statistic>)``.
    """

    @dataclass
    class _AcceptedKeys:
        advantage: NestedKey = keys.ADVANTAGE_KEY
        value_target: NestedKey = keys.VALUE_TARGET_KEY
        value: NestedKey = keys.VALUE_KEY
        action: NestedKey = keys.ACTION_KEY
        sample_log_prob: NestedKey = keys.LOG_PROB_KEY
        logits: NestedKey = keys.LOGITS_KEY
        action_mask: NestedKey = keys.ACTION_MASK_KEY
        active: NestedKey = keys.ACTIVE_KEY
        reward: NestedKey = keys.REWARD_KEY
        done: NestedKey = keys.DONE_KEY
        terminated: NestedKey = keys.TERMINATED_KEY

    default_keys = _AcceptedKeys
    default_value_estimator = ValueEstimators.GAE
    options_schema = PPOConfig

    def __init__(
        self,
        actor_network: ProbabilisticActor,
        critic_network: TensorDictModule,
        agent_names: tuple[str, ...],
        *,
        variant: str = PPOConfig.variant,
        clip_epsilon: float = PPOConfig.clip_epsilon,
        kl_beta: float = PPOConfig.kl_beta,
        kl_target: float = PPOConfig.kl_target,
        kl_adaptive: bool = PPOConfig.kl_adaptive,
        entropy_coeff: float = PPOConfig.entropy_coeff,
        critic_coeff: float = PPOConfig.critic_coeff,
        normalize_advantage: bool = PPOConfig.normalize_advantage,
        loss_critic_type: str = PPOConfig.loss_critic_type,
        gamma: float = PPOConfig.gamma,
        lmbda: float = PPOConfig.lmbda,
        loss_aggregation: str = PPOConfig.loss_aggregation,
    ) -> None:
        check_options(
            self,
            PPOConfig,
            variant=variant,
            clip_epsilon=clip_epsilon,
            kl_beta=kl_beta,
            kl_target=kl_target,
            entropy_coeff=entropy_coeff,
            critic_coeff=critic_coeff,
            loss_critic_type=loss_critic_type,
            gamma=gamma,
            lmbda=lmbda,
            loss_aggregation=loss_aggregation,
        )
        super().__init__()
        self.actor_network = actor_network
        self.critic_network = critic_network
        self.agent_names = tuple(agent_names)
        self.variant = variant
        self.clip_epsilon = clip_epsilon
        self.kl_target = kl_target
        self.kl_adaptive = kl_adaptive
        self.entropy_coeff = entropy_coeff
        self.critic_coeff = critic_coeff
        self.normalize_advantage = normalize_advantage
        self.loss_critic_type = loss_critic_type
        self.loss_aggregation = loss_aggregation
        self.register_buffer("kl_beta", torch.tensor(float(kl_beta)))
        self.make_value_estimator(gamma=gamma, lmbda=lmbda)

    def make_value_estimator(self, value_type: ValueEstimators | None = None, **hyperparams) -> None:
        """Build the advantage estimator (GAE only) that reads this loss's keys."""
        value_type = value_type or self.default_value_estimator
        if value_type != ValueEstimators.GAE:
            raise NotImplementedError(f"MultiAgentPPOLoss supports GAE only, not {value_type}")
        # Two plain calls (observation, next observation) instead of torch.vmap:
        # vmap has no batching rule for attention on the CPU and falls back to a slow path.
        hyperparams.setdefault("deactivate_vmap", True)
        self._value_estimator = GAE(value_network=self.critic_network, **hyperparams)
        self._forward_value_estimator_keys()

    def forward(self, tensordict: TensorDictBase) -> TensorDict:
        """Compute the loss terms and statistics on a batch of transitions."""
        active = tensordict.get(self.tensor_keys.active)
        advantage = tensordict.get(self.tensor_keys.advantage).squeeze(-1)
        if self.normalize_advantage:
            advantage = standardize_per_agent(advantage, active)

        scores, ratio, log_ratio = importance_ratio(
            self.actor_network, tensordict, self.tensor_keys, active, with_value=True
        )
        mask, mode = scores.token_mask, self.loss_aggregation
        token_advantage = advantage.unsqueeze(-1)
        if self.variant == "clip":
            surrogate = clipped_surrogate(ratio, token_advantage, self.clip_epsilon)
        else:
            kl = self._kl_to_behaviour(tensordict, scores, log_ratio)
            # A copy: the coefficient adapts in place below, after the graph uses it.
            surrogate = ratio * token_advantage - self.kl_beta.clone() * kl
        weights = sampler_weights(tensordict, surrogate)
        if weights is not None:
            surrogate = surrogate * weights
        policy_loss = -aggregate(surrogate, mask, active, mode)
        entropy = aggregate(scores.token_entropy, mask, active, mode)
        with torch.no_grad():
            kl_approx = aggregate((ratio - 1) - log_ratio, mask, active, mode)
            clip_fraction = aggregate(((ratio - 1).abs() > self.clip_epsilon).float(), mask, active, mode)

        value = critic_value(self.critic_network, tensordict, scores, self.tensor_keys.value)
        target = tensordict.get(self.tensor_keys.value_target)
        value_loss = distance_loss(value, target, self.loss_critic_type).squeeze(-1)
        value_loss = per_agent_mean(value_loss)
        explained_variance = _explained_variance(value.detach(), target)

        if self.variant == "kl" and self.kl_adaptive and self.training:
            self._adapt_kl_beta(kl_approx.mean().item())

        output = TensorDict(
            {
                "loss_objective": policy_loss.sum(),
                "loss_critic": self.critic_coeff * value_loss.sum(),
                "loss_entropy": -self.entropy_coeff * entropy.sum(),
                "entropy": entropy.detach().mean(),
                "kl_approx": kl_approx.mean(),
                "clip_fraction": clip_fraction.mean(),
                "explained_variance": explained_variance,
                "kl_beta": self.kl_beta.clone(),
            }
        )
        set_per_agent(
            output,
            self.agent_names,
            {
                "loss_objective": policy_loss,
                "loss_critic": value_loss,
                "entropy": entropy,
                "kl_approx": kl_approx,
                "clip_fraction": clip_fraction,
            },
        )
        return output

    def _kl_to_behaviour(self, tensordict: TensorDictBase, scores: ActionScores, log_ratio: torch.Tensor) -> torch.Tensor:
        """``(*batch, agents, T)`` KL(behaviour || current) of the kl variant's penalty.

        Exact for categorical actions (the behaviour logits are stored); for
        token sequences the per-token estimate on the sampled tokens
        (:func:`~nip_like.objectives.action_scores.token_kl` with the roles of the
        two policies as sampled: the tokens come from the behaviour policy).
        """
        old_logits = tensordict.get(self.tensor_keys.logits, None)
        if scores.logits is not None and old_logits is not None:
            action_mask = tensordict.get(self.tensor_keys.action_mask)
            return categorical_kl(old_logits, scores.logits, action_mask).unsqueeze(-1)
        # The behaviour policy is the sampler: its log-ratio to itself is 0.
        return token_kl(torch.zeros_like(log_ratio), log_ratio)

    def _adapt_kl_beta(self, kl: float) -> None:
        if kl > 1.5 * self.kl_target:
            self.kl_beta.mul_(2.0)
        elif kl < self.kl_target / 1.5:
            self.kl_beta.div_(2.0)


def importance_ratio(
    actor, tensordict: TensorDictBase, tensor_keys, active: torch.Tensor, with_value: bool = False
) -> tuple[ActionScores, torch.Tensor, torch.Tensor]:
    """Score the stored actions under the current policy against their behaviour log-probs, per token.

    Parameters
    ----------
    actor
        The current policy (see :func:`~nip_like.objectives.action_scores.score_actions`).
    tensordict : TensorDictBase
        Steps with the actions and their log-probs at collection
        (``("agents", "token_log_probs")`` for token sequences, else
        ``tensor_keys.sample_log_prob``).
    tensor_keys
        The loss's keys.
    active : torch.Tensor
        ``(*batch, num_agents)``: who acted.
    with_value : bool
        Ask the actor for the values too (see :func:`~nip_like.objectives.action_scores.critic_value`).

    Returns
    -------
    tuple
        The scores, the ratio ``pi / pi_old`` and its log, both ``(*batch,
        num_agents, T)``. Entries outside the active steps' tokens get ratio 1:
        they are replaced, not multiplied, so they cannot turn into NaN.
    """
    scores = score_actions(actor, tensordict, with_value=with_value)
    counted = scores.token_mask & active.unsqueeze(-1)
    difference = scores.token_log_probs - behaviour_token_log_probs(tensordict)
    log_ratio = torch.where(counted, difference, torch.zeros_like(difference))
    return scores, log_ratio.exp(), log_ratio


def clipped_surrogate(ratio: torch.Tensor, advantage: torch.Tensor, clip_epsilon: float) -> torch.Tensor:
    """PPO's pessimistic surrogate ``min(r A, clip(r, 1 - eps, 1 + eps) A)``, elementwise."""
    clipped = ratio.clamp(1 - clip_epsilon, 1 + clip_epsilon)
    return torch.minimum(ratio * advantage, clipped * advantage)


def _explained_variance(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    variance = target.var()
    if variance.item() == 0:
        return torch.zeros((), dtype=target.dtype, device=target.device)
    return 1 - (target - prediction).var() / variance
