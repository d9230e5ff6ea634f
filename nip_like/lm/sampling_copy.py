"""Sampling with a bfloat16 copy of a language model's weights (``sampling_dtype: bfloat16``).

:func:`sampling_model` gives the model that samples: the model itself, or a
bfloat16 copy of it kept up to date with its parameters (the decoding loop of
:mod:`nip_like.lm.static_decoding` reads half the bytes per token). Scoring,
the optimiser and checkpoints never see the copy.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

#: The values of ``LMAgentConfig.sampling_dtype``: the model's own parameters, or a bfloat16 copy.
SAMPLING_DTYPES = ("model", "bfloat16")


@dataclass
class _SamplingCopy:
    """A bfloat16 copy of a model's parameters and the state of the parameters it was copied from."""

    model: nn.Module
    pairs: list[tuple[torch.Tensor, torch.Tensor]]
    state: tuple


#: The bfloat16 copy of each model that samples with one (two roles that play one model share it).
_COPIES: "weakref.WeakKeyDictionary[nn.Module, _SamplingCopy]" = weakref.WeakKeyDictionary()


#: Optimiser steps taken in this process (any optimiser): fused optimisers write parameters without moving their
#: version counters, so a step is counted by a global post-step hook, registered with the first bfloat16 copy.
_OPTIMIZER_STEPS = [0]
_STEP_HOOK: list = []


def _count_optimizer_steps() -> None:
    """Register, once, the post-step hook of every optimiser that counts steps in :data:`_OPTIMIZER_STEPS`."""
    if not _STEP_HOOK:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        def counted(optimizer, args, kwargs) -> None:
            _OPTIMIZER_STEPS[0] += 1

        _STEP_HOOK.append(register_optimizer_step_post_hook(counted))


def _parameter_state(parameters: Sequence[torch.Tensor]) -> tuple:
    """What changes when parameters are written: their version counters (in-place writes such as ``copy_``), their
    storages (replaced data) and the optimiser steps taken since (fused optimisers move no version counter)."""
    return (_OPTIMIZER_STEPS[0], tuple((parameter.data_ptr(), parameter._version) for parameter in parameters))


@torch.no_grad()
def sampling_model(model: nn.Module, dtype: str) -> nn.Module:
    """The model that samples: ``model`` itself, or (``dtype="bfloat16"``) its bfloat16 copy, up to date.

    The copy is a deep copy of ``model`` in eval mode whose floating-point
    parameters are bfloat16 (buffers are left as they are); it is made on the
    first call and its parameters are copied again from ``model``'s whenever
    one of those may have changed since: an optimiser stepped (any optimiser
    of the process), a parameter was written in place (its version counter
    moved; the opponent pool's snapshots, ``load_state_dict``) or its data
    replaced; a model whose parameters were replaced or added, or that moved
    to another device, is copied whole again. A model whose parameters are all bfloat16
    already is its own copy.
    """
    if dtype == "model":
        return model
    if dtype != "bfloat16":
        raise ValueError(f"sampling_dtype must be one of {SAMPLING_DTYPES}, got {dtype!r}")
    parameters = [parameter for parameter in model.parameters()]
    if all(parameter.dtype == torch.bfloat16 or not parameter.is_floating_point() for parameter in parameters):
        return model
    _count_optimizer_steps()
    state = _parameter_state(parameters)
    held = _COPIES.get(model)
    if held is not None and (
        len(held.pairs) != len(parameters)
        or any(source is not parameter or target.device != parameter.device
               for (source, target), parameter in zip(held.pairs, parameters))
    ):
        held = None  # parameters added or replaced (LoRA after the warm start), or the model moved: copy it again
    if held is None:
        memo: dict[int, Any] = {}
        duplicate = copy.deepcopy(model, memo)
        duplicate.eval()
        duplicate.requires_grad_(False)
        targets = list(duplicate.parameters())
        for target in targets:
            if target.is_floating_point():
                target.data = target.data.to(torch.bfloat16)
        held = _SamplingCopy(duplicate, list(zip(parameters, targets)), state)
        _COPIES[model] = held
        return duplicate
    if held.state != state:
        for source, target in held.pairs:
            target.copy_(source)
        held.state = state
    return held.model
