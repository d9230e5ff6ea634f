"""Which parameters train stays as the agents set it, across torchrl's value estimators.

torchrl's advantage modules (GAE, TD(lambda), ...) compute value targets
inside ``hold_out_net(value_network)``, which reads ``requires_grad`` of the
network's *first* parameter only: when that one trains, it turns
``requires_grad`` off for every parameter on entry and back *on* for every
parameter on exit, frozen ones included. A frozen co-player
(``frozen_from``) or a LoRA agent's base would then count as trained from the
first advantage computation on: gradients computed for it, its weights
written into the checkpoints. :func:`requires_grad_kept` restores each
parameter's own flag.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from torch import nn

__all__ = ["requires_grad_kept"]


@contextmanager
def requires_grad_kept(module: nn.Module) -> Iterator[None]:
    """Run the block, then give every parameter of ``module`` back the ``requires_grad`` it had before.

    Parameters
    ----------
    module : nn.Module
        The module whose parameters' flags are kept (the loss module, which
        holds every agent's).
    """
    flags = [(param, param.requires_grad) for param in module.parameters()]
    try:
        yield
    finally:
        for param, flag in flags:
            if param.requires_grad != flag:
                param.requires_grad_(flag)
