"""Optimisers with per-agent parameter groups, LR schedules and update schedules."""

from __future__ import annotations

import math
from typing import Iterable, Mapping

import torch
from omegaconf import DictConfig
from torch import nn

from nip_like.config import AgentUpdateConfig
from nip_like.registry import typed_entry
from nip_like.errors import ConfigError
from nip_like.optimizers import LR_SCHEDULES, OPTIMIZERS, make_optimizer


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


class AgentUpdateSchedule:
    """Which agents are trained on which iteration.

    Parameters
    ----------
    config : Mapping[str, DictConfig]
        ``trainer.agent_updates``: per agent ``start``, ``stop`` and ``every``.
        Agents without an entry are trained on every iteration.
    agent_names : tuple of str
        All agents.
    """

    def __init__(self, config: Mapping[str, DictConfig], agent_names: tuple[str, ...]) -> None:
        unknown = sorted(set(config) - set(agent_names))
        if unknown:
            raise ConfigError(f"trainer.agent_updates names {unknown}; the agents are {list(agent_names)}")
        self.config = {}
        for name, entry in config.items():
            entry = typed_entry(AgentUpdateConfig, entry, f"trainer.agent_updates.{name}")
            if entry.every < 1:
                raise ConfigError(f"trainer.agent_updates.{name}.every must be at least 1, got {entry.every}")
            self.config[name] = entry
        self.agent_names = agent_names

    def is_trained(self, agent: str, iteration: int) -> bool:
        """Return whether ``agent`` is trained on ``iteration`` (0-based)."""
        entry = self.config.get(agent)
        if entry is None:
            return True
        if iteration < entry.start or (entry.stop is not None and iteration >= entry.stop):
            return False
        return (iteration - entry.start) % entry.every == 0

    def trained_agents(self, iteration: int) -> tuple[str, ...]:
        """Return the agents trained on ``iteration``."""
        return tuple(name for name in self.agent_names if self.is_trained(name, iteration))
