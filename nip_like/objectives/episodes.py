"""Episode-level views of a collected ``(env, time)`` batch."""

from __future__ import annotations

from typing import NamedTuple

import torch
from tensordict import TensorDictBase

from nip_like import keys


def episode_ids(batch: TensorDictBase) -> tuple[torch.Tensor, torch.Tensor]:
    """Number the episodes of a batch and find the complete ones.

    Parameters
    ----------
    batch : TensorDictBase
        Batch shape ``(env, time)``, with ``("state", "round")`` and
        ``("next", "done")`` as written by :class:`~nip_like.scenarios.environment.InteractionEnv`.

    Returns
    -------
    ids : torch.Tensor
        ``(env, time)`` integers: steps of one episode share an id, ids are
        unique across the batch.
    complete : torch.Tensor
        ``(env, time)`` booleans: the step belongs to an episode that both
        starts (round 0) and ends (done) inside the batch.
    """
    starts = batch.get(keys.ROUND_KEY) == 0
    ends = batch.get(("next", "done")).squeeze(-1)
    num_envs, num_steps = starts.shape
    # Episode number within each environment's row; 0 marks a truncated beginning.
    number = starts.long().cumsum(-1)
    ids = number + torch.arange(num_envs, device=number.device).unsqueeze(-1) * (num_steps + 1)
    finished = ids[ends & (number > 0)].unique()
    return ids, torch.isin(ids, finished)


def group_relative(values: torch.Tensor, groups: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Standardise ``values`` within groups: (value - group mean) / group std.

    Parameters
    ----------
    values : torch.Tensor
        ``(num_items, num_agents)`` values (e.g. episode returns).
    groups : torch.Tensor
        ``(num_items,)`` group ids.
    eps : float
        A group whose (sample) standard deviation is at most ``eps`` gets 0.

    Returns
    -------
    torch.Tensor
        Same shape as ``values``. A group of one, or one with no spread, gets 0
        everywhere; the result is never NaN.
    """
    _, inverse, counts = groups.unique(return_inverse=True, return_counts=True)
    num_groups = counts.numel()
    sums = torch.zeros(num_groups, values.shape[-1], dtype=values.dtype, device=values.device)
    sums.index_add_(0, inverse, values)
    size = counts.to(values.dtype).unsqueeze(-1)
    mean = sums / size
    centred = values - mean[inverse]
    squares = torch.zeros_like(sums).index_add_(0, inverse, centred**2)
    std = (squares / (size - 1).clamp_min(1)).sqrt()
    scale = std[inverse]
    valid = (counts[inverse] > 1).unsqueeze(-1) & (scale > eps)
    return torch.where(valid, centred / scale.clamp_min(eps), torch.zeros_like(values))


class CompleteEpisodes(NamedTuple):
    """The complete episodes of a batch, one entry per episode, and where their steps are.

    Attributes
    ----------
    ids : torch.Tensor
        ``(env, time)`` episode ids of every step (:func:`episode_ids`).
    complete : torch.Tensor
        ``(env, time)`` booleans: the step belongs to a complete episode.
    ends : torch.Tensor
        ``(env, time)`` booleans: the last step of a complete episode.
    episodes : torch.Tensor
        ``(episodes,)`` the id of each complete episode, in batch order of their last steps.
    returns : torch.Tensor
        ``(episodes, agents)`` each agent's return.
    groups : torch.Tensor
        ``(episodes,)`` the group (datapoint played side by side) of each episode.
    """

    ids: torch.Tensor
    complete: torch.Tensor
    ends: torch.Tensor
    episodes: torch.Tensor
    returns: torch.Tensor
    groups: torch.Tensor


def complete_episodes(batch: TensorDictBase) -> CompleteEpisodes:
    """Find the episodes that start and end inside ``batch``, with their returns and groups.

    Parameters
    ----------
    batch : TensorDictBase
        Batch shape ``(env, time)`` as collected, with the round, the group id
        and, under ``"next"``, done and the episode return.
    """
    ids, complete = episode_ids(batch)
    ends = batch.get(("next", "done")).squeeze(-1) & complete
    returns = batch.get(("next", *keys.EPISODE_RETURN_KEY))[ends].squeeze(-1)
    return CompleteEpisodes(ids, complete, ends, ids[ends], returns, batch.get(keys.GROUP_ID_KEY)[ends])


def lengthened(steps: TensorDictBase, length: int, repeat: int, off: tuple[str | tuple[str, ...], ...]) -> TensorDictBase:
    """``(n, T)`` padded episodes lengthened to ``length`` steps with more padding of the same kind.

    Each new step repeats step ``repeat`` of its row (0: the first, -1: the
    last) with the boolean entries ``off`` (the active flags, a valid flag)
    set False, so that it counts for nothing. Under torchrun the ranks pad
    their episodes to their own longest; the joined layout pads them all to
    the longest of any rank this way.
    """
    missing = length - steps.batch_size[1]
    if missing <= 0:
        return steps
    padding = steps[:, repeat : repeat + 1 if repeat != -1 else None].expand(steps.batch_size[0], missing).clone()
    for key in off:
        padding.set(key, torch.zeros_like(padding.get(key)))
    return torch.cat([steps, padding], dim=1)
