"""The collector's in-flight episodes: the one place that reads TorchRL's private collector state.

A TorchRL :class:`~torchrl.collectors.Collector` keeps the TensorDict of the
step it plays next (every in-flight episode: the environments keep their
state in it) in a private attribute, ``_carrier`` (TorchRL 0.14), with no
public accessor. The RL trainer needs it twice: a checkpoint saves it and a
resume restores it, so that collection continues exactly; and the opponent
pool reads which datapoint group each in-flight episode plays. Both go
through this module, so that a TorchRL release that renames the attribute
breaks one function, not the trainer.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDictBase
from torchrl.collectors import Collector

__all__ = ["collection_state", "in_flight", "load_collection_state"]


def in_flight(collector: Collector) -> TensorDictBase:
    """The TensorDict of the step ``collector`` plays next: one row per environment, each in-flight episode's state.

    The collector's own TensorDict, not a copy: clone it to keep it, update it to change what is collected next.
    """
    return collector._carrier


def collection_state(collector: Collector, env: Any) -> dict[str, Any]:
    """The collection's state: the collector's, its in-flight episodes and the environments' generator.

    The keys (``collector``, ``collector_carrier``, ``env_rng``) are those of
    every checkpoint written so far; :func:`load_collection_state` reads them.
    """
    # Without the policy's weights, which the loss module's state holds already (once, not once per rank).
    collector_state = {key: value for key, value in collector.state_dict().items() if key != "policy_state_dict"}
    return {
        "collector": collector_state,
        # Every in-flight episode (the environments keep their state in it): restored, collection continues exactly.
        "collector_carrier": in_flight(collector).clone(),
        "env_rng": env.get_rng_state(),
    }


def load_collection_state(collector: Collector, env: Any, state: dict[str, Any], device: torch.device) -> None:
    """Restore what :func:`collection_state` returned, the in-flight episodes on ``device``."""
    collector.load_state_dict(state["collector"], strict=False)  # strict would ask for the policy's weights
    in_flight(collector).update(state["collector_carrier"].to(device))
    env.set_rng_state(state["env_rng"])
