"""The optimisers by name and the one function that builds one: for the RL loop, the warm start and the fine-tune jobs."""

from __future__ import annotations

import inspect
from typing import Any, Iterable

import torch

#: The optimisers a config may name (``trainer.optimizer.name``).
OPTIMIZERS = {
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "sgd": torch.optim.SGD,
    "rmsprop": torch.optim.RMSprop,
    "adagrad": torch.optim.Adagrad,
}

#: The learning-rate schedules over the training iterations (``trainer.optimizer.lr_schedule``; :class:`nip_like.optim.LrFactor`).
LR_SCHEDULES = ("constant", "linear", "cosine")


def fast_implementation(optimizer_class: type[torch.optim.Optimizer]) -> dict[str, bool]:
    """Return the keyword that selects the fastest implementation of ``optimizer_class``.

    The fused implementation (one kernel over all parameters, on the CPU as on
    CUDA) where PyTorch has one, otherwise the multi-tensor (``foreach``) one;
    on the CPU either saves most of the per-parameter loop of a step (fused Adam
    is about three times faster than foreach Adam on the graph agents).
    """
    if "fused" in inspect.signature(optimizer_class.__init__).parameters:
        return {"fused": True}
    return {"foreach": True}


def make_optimizer(
    name: str,
    params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]],
    lr: float | None = None,
    *,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    momentum: float = 0.0,
    fast: bool = True,
) -> torch.optim.Optimizer:
    """Build the optimiser ``name`` (a key of :data:`OPTIMIZERS`) over ``params`` (parameters or parameter groups).

    Parameters
    ----------
    name : str
        ``adam``, ``adamw``, ``sgd``, ``rmsprop`` or ``adagrad``.
    params : iterable
        Parameters, or parameter groups (each with its own ``"lr"``).
    lr : float, optional
        The learning rate of groups without their own; None: the optimiser's default.
    weight_decay, betas, eps, momentum
        Passed to the optimisers that take them: betas and eps to Adam and
        AdamW, momentum to SGD and RMSprop, eps to RMSprop and Adagrad.
    fast : bool
        Ask for the fused or multi-tensor implementation
        (:func:`fast_implementation`); otherwise PyTorch's default one.

    Raises
    ------
    KeyError
        For a name not in :data:`OPTIMIZERS`.
    """
    optimizer_class = OPTIMIZERS[name]
    kwargs: dict[str, Any] = {"weight_decay": weight_decay, **(fast_implementation(optimizer_class) if fast else {})}
    if lr is not None:
        kwargs["lr"] = lr
    if name in ("adam", "adamw"):
        kwargs.update(betas=tuple(betas), eps=eps)
    elif name in ("sgd", "rmsprop"):
        kwargs["momentum"] = momentum
        if name == "rmsprop":
            kwargs["eps"] = eps
    else:
        kwargs["eps"] = eps
    return optimizer_class(params, **kwargs)
