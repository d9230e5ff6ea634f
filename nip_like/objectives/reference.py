"""A frozen copy of a policy, for KL penalties and diagnostics."""

from __future__ import annotations

import copy

import torch
from tensordict import TensorDictBase
from torch import nn
from torchrl.modules import ProbabilisticActor

from nip_like import keys
from nip_like.distributions import masked_log_softmax


class ReferencePolicy(nn.Module):
    """A frozen snapshot of the agents' policy.

    Parameters
    ----------
    policy : ProbabilisticActor
        The policy to copy; it must write ``("agents", "logits")``.
    """

    def __init__(self, policy: ProbabilisticActor) -> None:
        super().__init__()
        self.policy = copy.deepcopy(policy)
        self.policy.requires_grad_(False)

    @torch.no_grad()
    def logits(self, tensordict: TensorDictBase) -> torch.Tensor:
        """Return the reference logits ``(*batch, num_agents, num_actions)`` for ``tensordict``."""
        inputs = tensordict.select(*self.policy.in_keys, strict=False).clone(False)
        return self.policy.get_dist_params(inputs).get(keys.LOGITS_KEY)

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
