"""What an RL trainer's checkpoint holds besides the optimiser: the loop's counters, the loss module, the collection.

:func:`rl_state_dict` and :func:`load_rl_state` write and read what
:class:`~nip_like.trainers.rl.TensorDictRlTrainer`'s checkpoints hold, as
functions of its two records (:class:`~nip_like.trainers.rl_build.RlAgents`,
:class:`~nip_like.trainers.rl_build.RlParts`) and its counters; the agents'
own folders are :func:`save_agent_folders`' (the collection's state is
:mod:`~nip_like.trainers.collector_state`'s). Frozen agent weights (a LoRA agent's base
model) are left out of the loss module's state: the model folders hold them
already. The collection's state (the collector's in-flight episodes and the
environments' generator) resumes collection exactly; under torchrun each rank
has its own.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from nip_like.checkpoint import get_rng_states, set_rng_states
from nip_like.errors import CheckpointError
from nip_like.lm.frozen import check_sources, source_record
from nip_like.lm.sharding import is_sharded, shard_like, shard_optimizer_state, whole
from nip_like.trainers.collector_state import collection_state, load_collection_state

if TYPE_CHECKING:  # the records are built by rl_build, which does not need this module
    from nip_like.distributed import Distributed
    from nip_like.trainers.rl_build import RlAgents, RlParts


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

    def restore(self, saved: dict[str, Any]) -> None:
        """Take the counters of ``saved`` (:func:`dataclasses.asdict` of a state, as a checkpoint holds it)."""
        for name, value in asdict(TrainState(**saved)).items():
            setattr(self, name, value)


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


def check_ranks(state: dict[str, Any], world_size: int) -> None:
    """Refuse a checkpoint written by a run of another number of ranks."""
    ranks = len(state.get("ranks", [None]))
    if ranks != world_size:
        raise CheckpointError(
            f"the checkpoint was written by a run of {ranks} rank(s); resume it with as many "
            f"(torchrun --nproc_per_node={ranks}), not {world_size}"
        )


def save_agent_folders(agents: RlAgents, folder: Path, dist: Distributed) -> None:
    """The agents in their own format under ``folder/<agent>/``, where they have one (language models: Hugging Face folders).

    Sharded agents are made whole on every rank (a collective); the writer rank writes them.
    """
    states = agents.hooks.whole_states() if agents.sharded is not None else None
    if dist.is_writer:
        agents.hooks.save_pretrained(folder, states)


def load_loss_state(agents: RlAgents, parts: RlParts, saved: dict[str, Any]) -> None:
    """Load a checkpoint's loss-module state (``saved``) into ``parts.loss_module``; sharded agents keep their shards."""
    if agents.sharded is not None:  # a checkpoint holds whole tensors: each rank keeps its shards
        saved = shard_like(saved, parts.loss_module.state_dict())
    load_loss_module_state(parts.loss_module, saved, frozen_keys(agents.modules.modules(), parts.loss_module))


def rl_state_dict(agents: RlAgents, parts: RlParts, state: TrainState, dist: Distributed) -> dict[str, Any]:
    """What an RL trainer's checkpoint holds: the loss module, reference, optimiser, schedule, pool, counters, generators, collection.

    Frozen agent weights are left out (the model folders hold them); a
    sharded run writes whole tensors (every rank gathers), as a replicated
    run does. Under torchrun each rank's collection and random stream are its
    own: one entry per rank under ``ranks``.
    """
    own_collection = collection_state(parts.collector, parts.train_env)
    saved = {
        "loss_module": loss_module_state(parts.loss_module, frozen_keys(agents.modules.modules(), parts.loss_module)),
        "reference_policy": agents.reference.state_dict(),
        "optimizer": parts.optimizer.state_dict(),
    }
    if agents.sharded is not None:
        saved = whole(saved)
    saved |= {
        # Where frozen co-players were loaded from, with a checksum of the files read (their weights are not saved).
        "frozen_agents": source_record(agents.hooks.frozen_sources()),
        "opponent_pool": parts.opponent_pool.state_dict() if parts.opponent_pool is not None else None,
        "scheduler": parts.scheduler.state_dict(),
        "train_state": asdict(state),
        "rng": get_rng_states(),
    }
    if not dist.enabled:
        return {**saved, **own_collection}
    return {**saved, "ranks": dist.gather({**own_collection, "rank_rng": dist.rng_state()})}


def load_rl_state(agents: RlAgents, parts: RlParts, state: TrainState, saved: dict[str, Any], dist: Distributed, device: torch.device) -> None:
    """Restore what :func:`rl_state_dict` wrote into the records and ``state``, refusing a checkpoint that does not fit.

    Refused in one line: a checkpoint of another number of ranks, of other
    frozen co-players' files, of other agents, or written without the opponent
    pool this run has.
    """
    check_ranks(saved, dist.world_size)
    own_collection = saved["ranks"][dist.rank] if "ranks" in saved else saved
    check_sources(saved.get("frozen_agents", {}), agents.hooks.frozen_sources())
    load_loss_state(agents, parts, saved["loss_module"])
    agents.reference.load_state_dict(saved["reference_policy"])
    optimizer_state = saved["optimizer"]
    if agents.sharded is not None:
        optimizer_state = shard_optimizer_state(optimizer_state, (p for g in parts.optimizer.param_groups for p in g["params"]))
    parts.optimizer.load_state_dict(optimizer_state)
    parts.scheduler.load_state_dict(saved["scheduler"])
    state.restore(saved["train_state"])
    if parts.opponent_pool is not None:
        if saved.get("opponent_pool") is None:
            raise CheckpointError("the checkpoint was written without trainer.opponent_pool: resume with the same settings")
        parts.opponent_pool.load_state_dict(saved["opponent_pool"], state.iteration)
    load_collection_state(parts.collector, parts.train_env, own_collection, device)
    dist.set_rng_state(own_collection.get("rank_rng"))
    set_rng_states(saved["rng"])
