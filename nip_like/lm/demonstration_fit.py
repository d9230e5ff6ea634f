"""Supervised fine-tuning of a language-model agent on demonstrations (its warm start)."""

from __future__ import annotations

import math

import torch
from tensordict import TensorDictBase

from nip_like.interrupts import stop_point
from nip_like.lm.policy import LMPolicy
from nip_like.supervised import StepLoss

#: A token with probability above this is the most likely one: greedy decoding reproduces it.
GREEDY_PROBABILITY = 0.5


def demonstration_loss(policy: LMPolicy) -> StepLoss:
    """The step loss of a fit to demonstrated messages: next-token cross-entropy, and whether each is reproduced.

    For :func:`~nip_like.supervised.supervised_epoch`. The policy is trained on
    the log-probabilities of the distribution it samples from
    (:meth:`~nip_like.lm.policy.LMPolicy.evaluate`); a minibatch holds ``(E,)``
    demonstrations: ``"prompt_ids"``, ``"prompt_mask"``, ``"tokens"``,
    ``"token_mask"`` (see
    :meth:`~nip_like.scenarios.duplicates.scenario.DuplicatesScenario.demonstrations`).
    The loss is the mean per token; the accuracy, the share of demonstrations
    whose every token has probability above one half (so that greedy decoding
    reproduces them exactly).
    """

    def step_loss(batch: TensorDictBase) -> tuple[torch.Tensor, torch.Tensor]:
        token_log_probs, mask = _demonstrated_token_log_probs(policy, batch)
        loss = -(token_log_probs * mask).sum() / mask.sum().clamp_min(1)
        return loss, _reproduced(token_log_probs.detach(), mask)

    return step_loss


def _demonstrated_token_log_probs(policy: LMPolicy, batch: TensorDictBase) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, T)`` log-probabilities of the demonstrated tokens under ``policy``, and their mask."""
    scores = policy.evaluate(
        batch["prompt_ids"], batch["prompt_mask"], batch["tokens"], batch["token_mask"], with_value=False
    )
    return scores["token_log_probs"], batch["token_mask"]


def _reproduced(token_log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(B,)``: whether greedy decoding says each demonstration (every token more likely than not)."""
    return ((token_log_probs > math.log(GREEDY_PROBABILITY)) | ~mask).all(-1)


@torch.no_grad()
def held_out_scores(policy: LMPolicy, data: TensorDictBase, minibatch_size: int = 1024) -> tuple[float, float]:
    """Loss per token and greedy reproduction rate of ``policy`` on demonstrations it is not trained on.

    The reproduction rate is the share of demonstrations whose every token has
    probability above one half: greedy decoding says exactly them.
    """
    total_loss, total_tokens, reproduced = 0.0, 0, 0
    for start in range(0, data.batch_size[0], minibatch_size):
        stop_point("the scoring of held-out data")
        log_probs, mask = _demonstrated_token_log_probs(policy, data[start : start + minibatch_size])
        total_loss -= float((log_probs * mask).sum())
        total_tokens += int(mask.sum())
        reproduced += int(_reproduced(log_probs, mask).sum())
    return total_loss / max(total_tokens, 1), reproduced / max(data.batch_size[0], 1)


def sync_value_body(policy: LMPolicy) -> None:
    """Start a separate value body from the fine-tuned model's body (nothing to do when shared)."""
    head = policy.value_head
    if head is not None and head.body is not None:
        head.body.load_state_dict(policy.model.base_model.state_dict())
