"""What an RL trainer's checkpoint holds besides the optimiser: the loop's counters, the loss module, the collection.

:class:`RlCheckpoints` is the part of
:class:`~nip_like.trainers.rl.TensorDictRlTrainer` that writes and reads its
checkpoints (``state_dict``, ``load_state_dict``, the agents' own folders);
the functions are its helpers (the collection's state is
:mod:`~nip_like.trainers.collector_state`'s). Frozen agent weights (a LoRA agent's base
model) are left out of the loss module's state: the model folders hold them
already. The collection's state (the collector's in-flight episodes and the
environments' generator) resumes collection exactly; under torchrun each rank
has its own.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nip_like.checkpoint import get_rng_states, set_rng_states
from nip_like.errors import CheckpointError
from nip_like.lm.frozen import check_sources, source_record
from nip_like.lm.sharding import is_sharded, shard_like, shard_optimizer_state, whole
from nip_like.trainers.base import TensorDictTrainer
from nip_like.trainers.collector_state import collection_state, load_collection_state


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


class RlCheckpoints(TensorDictTrainer):
    """The checkpoints of :class:`~nip_like.trainers.rl.TensorDictRlTrainer`: its state, and its agents in their own format."""

    def save_checkpoint(self, name: str = "last") -> Path:
        """Write the trainer state to ``checkpoints/<name>.pt``, and the agents in their own format.

        Agents that write themselves in their own format (the policy hook
        :meth:`~nip_like.trainers.policy_hooks.PolicyHooks.save_pretrained`:
        language-model agents, as Hugging Face folders) are also saved under
        ``checkpoints/<name>/<agent>/`` (model, tokenizer, value head), beside
        the full trainer state that exact resumption reads.
        """
        path = super().save_checkpoint(name)
        # Sharded agents are made whole on every rank (a collective); rank 0 writes them.
        states = self.policy_hooks.whole_states() if self.sharded is not None else None
        if self.distributed.is_writer:
            self.policy_hooks.save_pretrained(self.checkpoint_dir / name, states)
        return path

    def _frozen_keys(self) -> set[str]:
        return frozen_keys(self.agent_modules.modules(), self.loss_module)

    def _load_loss_module_state(self, state: dict[str, Any]) -> None:
        if self.sharded is not None:  # a checkpoint holds whole tensors: each rank keeps its shards
            state = shard_like(state, self.loss_module.state_dict())
        load_loss_module_state(self.loss_module, state, self._frozen_keys())

    def state_dict(self) -> dict[str, Any]:
        own_collection = collection_state(self.collector, self.train_env)
        state = {
            # Without frozen agent weights, which the model folders hold already.
            "loss_module": loss_module_state(self.loss_module, self._frozen_keys()),
            "reference_policy": self.reference_policy.state_dict(),
            "optimizer": self.optimizer.state_dict(),
        }
        if self.sharded is not None:  # whole tensors (every rank gathers): the file a replicated run writes
            state = whole(state)
        state |= {
            # Where frozen co-players were loaded from, with a checksum of the files read (their weights are not saved).
            "frozen_agents": source_record(self.policy_hooks.frozen_sources()),
            "opponent_pool": self.opponent_pool.state_dict() if self.opponent_pool is not None else None,
            "scheduler": self.scheduler.state_dict(),
            "train_state": asdict(self.state),
            "rng": get_rng_states(),
        }
        if not self.distributed.enabled:
            return {**state, **own_collection}
        # Under torchrun each rank's collection (and its own random stream) is its own: one entry per rank.
        return {**state, "ranks": self.distributed.gather({**own_collection, "rank_rng": self.distributed.rng_state()})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_ranks(state, self.distributed.world_size)
        own_collection = state["ranks"][self.distributed.rank] if "ranks" in state else state
        check_sources(state.get("frozen_agents", {}), self.policy_hooks.frozen_sources())
        self._load_loss_module_state(state["loss_module"])
        self.reference_policy.load_state_dict(state["reference_policy"])
        optimizer_state = state["optimizer"]
        if self.sharded is not None:
            optimizer_state = shard_optimizer_state(optimizer_state, (p for g in self.optimizer.param_groups for p in g["params"]))
        self.optimizer.load_state_dict(optimizer_state)
        self.scheduler.load_state_dict(state["scheduler"])
        self.state.restore(state["train_state"])
        if self.opponent_pool is not None:
            if state.get("opponent_pool") is None:
                raise CheckpointError("the checkpoint was written without trainer.opponent_pool: resume with the same settings")
            self.opponent_pool.load_state_dict(state["opponent_pool"], self.state.iteration)
        load_collection_state(self.collector, self.train_env, own_collection, self.device)
        self.distributed.set_rng_state(own_collection.get("rank_rng"))
        set_rng_states(state["rng"])
        self.progress_initial["_run_train_loop"] = self.state.iteration
