"""Float32 regions inside ``run.autocast_dtype``.

``torch.autocast`` runs matrix products, linear layers and convolutions in the
autocast dtype, also where their inputs are float32. That is what makes the
models' passes fast, but a few small computations of the update are estimates
that bfloat16's 8-bit mantissa (about 3 significant digits) spoils: the value
head, the discounted sums of GAE (a ``conv1d`` in TorchRL) and the linear
algebra of the learning-aware corrections. They run inside
:func:`float32_region`, which switches autocast off for the block.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch


def float32_region(device: torch.device | str) -> AbstractContextManager:
    """A context in which autocast is off on ``device``'s type (a no-op where autocast does not exist, such as ``meta``)."""
    device_type = torch.device(device).type
    if not torch.amp.is_autocast_available(device_type):
        return nullcontext()
    return torch.autocast(device_type=device_type, enabled=False)
