"""Optimisers: the ones a config may name and the one function that builds one (the RL loop, the warm start and the
fine-tune jobs), the RL loop's optimiser with a parameter group per agent, and its learning-rate schedules."""

from __future__ import annotations

import inspect
import math
from typing import Any, Iterable, Mapping

import torch
from omegaconf import DictConfig
from torch import nn

from nip_like.errors import ConfigError

#: The optimisers a config may name (``trainer.optimizer.name``).
OPTIMIZERS = {
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "sgd": torch.optim.SGD,
    "rmsprop": torch.optim.RMSprop,
    "adagrad": torch.optim.Adagrad,
}

#: The learning-rate schedules over the training iterations (``trainer.optimizer.lr_schedule``; :class:`LrFactor`).
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


def build_optimizer(config: DictConfig, agent_params: Mapping[str, Iterable[nn.Parameter]]) -> torch.optim.Optimizer:
    """Build the optimiser with one parameter group per agent.

    Parameters
    ----------
    config : DictConfig
        The ``trainer.optimizer`` node.
    agent_params : Mapping[str, Iterable[nn.Parameter]]
        Each agent's parameters; the group's ``"agent"`` entry holds the name.
    """
    if config.name not in OPTIMIZERS:
        raise ConfigError(f"trainer.optimizer.name must be one of {sorted(OPTIMIZERS)}, got {config.name!r}")
    unknown = sorted(set(config.agent_lr) - set(agent_params))
    if unknown:
        raise ConfigError(
            f"trainer.optimizer.agent_lr names {unknown}; the agents are {sorted(agent_params)}"
        )
    groups, seen = [], set()
    for name, params in agent_params.items():
        # A parameter several agents hold (one model playing several roles) trains in the first one's group.
        params = [param for param in params if param.requires_grad and id(param) not in seen]
        seen.update(id(param) for param in params)
        if params:
            groups.append({"params": params, "lr": float(config.agent_lr.get(name, config.lr)), "agent": name})
    if not groups:
        raise ConfigError("the agents have no trainable parameters")
    return make_optimizer(
        config.name,
        groups,
        weight_decay=config.weight_decay,
        betas=tuple(config.betas),
        eps=config.eps,
        momentum=config.momentum,
    )


class LrFactor:
    """Learning-rate multiplier as a function of the iteration (picklable).

    Parameters
    ----------
    schedule : str
        ``"constant"``, ``"linear"`` (to ``final_factor`` at the last
        iteration) or ``"cosine"`` (half a cosine down to ``final_factor``).
    num_iterations : int
        Length of training.
    final_factor : float
        Multiplier reached at the end (linear and cosine).
    warmup_iterations : int
        Iterations of linear warm-up from 0 before the schedule starts.
    """

    def __init__(self, schedule: str, num_iterations: int, final_factor: float, warmup_iterations: int) -> None:
        if schedule not in LR_SCHEDULES:
            raise ConfigError(f"trainer.optimizer.lr_schedule must be one of {list(LR_SCHEDULES)}, got {schedule!r}")
        self.schedule = schedule
        self.num_iterations = num_iterations
        self.final_factor = final_factor
        self.warmup_iterations = warmup_iterations

    def __call__(self, iteration: int) -> float:
        if iteration < self.warmup_iterations:
            return (iteration + 1) / (self.warmup_iterations + 1)
        span = max(self.num_iterations - self.warmup_iterations - 1, 1)
        progress = min((iteration - self.warmup_iterations) / span, 1.0)
        if self.schedule == "linear":
            return 1.0 + (self.final_factor - 1.0) * progress
        if self.schedule == "cosine":
            return self.final_factor + (1.0 - self.final_factor) * 0.5 * (1 + math.cos(math.pi * progress))
        return 1.0


def build_scheduler(
    config: DictConfig, optimizer: torch.optim.Optimizer, num_iterations: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Build a per-iteration LR scheduler from ``trainer.optimizer`` settings."""
    factor = LrFactor(config.lr_schedule, num_iterations, config.lr_final_factor, config.warmup_iterations)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
