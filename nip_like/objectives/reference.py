"""A frozen copy of a policy, for KL penalties and diagnostics."""

from __future__ import annotations

import copy

import torch
from tensordict import TensorDictBase
from torch import nn

from nip_like import keys
from nip_like.distributions import masked_log_softmax
from nip_like.objectives.action_scores import ActionScores, score_actions, token_kl


class ReferencePolicy(nn.Module):
    """A frozen snapshot of the agents' policy.

    Parameters
    ----------
    policy : nn.Module
        The policy to copy: a probabilistic actor, or an actor that scores
        token sequences (see :func:`~nip_like.objectives.action_scores.score_actions`).
    moving : bool
        Whether the reference will follow the policy (:meth:`refresh`). A
        fixed reference lets a policy that offers ``frozen_reference()`` (LM
        agents with LoRA: the same model with its adapters switched off) share
        its weights instead of being copied; a moving one is always a copy.
    """

    def __init__(self, policy: nn.Module, moving: bool = False) -> None:
        super().__init__()
        frozen_reference = None if moving else getattr(policy, "frozen_reference", None)
        self.policy = frozen_reference() if frozen_reference is not None else copy.deepcopy(policy)
        self.policy.requires_grad_(False)

    @torch.no_grad()
    def scores(self, tensordict: TensorDictBase) -> ActionScores:
        """The reference's log-probabilities (and entropies) of the actions stored in ``tensordict``.

        See :func:`~nip_like.objectives.action_scores.score_actions`; without gradients.
        """
        return score_actions(self.policy, tensordict)

    @torch.no_grad()
    def refresh(self, policy: nn.Module, decay: float = 0.0) -> None:
        """Move towards ``policy``: copy it (``decay=0``) or take an EMA step."""
        for mine, theirs in zip(self.policy.parameters(), policy.parameters()):
            mine.mul_(decay).add_(theirs.detach(), alpha=1.0 - decay)


def categorical_kl(p_logits: torch.Tensor, q_logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Exact KL(p || q) of two categoricals over the legal actions; shape ``mask.shape[:-1]``."""
    log_p = masked_log_softmax(p_logits, mask)
    log_q = masked_log_softmax(q_logits, mask)
    terms = log_p.exp() * (log_p - log_q)
    return torch.where(mask, terms, torch.zeros_like(terms)).sum(-1)


def categorical_entropy(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Exact entropy of a categorical over the legal actions; shape ``mask.shape[:-1]``."""
    log_p = masked_log_softmax(logits, mask)
    terms = -log_p.exp() * log_p
    return torch.where(mask, terms, torch.zeros_like(terms)).sum(-1)


def divergence_from_reference(
    batch: TensorDictBase, reference: ReferencePolicy
) -> tuple[torch.Tensor, torch.Tensor]:
    """KL(collecting policy || reference) and the collecting policy's entropy, per step and agent.

    Uses only what the collector recorded and the reference's scores, so it is
    measured the same way for every objective.

    * Categorical actions (the batch holds ``("agents", "logits")``): both exact.
    * Token sequences: per-token estimates on the sampled tokens, summed over
      each message: :func:`~nip_like.objectives.action_scores.token_kl` between the
      stored log-probabilities and the reference's, and the stored entropy of
      each token's distribution. Both sums are unbiased estimates of the
      message distributions' KL and entropy.

    Returns
    -------
    kl, entropy : torch.Tensor
        ``(*batch, agents)`` each.
    """
    logits = batch.get(keys.LOGITS_KEY, None)
    if logits is not None:
        mask = batch.get(keys.ACTION_MASK_KEY)
        reference_logits = reference.scores(batch).logits
        return categorical_kl(logits, reference_logits, mask), categorical_entropy(logits, mask)
    token_mask = batch.get(keys.TOKEN_MASK_KEY)
    kl = token_kl(batch.get(keys.TOKEN_LOG_PROBS_KEY), reference.scores(batch).token_log_probs)
    kl = torch.where(token_mask, kl, torch.zeros_like(kl)).sum(-1)
    entropy = torch.where(token_mask, batch.get(keys.TOKEN_ENTROPY_KEY), 0.0).sum(-1)
    return kl, entropy
