"""Reductions over the agent dimension that skip inactive agents."""

from __future__ import annotations

import torch
from tensordict import TensorDict


def per_agent_mean(values: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean of ``values`` for each agent, over the entries where ``mask`` holds.

    Parameters
    ----------
    values : torch.Tensor
        Shape ``(*batch, num_agents)``.
    mask : torch.Tensor, optional
        Boolean, same shape; ``None`` counts every entry.

    Returns
    -------
    torch.Tensor
        Shape ``(num_agents,)``. An agent with no entry in the mask gets 0, never NaN.
    """
    flat = values.reshape(-1, values.shape[-1])
    if mask is None:
        return flat.mean(0)
    flat_mask = mask.reshape(-1, mask.shape[-1])
    # Select rather than multiply, so that non-finite masked entries cannot leak in.
    total = torch.where(flat_mask, flat, torch.zeros_like(flat)).sum(0)
    return total / flat_mask.sum(0).clamp_min(1).to(flat.dtype)


def set_per_agent(output: TensorDict, agent_names: tuple[str, ...], statistics: dict[str, torch.Tensor]) -> None:
    """Write per-agent statistics into a loss output under ``("agents", <name>, <statistic>)``.

    Parameters
    ----------
    output : TensorDict
        The loss module's output.
    agent_names : tuple of str
        Agents, in the order of the agent dimension.
    statistics : dict
        Statistic name to a ``(num_agents,)`` tensor; it is detached.
    """
    for index, name in enumerate(agent_names):
        output["agents", name] = TensorDict({stat: values[index].detach() for stat, values in statistics.items()})


def standardize_per_agent(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Standardise ``values`` separately for each agent over its masked entries.

    Parameters
    ----------
    values : torch.Tensor
        Shape ``(*batch, num_agents)``.
    mask : torch.Tensor
        Boolean, same shape: which entries define the statistics.
    eps : float
        Added to the standard deviation.

    Returns
    -------
    torch.Tensor
        Same shape as ``values``; entries outside the mask are shifted and scaled
        too, but carry no meaning.
    """
    mean = per_agent_mean(values, mask)
    variance = per_agent_mean((values - mean) ** 2, mask)
    return (values - mean) / (variance.sqrt() + eps)
