"""The distribution a language-model agent samples its tokens from.

Sampling (:meth:`nip_like.lm.policy.LMPolicy.sample`) and scoring
(:meth:`nip_like.lm.policy.LMPolicy.log_probs`) both go through
:func:`processed_log_probs`, so the log-probabilities stored at collection
and the ones recomputed with gradients are of the same distribution. The
processing follows the order of Hugging Face ``generate`` (processors, then
warpers): banned tokens, temperature, top-k, top-p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nip_like.errors import ConfigError

#: The lowest sampling temperature: below it, logits divided by it overflow float32 and sampling fails.
MIN_TEMPERATURE = 0.01


@dataclass(frozen=True)
class SamplingSettings:
    """How the model's logits are turned into the distribution sampled from.

    Parameters
    ----------
    temperature : float
        The logits are divided by it; must be positive (1 leaves them).
    top_k : int
        Keep only the ``top_k`` most likely tokens (ties at the k-th logit
        are all kept); 0 keeps all.
    top_p : float
        Keep the smallest set of most likely tokens whose probability
        (after temperature and top-k) reaches ``top_p``; 1 keeps all.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature >= MIN_TEMPERATURE:
            raise ConfigError(f"temperature must be >= {MIN_TEMPERATURE:g}, got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be 0 (off) or positive, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")


def processed_log_probs(logits: torch.Tensor, banned: torch.Tensor, settings: SamplingSettings) -> torch.Tensor:
    """Log-probabilities of the distribution that tokens are sampled from.

    Parameters
    ----------
    logits : torch.Tensor
        Raw logits of the model, ``(..., vocab)``.
    banned : torch.Tensor
        ``(vocab,)`` booleans: tokens that can never be sampled (padding,
        beginning of sequence, ids the tokenizer does not have).
    settings : SamplingSettings
        Temperature, top-k and top-p.

    Returns
    -------
    torch.Tensor
        ``(..., vocab)`` float32 log-probabilities: ``log_softmax`` of the
        logits with the banned tokens set to ``-inf``, divided by the
        temperature, then with the tokens outside the top-k and outside the
        top-p nucleus set to ``-inf``. Differentiable in ``logits``.
    """
    scores = logits.float().masked_fill(banned, float("-inf"))
    if settings.temperature != 1.0:
        scores = scores / settings.temperature
    if settings.top_k and settings.top_k < scores.shape[-1]:
        kth_best = torch.topk(scores, settings.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth_best, float("-inf"))
    if settings.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        sorted_probs = sorted_scores.softmax(dim=-1)
        # The mass of the tokens more likely than each token: the most likely one is always kept.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        outside = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, order, mass_before >= settings.top_p)
        scores = scores.masked_fill(outside, float("-inf"))
    return scores.log_softmax(dim=-1)


def entropy(log_probs: torch.Tensor) -> torch.Tensor:
    """Entropy of categorical distributions given by their log-probabilities.

    Parameters
    ----------
    log_probs : torch.Tensor
        ``(..., vocab)``, possibly with ``-inf`` entries (tokens of
        probability 0, which add nothing).

    Returns
    -------
    torch.Tensor
        ``(...)`` entropies in nats.
    """
    probs = log_probs.exp()
    return -(probs * log_probs.masked_fill(probs == 0, 0.0)).sum(dim=-1)
