"""What an RL trainer's checkpoint holds besides the optimiser: the loop's counters, the loss module, the collection.

Helpers of :meth:`~nip_like.trainers.rl.TensorDictRlTrainer.state_dict` and
``load_state_dict``. Frozen agent weights (a LoRA agent's base model) are left
out of the loss module's state: the model folders hold them already. The
collection's state (the collector's in-flight episodes and the environments'
generator) resumes collection exactly; under torchrun each rank has its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torchrl.collectors import Collector

from nip_like.errors import CheckpointError
from nip_like.lm.sharding import is_sharded


@dataclass
class TrainState:
    """Counters of the train loop, saved in checkpoints."""

    iteration: int = 0  # completed iterations
    frames: int = 0  # environment steps collected
    gradient_steps: int = 0  # optimiser steps taken
    best_metric: float | None = None  # best evaluation metric so far
    best_iteration: int | None = None  # iteration of the best evaluation
    evals_without_improvement: int = 0  # for early stopping
    stopped_early: bool = False  # whether early stopping ended training
    train_seconds: float = 0.0  # wall time spent in the train loop, over all sessions


def frozen_keys(agents: nn.Module, loss_module: nn.Module) -> set[str]:
    """Keys of ``loss_module``'s state that hold frozen weights of ``agents`` (a LoRA agent's base model)."""
    frozen = {_storage_identity(param) for param in agents.parameters() if not param.requires_grad}
    if not frozen:
        return set()
    named = nn.Module.named_parameters(loss_module, remove_duplicate=False)  # as the state dict names them
    return {key for key, value in named if _storage_identity(value) in frozen}


def _storage_identity(tensor: torch.Tensor) -> int:
    """What tells two views of one weight apart from other weights: its data pointer, a sharded parameter's identity."""
    return id(tensor) if is_sharded(tensor) else tensor.data_ptr()


def loss_module_state(loss_module: nn.Module, frozen: set[str]) -> dict[str, Any]:
    """``loss_module``'s state without the ``frozen`` keys."""
    return {key: value for key, value in loss_module.state_dict().items() if key not in frozen}


def load_loss_module_state(loss_module: nn.Module, state: dict[str, Any], frozen: set[str]) -> None:
    """Load ``state`` (written by :func:`loss_module_state`) into ``loss_module``; refuse one of other agents."""
    missing, unexpected = loss_module.load_state_dict(state, strict=not frozen)
    if set(missing) - frozen or unexpected:
        raise CheckpointError(
            f"the checkpoint does not fit this run's agents: missing {sorted(set(missing) - frozen)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]}"
        )


def collection_state(collector: Collector, env) -> dict[str, Any]:
    """The collection's state: the collector's, its in-flight episodes and the environments' generator."""
    # Without the policy's weights, which the loss module's state holds already (once, not once per rank).
    collector_state = {key: value for key, value in collector.state_dict().items() if key != "policy_state_dict"}
    return {
        "collector": collector_state,
        # The collector's current TensorDict holds every in-flight episode
        # (the environments keep their state in it), so restoring it
        # continues collection exactly.
        "collector_carrier": collector._carrier.clone(),
        "env_rng": env.get_rng_state(),
    }


def load_collection_state(collector: Collector, env, state: dict[str, Any], device: torch.device) -> None:
    """Restore what :func:`collection_state` returned."""
    collector.load_state_dict(state["collector"], strict=False)  # strict would ask for the policy's weights
    collector._carrier.update(state["collector_carrier"].to(device))
    env.set_rng_state(state["env_rng"])


def check_ranks(state: dict[str, Any], world_size: int) -> None:
    """Refuse a checkpoint written by a run of another number of ranks."""
    ranks = len(state.get("ranks", [None]))
    if ranks != world_size:
        raise CheckpointError(
            f"the checkpoint was written by a run of {ranks} rank(s); resume it with as many "
            f"(torchrun --nproc_per_node={ranks}), not {world_size}"
        )
