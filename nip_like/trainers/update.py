"""The update, the second part of an RL iteration: the replay buffer, epochs x minibatches, optimiser steps.

Helpers of :meth:`~nip_like.trainers.rl.TensorDictRlTrainer.train_iteration`:
:func:`fill_buffer` puts the loss's layout of the batch in a replay buffer
(:func:`covering` makes its minibatches cover every item in every epoch),
:func:`optimise` runs the loss over it and steps the optimiser, and the
divergence guard stops a loss or parameters that left their bound with one
line naming where. A stop request that the update would keep from a safe point
for long stops it between two optimiser steps (:func:`update_stop_point`): the
update is dropped with the iteration, and the run resumes from its last
checkpoint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from tensordict import TensorDictBase
from torch.optim import Optimizer
from torchrl.data import LazyTensorStorage, SamplerWithoutReplacement, TensorDictReplayBuffer
from torchrl.data.replay_buffers.storages import Storage

from nip_like.distributed import Distributed
from nip_like.errors import ConfigError, TrainingError
from nip_like.interrupts import StopNow, stop_due, stop_point
from nip_like.lm.sharding import is_sharded, local_abs_max
from nip_like.objectives.contract import LossContract
from nip_like.trainers.data_parallel import LossPasses


#: The update, as a stop request in the middle of it is reported.
UPDATE_PHASE = "the update"


@dataclass(frozen=True)
class UpdateSettings:
    """The update's options, read once from the config (OmegaConf lookups are slow in the inner loop)."""

    num_epochs: int  # passes over the buffer per iteration (trainer.num_epochs)
    accumulation: int  # minibatches per optimiser step (trainer.optimizer.grad_accumulation_steps; see accumulation_steps)
    max_grad_norm: float | None  # gradient clipping per agent; None = none
    divergence_bound: float  # largest loss or parameter magnitude allowed (math.inf = none)


def fill_buffer(
    buffer: TensorDictReplayBuffer | None, data: TensorDictBase, minibatch_size: int, device: torch.device
) -> TensorDictReplayBuffer:
    """Empty ``buffer`` (or make one that fits) and fill it with ``data``; return it.

    One buffer item per element of the first batch dimension (a transition, a
    segment, a pair, a group: whatever the loss laid out). A layout smaller
    than a minibatch (preference pairs can be few) is one minibatch; an empty
    one leaves nothing to optimise.
    """
    size = data.batch_size[0]
    capacity = max(size, 1)  # a storage needs room for one item even when the layout is empty
    minibatch_size = min(minibatch_size, capacity)
    # An item's own dimensions may change between iterations (episodes padded to the longest one of the batch),
    # also those of its nested entries only (a preference pair's episodes).
    item_shape = tuple((key, tuple(value.shape[1:])) for key, value in data.items(include_nested=True, leaves_only=True))
    other_items = buffer is not None and getattr(buffer, "item_shape", item_shape) != item_shape
    if buffer is None or buffer.storage.max_size != capacity or buffer.batch_size != minibatch_size or other_items:
        buffer = TensorDictReplayBuffer(
            storage=LazyTensorStorage(capacity, device=device),
            sampler=SamplerWithoutReplacement(drop_last=True),
            batch_size=minibatch_size,
        )
        buffer.item_shape = item_shape  # what its storage holds, once filled
    buffer.empty()
    if size:
        buffer.extend(data)
    return buffer


class CoveringSampler(SamplerWithoutReplacement):
    """Minibatches without replacement that cover every item in every pass over the storage.

    Each pass is a random permutation of the ``n`` items cut into
    :meth:`minibatches` ``(n, batch_size)`` minibatches whose sizes differ by
    at most one (the first ones are the larger), where
    ``SamplerWithoutReplacement(drop_last=True)`` would leave ``n mod
    batch_size`` items out of the pass. The permutation is drawn as that
    sampler draws it (``torch.randperm`` from the global generator).
    """

    def __init__(self) -> None:
        super().__init__(drop_last=False)

    @staticmethod
    def minibatches(size: int, batch_size: int) -> int:
        """Minibatches per pass: the whole number nearest to ``size / batch_size`` (halves up), at least one."""
        return max(1, (2 * size + batch_size) // (2 * batch_size))

    def _single_sample(self, len_storage: int, batch_size: int) -> torch.Tensor:
        count = self.minibatches(len_storage, batch_size)
        drawn = len_storage - self._sample_list.numel()  # items of this pass already drawn
        small, larger = divmod(len_storage, count)  # the first `larger` minibatches hold one item more
        size = small + 1 if drawn < larger * (small + 1) else small
        index, self._sample_list = self._sample_list[:size], self._sample_list[size:]
        self.ran_out = self._sample_list.numel() == 0
        if self.ran_out:
            self._get_sample_list(storage=None, len_storage=len_storage, batch_size=batch_size)
        return index

    def can_sample(self, storage: Storage, batch_size: int) -> bool:
        return len(storage) > 0


def covering(buffer: TensorDictReplayBuffer) -> TensorDictReplayBuffer:
    """``buffer`` drawing its minibatches with a :class:`CoveringSampler` (the same storage, the same data).

    Minibatches of about ``buffer.batch_size`` items (:func:`minibatches_per_epoch`
    of them per epoch) that hold every item once per epoch. A buffer that
    already covers its items is returned as it is; :func:`fill_buffer` keeps
    the sampler where it reuses the buffer (a new one draws as usual).
    """
    if isinstance(buffer.sampler, CoveringSampler):
        return buffer
    covered = TensorDictReplayBuffer(storage=buffer.storage, sampler=CoveringSampler(), batch_size=buffer.batch_size)
    covered.item_shape = buffer.item_shape
    return covered


def minibatches_per_epoch(buffer: TensorDictReplayBuffer) -> int:
    """Minibatches in a pass over ``buffer``: whole ones of ``batch_size`` items, or as its :class:`CoveringSampler` cuts it."""
    if isinstance(buffer.sampler, CoveringSampler):
        return CoveringSampler.minibatches(len(buffer), buffer.batch_size)
    return len(buffer) // buffer.batch_size


def accumulation_steps(setting: int | None, world_size: int) -> int:
    """Minibatches per optimiser step: ``trainer.optimizer.grad_accumulation_steps``, or one per rank when it is null.

    The ranks of a torchrun run share each optimiser step's minibatches, a
    whole minibatch each (:func:`optimise`): left null, a step takes one
    minibatch per rank (one in one process), as one process does with
    ``grad_accumulation_steps`` set to the number of ranks.

    Parameters
    ----------
    setting : int or None
        The config's value; ``None`` (null) leaves the choice to the number of ranks.
    world_size : int
        The number of ranks.

    Raises
    ------
    ConfigError
        If ``setting`` is not a multiple of ``world_size`` (some rank would
        have no minibatch of a step to compute).
    """
    if setting is None:
        return world_size
    if setting % world_size:
        raise ConfigError(
            f"trainer.optimizer.grad_accumulation_steps ({setting}) must be a multiple of the number of ranks "
            f"({world_size}): the ranks share each optimiser step's minibatches; or leave it unset (null) for one "
            "minibatch per rank"
        )
    return setting


def accumulation_windows(num_minibatches: int, accumulation: int) -> list[int]:
    """For each minibatch, the length of its window: gradients of ``accumulation`` minibatches make one step.

    When the layout's size leaves a shorter last window, it steps on its own mean.
    """
    starts = range(0, num_minibatches, accumulation)
    windows = [min(accumulation, num_minibatches - start) for start in starts]
    return [length for length in windows for _ in range(length)]


def optimize(
    passes: LossPasses,
    buffer: TensorDictReplayBuffer,
    optimizer: Optimizer,
    trained: tuple[str, ...],
    settings: UpdateSettings,
    dist: Distributed,
    iteration: int,
    checkpoint_note: Callable[[], str],
) -> tuple[list[TensorDictBase], list[torch.Tensor]]:
    """``settings.num_epochs`` passes of the loss over ``buffer``, one optimiser step per window.

    Under torchrun every rank draws every minibatch (the same stream on each)
    and the ranks take a window's minibatches in turn; ``passes`` sums their
    gradients (:mod:`~nip_like.trainers.data_parallel`). Only the agents in
    ``trained`` step (the optimiser has one parameter group per agent).

    Parameters
    ----------
    passes : LossPasses
        The loss module's forward and backward passes.
    iteration : int
        The iteration (1-based), for an error's message.
    checkpoint_note : callable
        ``checkpoint_note()`` says, for an error's message, where the last checkpoint is.

    Returns
    -------
    (list of TensorDictBase, list of Tensor)
        The loss's output of every minibatch this rank ran (detached), and the
        trained agents' gradient norms at every step.
    """
    # Statistics stay tensors until the end of the iteration: converting
    # them per minibatch costs more than the bookkeeping is worth.
    num_minibatches = minibatches_per_epoch(buffer)
    window_of = accumulation_windows(num_minibatches, settings.accumulation)
    records, norms = [], []
    optimizer.zero_grad(set_to_none=True)
    for epoch in range(settings.num_epochs):
        position = 0
        for minibatch in range(num_minibatches):
            if position == 0 or not dist.enabled:  # under torchrun, between two steps (no gradient sum under way)
                update_stop_point(dist)
            sample = buffer.sample()  # every rank draws every minibatch: the same stream on each
            window = window_of[minibatch]
            if dist.owns(position):  # under torchrun, the ranks take a window's minibatches in turn
                last = passes.is_last(position, window)
                losses, loss = passes.forward(sample, last)
                if not loss.abs() <= settings.divergence_bound:  # also true for NaN
                    raise _loss_diverged(loss.item(), losses, iteration, epoch, minibatch, settings.divergence_bound, checkpoint_note)
                passes.backward(loss / window, last)
                records.append(losses.detach())
            position += 1
            if position == window:
                for _ in range(passes.stand_ins(window)):  # passes that count zero, so that every rank joins in
                    _, loss = passes.forward(sample, last=True)
                    passes.backward(loss * 0, last=True)
                norms.append(optimizer_step(optimizer, trained, settings.max_grad_norm))
                position = 0
    return records, norms


def update_stop_point(dist: Distributed) -> None:
    """Raise :class:`~nip_like.interrupts.StopNow` if a stop request is due (:func:`~nip_like.interrupts.stop_point`).

    :func:`optimise` calls it before each optimiser step's window of
    minibatches. Under torchrun the ranks decide together there (every rank
    has summed the last step's gradients): all of them stop before the same
    step, none is left waiting in a collective for one that stopped.
    """
    if not dist.enabled:
        stop_point(UPDATE_PHASE)
    elif dist.any(stop_due()):
        raise StopNow(UPDATE_PHASE, waiting=False)


def optimizer_step(optimizer: Optimizer, trained: tuple[str, ...], max_grad_norm: float | None) -> torch.Tensor:
    """Clip each trained agent's gradient, step, and return their norms (in ``trained`` order); drop the others' gradients.

    Under torchrun the gradients are already summed over the ranks (by DDP or FSDP2, in the backward pass).
    """
    norms = []
    for group in optimizer.param_groups:
        if group["agent"] not in trained:
            for param in group["params"]:
                param.grad = None
            continue
        grads = [param for param in group["params"] if param.grad is not None]
        if not grads:  # an agent that played no part in this window: torch's empty-list norm would be a CPU tensor
            first = group["params"][0]
            norms.append((first.to_local() if is_sharded(first) else first).new_zeros((), dtype=torch.float32))
            continue
        if max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(grads, max_grad_norm)
        else:
            norm = torch.nn.utils.get_total_norm([param.grad for param in grads])
        norm = norm.full_tensor() if is_sharded(norm) else norm
        norms.append(norm.float())
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return torch.stack(norms)


def update_statistics(
    records: list[TensorDictBase], contract: LossContract
) -> dict[str, float]:
    """The mean of every entry of the loss's outputs, named by the loss contract (``loss/policy``, ``agents/<a>/...``)."""
    if not records:
        return {}
    return {
        stat_name(key, contract): float(value.float().mean())
        for key, value in torch.stack(records).items(include_nested=True, leaves_only=True)
    }


def stat_name(key: str | tuple[str, ...], contract: LossContract) -> str:
    """The metric name of a loss output's key."""
    if isinstance(key, str):
        return contract.metric_name(key)
    if key[0] == "agents" and len(key) == 3:
        return f"agents/{key[1]}/{contract.metric_name(key[2])}"
    return "train/" + "/".join(key)


def check_parameters(
    optimizer: Optimizer,
    trained: tuple[str, ...],
    bound: float,
    iteration: int,
    checkpoint_note: Callable[[], str],
    dist: Distributed,
) -> None:
    """Stop if a trained agent's parameters left the divergence bound (or became non-finite)."""
    if not trained:
        return
    groups = [group for group in optimizer.param_groups if group["agent"] in trained]
    largest = torch.stack([torch.stack([local_abs_max(p) for p in g["params"]]).max() for g in groups])
    if any(is_sharded(p) for g in groups for p in g["params"]):  # each rank holds a part of a sharded agent
        largest = dist.maximum(largest.nan_to_num(math.inf))
    worst = int(largest.nan_to_num(math.inf).argmax())
    value = largest[worst].item()
    if not value <= bound:
        raise TrainingError(
            f"the parameters of agent {groups[worst]['agent']} reached magnitude {value:.4g} at iteration "
            f"{iteration}{bound_note(value, bound)}; {checkpoint_note()}"
        )


def bound_note(value: float, bound: float) -> str:
    """What to say of a finite ``value`` beyond ``bound`` (nothing for a non-finite one)."""
    if math.isfinite(value):
        return f", beyond trainer.divergence_bound={bound:g} (a lower learning rate may help)"
    return ""


def loss_terms(losses: TensorDictBase) -> str:
    """The loss terms of one minibatch, for a message: ``loss_objective=0.1, loss_critic=2``."""
    return ", ".join(f"{key}={float(value.detach()):.4g}" for key, value in losses.items() if key.startswith("loss_"))


def _loss_diverged(
    value: float,
    losses: TensorDictBase,
    iteration: int,
    epoch: int,
    minibatch: int,
    bound: float,
    checkpoint_note: Callable[[], str],
) -> TrainingError:
    what = f"became {value}" if not math.isfinite(value) else f"exploded to {value:.4g}"
    return TrainingError(
        f"the loss {what} at iteration {iteration}, epoch {epoch + 1}, "
        f"minibatch {minibatch + 1} ({loss_terms(losses)}){bound_note(value, bound)}; {checkpoint_note()}"
    )
