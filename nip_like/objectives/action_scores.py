"""Log-probabilities of stored actions, the same way for one-choice actions and token sequences.

Every objective needs the current policy's log-probability of the actions in a
batch. An action is one categorical choice (graph and hidden-bits agents) or a
message of ``T`` tokens (language-model agents); :func:`score_actions` returns
both kinds in one token layout, ``(*batch, agents, T)`` with a token mask,
where a categorical action is a message of one token. Losses aggregate over
tokens with :func:`aggregate` (TRL's ``token_mean`` or ``sequence_mean``) and
never ask which kind of agent they train.

An actor that samples token sequences provides ``score_actions(tensordict)``
itself (:class:`~nip_like.lm.actor_critic.LMActor`); any TorchRL probabilistic actor
is scored through its distribution.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Optional

import torch
from tensordict import TensorDictBase

from nip_like import keys
from nip_like.objectives.masking import per_agent_mean

#: How token-level terms are averaged (TRL's names): over all tokens of an agent
#: in the batch, or over each message's tokens first and then over messages.
AGGREGATIONS = ("token_mean", "sequence_mean")


@dataclass
class ActionScores:
    """The current policy's view of a batch's actions, token by token.

    Attributes
    ----------
    token_log_probs : torch.Tensor
        ``(*batch, agents, T)`` log-probability of each action token, with
        gradients; 0 outside the mask.
    token_mask : torch.Tensor
        ``(*batch, agents, T)`` bool: the action's real tokens.
    token_entropy : torch.Tensor
        ``(*batch, agents, T)`` entropy of the distribution of each token
        (given the tokens before it), with gradients; 0 outside the mask.
    logits : torch.Tensor, optional
        ``(*batch, agents, A)`` for categorical actions (exact KL terms use it).
    value : torch.Tensor, optional
        ``(*batch, agents)`` each agent's value of the step, with gradients,
        when the actor computes it in the scoring pass (language-model agents
        asked ``with_value``); None: the loss asks its critic.
    """

    token_log_probs: torch.Tensor
    token_mask: torch.Tensor
    token_entropy: torch.Tensor
    logits: Optional[torch.Tensor] = None
    value: Optional[torch.Tensor] = None

    @property
    def log_prob(self) -> torch.Tensor:
        """``(*batch, agents)``: the action's log-probability (sum over its tokens)."""
        return torch.where(self.token_mask, self.token_log_probs, 0.0).sum(-1)

    @property
    def num_tokens(self) -> torch.Tensor:
        """``(*batch, agents)``: tokens in each action (1 for a categorical choice)."""
        return self.token_mask.sum(-1)


def score_actions(actor, tensordict: TensorDictBase, with_value: bool = False) -> ActionScores:
    """Score the actions stored in ``tensordict`` (``("agents", "action")``) under ``actor``.

    Parameters
    ----------
    actor
        An actor with a ``score_actions(tensordict)`` method, or a TorchRL
        probabilistic actor (``get_dist``) whose distribution writes
        ``("agents", "logits")`` when it is categorical.
    tensordict : TensorDictBase
        Steps holding the actor's inputs and the actions.
    with_value : bool
        Also read each agent's value of the step from the scoring pass, where
        the actor can (its ``score_actions`` takes ``with_value``); the
        scores' ``value`` is None otherwise, and the loss asks its critic.
    """
    scorer = getattr(actor, "score_actions", None)
    if scorer is not None:
        if with_value and "with_value" in inspect.signature(scorer).parameters:
            return scorer(tensordict, with_value=True)
        return scorer(tensordict)
    dist = actor.get_dist(tensordict.clone(False))
    log_prob = dist.log_prob(tensordict.get(keys.ACTION_KEY)).unsqueeze(-1)
    return ActionScores(
        token_log_probs=log_prob,
        token_mask=torch.ones_like(log_prob, dtype=torch.bool),
        token_entropy=dist.entropy().unsqueeze(-1),
        logits=getattr(dist, "logits", None),
    )


def critic_value(critic, tensordict: TensorDictBase, scores: ActionScores, value_key) -> torch.Tensor:
    """``(*batch, agents, 1)`` values with gradients: read from the scoring pass where the actor gave them, else the critic's.

    Parameters
    ----------
    critic
        The loss's critic (a TensorDict module writing ``value_key``).
    tensordict : TensorDictBase
        The minibatch.
    scores : ActionScores
        The actor's scores of it (:func:`score_actions` with ``with_value``).
    value_key
        Where the critic writes its value.
    """
    if scores.value is not None:
        return scores.value.unsqueeze(-1)
    return critic(tensordict.select(*critic.in_keys).clone(False)).get(value_key)


def behaviour_token_log_probs(tensordict: TensorDictBase) -> torch.Tensor:
    """``(*batch, agents, T)``: the stored actions' token log-probabilities at collection."""
    stored = tensordict.get(keys.TOKEN_LOG_PROBS_KEY, None)
    return stored if stored is not None else tensordict.get(keys.LOG_PROB_KEY).unsqueeze(-1)


def sampler_weights(tensordict: TensorDictBase, like: torch.Tensor) -> torch.Tensor | None:
    """``(*batch, agents, T)`` truncated importance weights of tokens sampled by an inference server, None without any.

    Stored at collection as ``("agents", "sampler_weight")`` (see
    :mod:`nip_like.lm.server`); the losses multiply each token's term by it.
    Broadcast to ``like``'s shape (a categorical action's ``T`` is 1).
    """
    weights = tensordict.get(keys.SAMPLER_WEIGHT_KEY, None)
    return None if weights is None else weights.to(like.dtype).expand_as(like)


def aggregate(values: torch.Tensor, token_mask: torch.Tensor, active: torch.Tensor, mode: str) -> torch.Tensor:
    """Average token-level ``values`` per agent over the active steps' real tokens.

    Parameters
    ----------
    values : torch.Tensor
        ``(*batch, agents, T)``.
    token_mask : torch.Tensor
        ``(*batch, agents, T)`` bool.
    active : torch.Tensor
        ``(*batch, agents)`` bool: who acted.
    mode : str
        ``"token_mean"``: the sum over all counted tokens of an agent divided
        by their number, so a long message weighs more; ``"sequence_mean"``:
        the mean over each message's tokens, then over the messages. For
        one-token actions both are the mean over active steps.

    Returns
    -------
    torch.Tensor
        ``(agents,)``; 0 for an agent without a counted token.
    """
    mask = token_mask & active.unsqueeze(-1)
    masked = torch.where(mask, values, torch.zeros_like(values))
    if mode == "token_mean":
        agents = values.shape[-2]
        total = masked.transpose(-1, -2).reshape(-1, agents).sum(0) if masked.ndim > 2 else masked.sum(-1)
        count = mask.transpose(-1, -2).reshape(-1, agents).sum(0) if mask.ndim > 2 else mask.sum(-1)
        return total / count.clamp_min(1).to(values.dtype)
    if mode == "sequence_mean":
        per_message = masked.sum(-1) / mask.sum(-1).clamp_min(1).to(values.dtype)
        return per_agent_mean(per_message, mask.any(-1))
    raise ValueError(f"aggregate: mode must be one of {list(AGGREGATIONS)}, got {mode!r}")


def token_kl(log_probs: torch.Tensor, reference_log_probs: torch.Tensor) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens (Schulman's k3).

    ``exp(r - p) - (r - p) - 1`` with ``p``, ``r`` the policy's and the
    reference's log-probabilities of a token drawn from the policy: unbiased,
    never negative, and exact in expectation. Summed over a message's tokens
    it estimates the KL of the message distributions.
    """
    difference = reference_log_probs - log_probs
    return difference.exp() - difference - 1
