"""The loss passes of the update, under ``torchrun`` through torch's ``DistributedDataParallel``.

Every rank draws the same minibatches and the ranks take each accumulation
window's minibatches in turn (:meth:`~nip_like.distributed.Distributed.owns`).
With replicated agents the loss module runs inside
:class:`~torch.nn.parallel.DistributedDataParallel`: a rank's passes of a
window accumulate their gradients locally (``no_sync``) and the backward pass
of its last one sums the window's gradients over the ranks, in DDP's buckets,
overlapped with the backward pass. A rank that owns no minibatch of a short
window runs one stand-in pass whose loss counts zero, so that every rank takes
part in each window's reduction.

The gradients are summed, not averaged: each minibatch's loss is already
divided by its window's length on the rank that computes it, so the sum over
the ranks is the window's mean gradient, as one process computes it.

With FSDP2 (``run.fsdp``) the agents' parameters are sharded and FSDP2 reduces
their gradients itself; the passes then run the loss module directly, every
rank as often as the rank that runs most (lockstep, :func:`stand_in_count`).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from tensordict import TensorDictBase
from torch import nn
from torchrl.objectives import LossModule

from nip_like.distributed import Distributed
from nip_like.errors import ConfigError
from nip_like.lm.sharding import is_sharded


def total_loss(losses: TensorDictBase) -> torch.Tensor:
    """The sum of a loss module's ``loss_*`` outputs: what the update differentiates."""
    return sum(losses.get(key) for key in losses.keys() if key.startswith("loss_"))


class _TotalLoss(nn.Module):
    """The loss module with its summed loss as a tensor output, which DDP follows to find the parameters used."""

    def __init__(self, loss_module: LossModule) -> None:
        super().__init__()
        self.loss_module = loss_module

    def forward(self, sample: TensorDictBase) -> tuple[torch.Tensor, TensorDictBase]:
        losses = self.loss_module(sample)
        return total_loss(losses), losses


def _summed(_state, bucket):  # no annotations: DDP checks them against the real classes, and annotations are strings here
    """DDP communication hook: a ``GradBucket``'s gradients summed over the ranks (DDP's own hook averages them)."""
    work = torch.distributed.all_reduce(bucket.buffer(), async_op=True)
    return work.get_future().then(lambda future: future.value()[0])


class LossPasses:
    """Forward and backward passes of the loss module over the minibatches of the update.

    Parameters
    ----------
    loss_module : LossModule
        The trainer's loss module.
    dist : Distributed
        The rank context; with one rank the passes are plain calls.
    lockstep : bool
        The agents are sharded with FSDP2 (``run.fsdp``): FSDP2 reduces their
        gradients, and every rank runs as many passes per window.

    Raises
    ------
    ConfigError
        With ``lockstep``, if a trained parameter is not sharded (FSDP2 would
        leave its gradient unreduced).
    """

    def __init__(self, loss_module: LossModule, dist: Distributed, lockstep: bool) -> None:
        self.loss_module = loss_module
        self.dist = dist
        self.lockstep = lockstep
        trained = [(name, p) for name, p in loss_module.named_parameters() if p.requires_grad]
        if lockstep:
            left = [name for name, param in trained if not is_sharded(param)]
            if left:
                raise ConfigError(
                    f"run.fsdp=true shards the language-model agents, but the loss's parameter {left[0]} is not "
                    "sharded (an agent that is not a language model): set run.fsdp=false"
                )
        #: Whether DDP sums the ranks' gradients (replicated agents under torchrun); it wraps the loss at the first pass.
        self.replicated = bool(dist.enabled and trained and not lockstep)
        self._replicas: nn.parallel.DistributedDataParallel | None = None

    def _wrapped(self) -> nn.parallel.DistributedDataParallel:
        """The loss under DDP, wrapped at the first pass: there every rank arrives together (rank 0 builds its trainer first)."""
        if self._replicas is None:
            # find_unused_parameters: a minibatch may hold no step of some agent (or of its value head).
            # broadcast_buffers=False: every rank takes the same steps, so the buffers stay equal.
            with self.dist.collective():  # DDP checks the parameters' shapes across the ranks and broadcasts rank 0's
                self._replicas = nn.parallel.DistributedDataParallel(
                    _TotalLoss(self.loss_module),
                    find_unused_parameters=True,
                    broadcast_buffers=False,
                    gradient_as_bucket_view=True,  # the gradients live in DDP's buckets: no second copy of them
                )
            self._replicas.register_comm_hook(None, _summed)
        return self._replicas

    def forward(self, sample: TensorDictBase, last: bool) -> tuple[TensorDictBase, torch.Tensor]:
        """The loss module's outputs on ``sample`` and their sum.

        ``last``: this is the rank's last pass of the window; under DDP its
        backward pass sums the window's gradients over the ranks (the others
        only accumulate).
        """
        if not self.replicated:
            losses = self.loss_module(sample)
            return losses, total_loss(losses)
        replicas = self._wrapped()
        with nullcontext() if last else replicas.no_sync():
            loss, losses = replicas(sample)
        return losses, loss

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        """``loss.backward()``; a rank that stopped during the sum of a last pass raises :class:`PeerFailure`."""
        with self.dist.collective() if last and self.replicated else nullcontext():
            loss.backward()

    def stand_ins(self, window: int) -> int:
        """Passes whose loss counts zero this rank adds at the end of a window of ``window`` minibatches (:func:`stand_in_count`)."""
        return stand_in_count(window, self.dist.rank, self.dist.world_size, self.lockstep, self.replicated)

    def is_last(self, position: int, window: int) -> bool:
        """Whether the ``position``-th minibatch of a window of ``window``, which this rank owns, is its last one there."""
        return is_last_owned(position, window, self.dist.world_size)


def stand_in_count(window: int, rank: int, world_size: int, lockstep: bool, replicated: bool) -> int:
    """Passes whose loss counts zero rank ``rank`` adds at the end of a window of ``window`` minibatches.

    Lockstep (FSDP2): as many as it lacks against the rank that runs most.
    Replicated under DDP: one if it owns no minibatch of the window (every
    rank must join the window's reduction). Otherwise none.
    """
    owned = len(range(rank, window, world_size))
    if lockstep:
        return -(-window // world_size) - owned
    return int(replicated and owned == 0)


def is_last_owned(position: int, window: int, world_size: int) -> bool:
    """Whether a rank's minibatch at ``position`` of a window of ``window`` is its last one (it owns every ``world_size``-th)."""
    return position + world_size >= window
