"""The one supervised epoch of every supervised fit (warm starts, the solo-agent trainer), and its warm-up.

A fit differs only in its step loss (:data:`StepLoss`): the decision
cross-entropy of :func:`nip_like.warm_start.decision_loss`, the next-token
cross-entropy of :func:`nip_like.lm.demonstration_fit.demonstration_loss`;
:func:`nip_like.warm_start.fit_loss` picks one by the data.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from tensordict import TensorDictBase

from nip_like.interrupts import stop_point

#: Given a minibatch: its loss (to minimise) and the per-example accuracy (a float tensor).
StepLoss = Callable[[TensorDictBase], tuple[torch.Tensor, torch.Tensor]]


def warmup_schedule(optimizer: torch.optim.Optimizer, steps: int) -> Optional[torch.optim.lr_scheduler.LRScheduler]:
    """A linear learning-rate warm-up over the first ``steps`` optimiser steps (None when ``steps`` is 0)."""
    if steps <= 0:
        return None
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / steps))


def supervised_epoch(
    data: TensorDictBase,
    step_loss: StepLoss,
    optimizer: torch.optim.Optimizer,
    minibatch_size: int,
    generator: torch.Generator,
    max_grad_norm: float | None = None,
    scheduler: Optional[torch.optim.lr_scheduler.LRScheduler] = None,
    phase: str = "a supervised epoch",
) -> tuple[float, float, int]:
    """One shuffled pass over ``data`` in minibatches, one optimiser step each.

    Parameters
    ----------
    data : TensorDictBase
        ``(E,)`` examples.
    step_loss : callable
        Maps a minibatch to its loss and its per-example accuracies.
    optimizer : torch.optim.Optimizer
        Steps the parameters the loss depends on.
    minibatch_size : int
        Examples per step; the last, incomplete minibatch is dropped unless
        it is the only one.
    generator : torch.Generator
        Shuffles the order.
    max_grad_norm : float, optional
        Clip the gradient norm of the optimiser's parameters to this.
    scheduler : LRScheduler, optional
        Stepped after every optimiser step (a warm-up, say).
    phase : str
        The fit, as a stop request in the middle of it is reported
        (:func:`~nip_like.interrupts.stop_point`, before each minibatch's
        forward and backward passes).

    Returns
    -------
    loss, accuracy, steps
        The mean minibatch loss and accuracy, and the number of optimiser steps.
    """
    count = data.batch_size[0]
    size = min(int(minibatch_size), count)
    order = torch.randperm(count, generator=generator).to(data.device)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    losses, accuracies = [], []
    for start in range(0, count - size + 1, size):
        stop_point(phase)
        loss, accuracy = step_loss(data[order[start : start + size]])
        stop_point(phase)  # the forward pass and the backward pass are the step's long parts
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.detach())
        accuracies.append(accuracy.detach().float().mean())
    return torch.stack(losses).mean().item(), torch.stack(accuracies).mean().item(), len(losses)
