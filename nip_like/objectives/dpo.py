"""Direct preference optimisation over whole episodes (DPO, IPO, hinge).

Online and multi-agent: episodes that started on the same datapoint (a group,
see ``trainer.group_size``) are paired per agent, best return against worst,
and each agent's policy is pushed towards its chosen episode relative to a
reference policy. Nothing here needs a critic or an advantage estimate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.utils import NestedKey
from torchrl.modules import ProbabilisticActor

from nip_like import keys
from nip_like.allowed import checked
from nip_like.distributed import concatenated
from nip_like.objectives.contract import ObjectiveConfig, RolloutLoss
from nip_like.objectives.episodes import complete_episodes, lengthened
from nip_like.objectives.options import check_options
from nip_like.objectives.reference import ReferencePolicy
from nip_like.preference import LOSS_TYPES, preference_loss
from nip_like.objectives.action_scores import ActionScores, score_actions

CHOSEN, REJECTED = "chosen", "rejected"
PAIR_AGENT_KEY = "agent"
REFERENCE_LOGPS_KEY = "reference_logps"
RETURN_GAP_KEY = "return_gap"


@dataclass
class PreferenceConfig(ObjectiveConfig):
    """Options every preference objective shares: the keyword arguments of :class:`DPOLoss` but the loss type."""

    # 0.3, not TRL's 0.1: every documented preference run used 0.3, and with 0.1 DPO stalled at the local optimum
    # on hidden bits (docs/objectives/dpo.rst). DPOLoss's constructor reads it from here (it once said 0.1).
    beta: float = checked(0.3, gt=0)  # inverse temperature (sigmoid, hinge) or regularisation strength (ipo)
    margin: float = checked(0.0, ge=0)  # drop pairs whose return gap is below this (a zero gap is always dropped)
    length_normalize: bool = False  # mean log-prob per token instead of the sum over the agent's actions
    label_smoothing: float = checked(0.0, ge=0, lt=0.5)  # assumed preference-flip probability, conservative DPO (sigmoid only)
    ref_sync_every: int = checked(0, ge=0)  # move the reference towards the policy every N iterations; 0 keeps the initial policy
    ref_mixup_alpha: float = checked(1.0, gt=0, le=1)  # weight of the policy in that move: 1 copies it, below 1 is an EMA step


@dataclass
class DPOConfig(PreferenceConfig):
    """Options of the DPO objective (and its hinge and IPO losses): the keyword arguments of :class:`DPOLoss`."""

    variant_field: ClassVar[str | None] = "loss_type"

    loss_type: str = checked("sigmoid", choices=LOSS_TYPES)  # sigmoid (DPO) | ipo | hinge


@dataclass
class IPOConfig(PreferenceConfig):
    """Options of the IPO objective: DPO's pairs with the IPO loss, whose type is fixed."""

    # IPO's own defaults (TRL's): IPOLoss reads them; DPOLoss(loss_type="ipo") keeps DPO's, as trainer=dpo loss_type=ipo does.
    beta: float = checked(0.1, gt=0)  # regularisation strength: the loss pulls the log-ratio gap towards 1 / (2 beta)
    length_normalize: bool = True  # mean log-prob per token of the agent's actions, as TRL's IPO


def episode_log_probs(
    scores: ActionScores, steps: TensorDictBase, agent: torch.Tensor, length_normalize: bool
) -> torch.Tensor:
    """An agent's log-probability of its own actions over an episode.

    Parameters
    ----------
    scores : ActionScores
        The policy's scores of the actions on ``steps``, ``(pairs, time,
        num_agents, T)`` (see :func:`~nip_like.objectives.action_scores.score_actions`).
    steps : TensorDictBase
        ``(pairs, time)`` steps with active flags; padding steps are marked
        inactive for every agent.
    agent : torch.Tensor
        ``(pairs,)`` index of the agent whose actions count.
    length_normalize : bool
        Divide by the number of tokens of the agent's actions (its mean
        log-prob per token, as TRL's IPO; a categorical action is one token).

    Returns
    -------
    torch.Tensor
        ``(pairs,)``: the sum (or mean) over the agent's active steps.
    """
    log_probs, num_tokens = scores.log_prob, scores.num_tokens
    index = agent.view(-1, 1, 1).expand(-1, log_probs.shape[1], 1)
    mine = log_probs.gather(-1, index).squeeze(-1)
    active = steps.get(keys.ACTIVE_KEY).gather(-1, index).squeeze(-1)
    total = torch.where(active, mine, torch.zeros_like(mine)).sum(-1)
    if length_normalize:
        tokens = torch.where(active, num_tokens.gather(-1, index).squeeze(-1), 0).sum(-1)
        total = total / tokens.clamp_min(1).to(total.dtype)
    return total


def group_extremes(returns: torch.Tensor, groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each group, the first episode with the highest and with the lowest return.

    Parameters
    ----------
    returns : torch.Tensor
        ``(episodes,)`` returns of one agent.
    groups : torch.Tensor
        ``(episodes,)`` group ids.

    Returns
    -------
    best, worst, gap : torch.Tensor
        ``(num_groups,)`` episode indices of the best and worst episode of each
        group (the lowest index among ties) and the return gap between them.
    """
    _, inverse = groups.unique(return_inverse=True)
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    high = returns.new_full((num_groups,), -torch.inf).scatter_reduce(0, inverse, returns, "amax")
    low = returns.new_full((num_groups,), torch.inf).scatter_reduce(0, inverse, returns, "amin")
    index = torch.arange(returns.numel(), device=returns.device)
    sentinel = returns.numel()

    def first(where: torch.Tensor) -> torch.Tensor:
        candidates = torch.where(where, index, torch.full_like(index, sentinel))
        return torch.full((num_groups,), sentinel, device=returns.device).scatter_reduce(0, inverse, candidates, "amin")

    best = first(returns == high[inverse])
    worst = first(returns == low[inverse])
    return best, worst, high - low


def pad_episodes(batch: TensorDictBase, ids: torch.Tensor, episodes: torch.Tensor) -> TensorDictBase:
    """Gather whole episodes into an ``(episodes, max_length)`` TensorDict.

    Parameters
    ----------
    batch : TensorDictBase
        ``(env, time)`` steps.
    ids : torch.Tensor
        ``(env, time)`` episode ids (see :func:`~nip_like.objectives.episodes.episode_ids`).
    episodes : torch.Tensor
        ``(n,)`` ids of complete episodes to gather.

    Returns
    -------
    TensorDictBase
        Step ``j`` of each episode; positions past an episode's end repeat its
        last step with every agent marked inactive, so they count for nothing.
    """
    num_envs, num_steps = ids.shape
    flat = ids.reshape(-1)
    order = torch.arange(flat.numel(), device=ids.device)
    match = flat.unsqueeze(0) == episodes.unsqueeze(-1)
    length = match.sum(-1)
    start = torch.where(match, order, torch.full_like(order, flat.numel())).amin(-1)
    max_length = int(length.max()) if length.numel() else 0
    offset = torch.arange(max_length, device=ids.device)
    position = start.unsqueeze(-1) + torch.minimum(offset, (length - 1).unsqueeze(-1))
    steps = batch.exclude("next").reshape(-1)[position]
    padding = (offset.unsqueeze(0) >= length.unsqueeze(-1)).unsqueeze(-1)
    steps.set(keys.ACTIVE_KEY, steps.get(keys.ACTIVE_KEY) & ~padding)
    return steps


class DPOLoss(RolloutLoss):
    """Online DPO (and IPO, hinge) on preference pairs of whole episodes.

    :meth:`layout_rollouts` turns a collected batch into pairs: within each
    group of episodes that started alike, for each agent, the episode with the
    highest return is chosen and the one with the lowest is rejected; pairs
    whose return gap is below ``margin`` (or zero) are dropped and counted. An
    episode's log-probability for an agent is the sum of its log-probs over the
    steps where it acted. The reference policy's log-probs are computed there,
    without gradients; the reference is optionally moved towards the policy
    every ``ref_sync_every`` layouts (iterations) by
    ``ref <- alpha * policy + (1 - alpha) * ref``.

    The keyword options and their defaults are :class:`DPOConfig`'s (so a
    loss built directly is ``trainer=dpo``'s objective; :class:`IPOLoss` is
    ``trainer=ipo``'s), and a value outside a field's declared range is
    refused with a :class:`~nip_like.errors.ConfigError`, one line per value.

    Parameters
    ----------
    actor_network : ProbabilisticActor
        The policy (any actor :func:`~nip_like.objectives.action_scores.score_actions` scores).
    agent_names : tuple of str
        Agents, in the order of the agent dimension.
    reference : ReferencePolicy
        The reference policy (a frozen copy of the initial policy).
    beta : float
        See :func:`preference_loss`.
    loss_type : str
        ``"sigmoid"`` (DPO), ``"ipo"`` or ``"hinge"``.
    margin : float
        Pairs whose return gap is below this are dropped.
    length_normalize : bool
        Use mean rather than summed log-probs over the agent's steps (IPO's usual choice).
    label_smoothing : float
        Conservative DPO's flip probability (sigmoid only).
    ref_sync_every : int
        Move the reference towards the policy every this many layouts; 0 never.
    ref_mixup_alpha : float
        Weight of the policy in that move: 1 copies it, below 1 is an EMA step.
    """

    @dataclass
    class _AcceptedKeys:
        action: NestedKey = keys.ACTION_KEY
        action_mask: NestedKey = keys.ACTION_MASK_KEY
        active: NestedKey = keys.ACTIVE_KEY
        logits: NestedKey = keys.LOGITS_KEY

    default_keys = _AcceptedKeys
    needs_groups = True
    options_schema = DPOConfig

    #: Whether :meth:`layout_rollouts` computes the reference's log-probs
    #: (a reference-free subclass sets it to ``False``).
    uses_reference: bool = True

    def __init__(
        self,
        actor_network: ProbabilisticActor,
        agent_names: tuple[str, ...],
        reference: ReferencePolicy,
        *,
        beta: float = DPOConfig.beta,
        loss_type: str = DPOConfig.loss_type,
        margin: float = DPOConfig.margin,
        length_normalize: bool = DPOConfig.length_normalize,
        label_smoothing: float = DPOConfig.label_smoothing,
        ref_sync_every: int = DPOConfig.ref_sync_every,
        ref_mixup_alpha: float = DPOConfig.ref_mixup_alpha,
    ) -> None:
        check_options(
            self,
            DPOConfig,
            beta=beta,
            loss_type=loss_type,
            margin=margin,
            label_smoothing=label_smoothing,
            ref_sync_every=ref_sync_every,
            ref_mixup_alpha=ref_mixup_alpha,
        )
        super().__init__()
        self.actor_network = actor_network
        self.reference = reference
        self.agent_names = tuple(agent_names)
        self.beta = beta
        self.loss_type = loss_type
        self.margin = margin
        self.length_normalize = length_normalize
        self.label_smoothing = label_smoothing
        self.ref_sync_every = ref_sync_every
        self.ref_mixup_alpha = ref_mixup_alpha
        # Iterations so far: when to sync the reference; saved with the loss's state.
        self.register_buffer("num_layouts", torch.zeros((), dtype=torch.long))
        self._layout_metrics: dict[str, float] = {}

    def start_iteration(self, iteration: int) -> None:
        """Count the iteration and, every ``ref_sync_every`` of them, move the reference towards the policy."""
        self.num_layouts += 1
        if self.ref_sync_every and int(self.num_layouts) % self.ref_sync_every == 0:
            self.reference.refresh(self.actor_network, decay=1.0 - self.ref_mixup_alpha)

    def layout_metrics(self) -> dict[str, float]:
        """Pair counts (kept, dropped; in all and per agent) and the mean return gap of the last layout."""
        return self._layout_metrics

    # ------------------------------------------------------------------ layout
    def join_layouts(self, parts: list[TensorDictBase]) -> TensorDictBase:
        """The ranks' pairs as one layout: their episodes lengthened to the longest of any rank, as :func:`pad_episodes` pads."""
        filled = [part for part in parts if part.batch_size[0]]
        if len(filled) < 2:
            return concatenated(parts)
        length = max(part.get(CHOSEN).batch_size[1] for part in filled)
        joined = [part.clone(recurse=False) for part in filled]
        for part in joined:
            for side in (CHOSEN, REJECTED):
                part.set(side, lengthened(part.get(side), length, -1, (keys.ACTIVE_KEY,)))
        return concatenated(joined)

    def layout_rollouts(self, batch: TensorDictBase) -> TensorDictBase:
        """Pair the batch's complete episodes; one buffer item per (group, agent) pair.

        Returns
        -------
        TensorDictBase
            Batch ``(pairs,)`` with ``"chosen"`` and ``"rejected"`` steps
            ``(pairs, max_length)``, the pair's agent index, the reference's
            episode log-probs and the return gap.
        """
        ids, _, _, episodes, returns, groups = complete_episodes(batch)
        chosen, rejected, agents = [], [], []
        self._layout_metrics = {}
        dropped = 0.0
        for index, name in enumerate(self.agent_names):
            best, worst, gap = group_extremes(returns[..., index], groups)
            keep = (gap > 0) & (gap >= self.margin)
            chosen.append(best[keep])
            rejected.append(worst[keep])
            agents.append(torch.full((int(keep.sum()),), index, device=gap.device))
            self._layout_metrics[f"agents/{name}/pairs/kept"] = float(keep.sum())
            self._layout_metrics[f"agents/{name}/pairs/dropped"] = float((~keep).sum())
            dropped += float((~keep).sum())
        chosen, rejected, agent = torch.cat(chosen), torch.cat(rejected), torch.cat(agents)
        self._layout_metrics.update({"pairs/kept": float(agent.numel()), "pairs/dropped": dropped})
        # Both sides padded in one call, to one length, so that they stack.
        sides = pad_episodes(batch, ids, torch.cat([episodes[chosen], episodes[rejected]]))
        pairs = TensorDict(
            {
                CHOSEN: sides[: agent.numel()],
                REJECTED: sides[agent.numel() :],
                PAIR_AGENT_KEY: agent,
                RETURN_GAP_KEY: (returns[chosen] - returns[rejected]).gather(-1, agent.unsqueeze(-1)).squeeze(-1),
            },
            batch_size=[agent.numel()],
            device=batch.device,
        )
        if agent.numel():
            self._layout_metrics["pairs/return_gap"] = float(pairs.get(RETURN_GAP_KEY).float().mean())
        if agent.numel() and self.uses_reference:
            reference = self.pair_log_probs(pairs, self.reference.scores)
            pairs.set(REFERENCE_LOGPS_KEY, TensorDict(reference, batch_size=pairs.batch_size))
        return pairs

    def pair_log_probs(
        self, pairs: TensorDictBase, scores_of: Callable[[TensorDictBase], ActionScores]
    ) -> dict[str, torch.Tensor]:
        """Episode log-probs of each pair's agent, ``{"chosen": (pairs,), "rejected": (pairs,)}``.

        ``scores_of`` scores the actions of steps: :meth:`policy_scores` (with
        gradients) or the reference's ``scores`` (without).
        """
        both = torch.stack([pairs.get(CHOSEN), pairs.get(REJECTED)], dim=1)  # (pairs, 2, time)
        flat = both.reshape(-1, both.shape[-1])
        agent = pairs.get(PAIR_AGENT_KEY).repeat_interleave(2)
        log_probs = episode_log_probs(scores_of(flat), flat, agent, self.length_normalize).view(-1, 2)
        return {CHOSEN: log_probs[:, 0], REJECTED: log_probs[:, 1]}

    def policy_scores(self, steps: TensorDictBase) -> ActionScores:
        """The policy's scores of the actions on ``steps``, with gradients."""
        return score_actions(self.actor_network, steps)

    # ----------------------------------------------------------------- forward
    def forward(self, tensordict: TensorDictBase) -> TensorDict:
        """The preference loss on a minibatch of pairs, with TRL's statistics."""
        policy = self.pair_log_probs(tensordict, self.policy_scores)
        reference = tensordict.get(REFERENCE_LOGPS_KEY)
        chosen_ratio = policy[CHOSEN] - reference.get(CHOSEN)
        rejected_ratio = policy[REJECTED] - reference.get(REJECTED)
        losses = preference_loss(chosen_ratio - rejected_ratio, self.beta, self.loss_type, self.label_smoothing)
        chosen_rewards = (self.beta * chosen_ratio).detach()
        rejected_rewards = (self.beta * rejected_ratio).detach()
        return TensorDict(
            {
                "loss_objective": losses.mean(),
                "rewards/chosen": chosen_rewards.mean(),
                "rewards/rejected": rejected_rewards.mean(),
                "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
                "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
                "logps/chosen": policy[CHOSEN].detach().mean(),
                "logps/rejected": policy[REJECTED].detach().mean(),
            }
        )


class IPOLoss(DPOLoss):
    """IPO (Azar et al., 2023) on DPO's episode pairs: :class:`DPOLoss` with the IPO loss and :class:`IPOConfig`'s defaults.

    ``trainer=ipo``'s objective built directly: ``beta`` 0.1 and
    length-normalised log-probabilities, as TRL's IPO. The loss type is
    fixed; the other keyword arguments are :class:`DPOLoss`'s.

    Parameters
    ----------
    *args, **kwargs
        Those of :class:`DPOLoss`, but ``loss_type``.
    beta : float
        Regularisation strength: the loss pulls the log-ratio gap towards ``1 / (2 beta)``.
    length_normalize : bool
        Use mean rather than summed log-probs over the agent's steps.
    """

    options_schema = IPOConfig

    def __init__(
        self,
        *args,
        beta: float = IPOConfig.beta,
        length_normalize: bool = IPOConfig.length_normalize,
        **kwargs,
    ) -> None:
        super().__init__(*args, beta=beta, loss_type="ipo", length_normalize=length_normalize, **kwargs)
