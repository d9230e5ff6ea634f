"""Collection, the first part of an RL iteration: a batch from the collector, its finished episodes, their metrics.

Helpers of :meth:`~nip_like.trainers.rl.TensorDictRlTrainer.train_iteration`.
A batch has batch dims ``(env, time)``; an episode's metrics come from the
``"next"`` entries of its last step.
"""

from __future__ import annotations

from typing import Iterator

import torch
from tensordict import TensorDictBase

from nip_like import keys
from nip_like.distributed import Distributed
from nip_like.objectives.masking import per_agent_mean
from nip_like.objectives.reference import ReferencePolicy, divergence_from_reference
from nip_like.scenarios.base import TensorGame


def finished_episodes(rollout: TensorDictBase, first_only: bool = False) -> TensorDictBase:
    """Return the ``"next"`` entries of the last step of each finished episode.

    Parameters
    ----------
    rollout : TensorDictBase
        Batch shape ``(env, time)``.
    first_only : bool
        Keep only each environment's first finished episode (evaluation runs
        reset finished environments and would otherwise count some twice).
    """
    done = rollout.get(("next", "done")).squeeze(-1)
    if first_only:
        done = done & (done.cumsum(-1) == 1)
    return rollout.get("next")[done]


def collect(batches: Iterator[TensorDictBase], device: torch.device, dist: Distributed, seed: int) -> TensorDictBase:
    """The collector's next batch (this rank's share under torchrun), on ``device``, without gradients."""
    with torch.no_grad(), dist.rank_rng(seed):
        return next(batches).to(device)


def episode_metrics(scenario: TensorGame, episodes: TensorDictBase) -> dict[str, float]:
    """The scenario's metrics of finished ``episodes`` and their count (nothing for none)."""
    count = episodes.batch_size.numel()  # TensorDict.numel() is 1 for an empty batch
    if count == 0:
        return {}
    metrics = scenario.episode_metrics(episodes)
    metrics["episodes"] = count
    return metrics


def policy_diagnostics(
    batch: TensorDictBase, reference: ReferencePolicy, agent_names: tuple[str, ...], scenario: TensorGame
) -> dict[str, float]:
    """KL from the initial policy and entropy of the collecting policy, over active steps; the scenario's policy metrics.

    See :func:`~nip_like.objectives.reference.divergence_from_reference`:
    exact for categorical actions, per-token estimates on the sampled tokens
    for messages; the same for every objective.
    """
    active = batch.get(keys.ACTIVE_KEY)
    kl, entropy = divergence_from_reference(batch, reference)
    kl, entropy = per_agent_mean(kl, active), per_agent_mean(entropy, active)
    metrics = {"objective/kl": kl.mean().item(), "objective/entropy": entropy.mean().item()}
    for index, name in enumerate(agent_names):
        metrics[f"agents/{name}/objective/kl"] = kl[index].item()
        metrics[f"agents/{name}/objective/entropy"] = entropy[index].item()
    metrics.update(scenario.policy_metrics(batch))
    return metrics
