"""A torch function mode that records tensors created inside ``nip_like`` without a device.

Code that runs on a GPU must create every tensor on the device of the data it
meets: ``x.new_zeros(...)``, ``torch.zeros_like(x)``, ``torch.zeros(..., device=x.device)``.
A factory call without a device makes a CPU tensor, which works on the CPU and
fails on CUDA ("Expected all tensors to be on the same device"). CI has no GPU,
so :class:`DeviceGuard` finds those calls on the CPU: inside it, every torch
factory call made directly from a ``nip_like`` module without ``device=`` (and,
for ``torch.tensor`` / ``torch.as_tensor``, without a tensor to copy) is
recorded with its file and line, unless the module is in :data:`CPU_ON_PURPOSE`.
"""

from __future__ import annotations

import sys
from fnmatch import fnmatch
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

import nip_like

PACKAGE = Path(nip_like.__file__).resolve().parent
TORCH = Path(torch.__file__).resolve().parent

#: Factories that make a tensor from sizes or Python data: on the CPU unless told a device.
FACTORIES = {
    torch.zeros, torch.ones, torch.full, torch.empty, torch.arange, torch.linspace, torch.eye,
    torch.rand, torch.randn, torch.randint, torch.randperm, torch.tensor, torch.as_tensor,
}  # fmt: skip
#: Factories that copy their first argument's device when it is a tensor.
COPYING = {torch.tensor, torch.as_tensor}

#: Places in ``nip_like`` that build tensors on the CPU on purpose (``module:function``, shell patterns), and why.
CPU_ON_PURPOSE: dict[str, str] = {
    "scenarios/environment.py:_fresh_state": "states drawn with the environment's CPU generator, then moved to its device",
    "scenarios/*/environment.py:_new_state": "states drawn with the environment's CPU generator, then moved to its device",
    "scenarios/duplicates/environment.py:__init__": "lookup tables built once, then moved to the environment's device",
    "scenarios/duplicates/chat_view.py:moves": "parsed replies written element by element on the CPU, then moved",
    "protocols/proof.py:visibility": "a protocol's table; the environment moves it to its device",
    "scenarios/decisions.py:decision_metrics": "metrics counted on the CPU (Python floats out)",
    "scenarios/hidden_bits/scenario.py:optimal_rewards": "a closed-form bound as Python floats",
}


@dataclass
class DeviceGuard(TorchFunctionMode):
    """Record factory calls from ``nip_like`` without a device (see the module docstring)."""

    allowed: dict[str, str] = field(default_factory=lambda: dict(CPU_ON_PURPOSE))
    found: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            copies = func in COPYING and args and isinstance(args[0], torch.Tensor)
            if not copies:
                self._record(func)
        return func(*args, **kwargs)

    def _record(self, func) -> None:
        frame = sys._getframe(2)
        while frame is not None:
            path = Path(frame.f_code.co_filename)
            if path != Path(__file__) and not path.is_relative_to(TORCH):
                break
            frame = frame.f_back
        if frame is None:
            return
        path = Path(frame.f_code.co_filename).resolve()
        if not path.is_relative_to(PACKAGE):
            return
        place = f"{path.relative_to(PACKAGE)}:{frame.f_code.co_name}"
        if any(fnmatch(place, pattern) for pattern in self.allowed):
            return
        module = str(path.relative_to(PACKAGE))
        where = f"nip_like/{module}:{frame.f_lineno} ({frame.f_code.co_name}: torch.{func.__name__})"
        self.found[where] = self.found.get(where, 0) + 1
