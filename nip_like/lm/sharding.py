"""FSDP2 for language-model agents under ``torchrun`` (``run.fsdp: true``).

With ``run.fsdp`` every LM agent's parameters, gradients and optimiser state
are sharded over the ranks by PyTorch's ``fully_shard`` (FSDP2): each decoder
layer is one unit (the classes the model lists in ``_no_split_modules``), the
rest of the model another, a value head's linear layer (and its own body, if
it has one) others. Each rank then holds ``1/N`` of every agent between the
collectives, as the update needs; the RL loop itself is unchanged:

* **The update** runs sharded: a unit's forward gathers its weights and its
  backward reduce-scatters its gradients, so every rank must run the same
  units the same number of times. The ranks already take whole minibatches in
  turn (:mod:`nip_like.distributed`); with FSDP they also run in lockstep
  (:attr:`~nip_like.lm.policy.LMPolicy.lockstep`): a rank left without a
  minibatch in a short last window, an agent without rows in a minibatch, or
  fewer scoring micro-batches than another rank, runs the same units on a
  stand-in row whose contribution is multiplied by zero. Gradients are summed
  over the ranks (divide factor 1, sum reductions: gloo has no pre-scaled
  sum), exactly as the replicated update sums them.
* **Sampling, evaluation and test** differ between ranks in how many forward
  passes they take (messages end at different tokens), so they run inside
  :meth:`ShardedAgents.gathered`: the weights are gathered once and kept whole
  until the phase ends, and the forwards take no collective.
* **Checkpoints** hold whole tensors (every rank gathers, rank 0 writes), so a
  checkpoint of a sharded run is the same file as a replicated one's.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterable, Iterator, Mapping

import torch
from torch import nn



def _dtensor_type() -> type:
    from torch.distributed.tensor import DTensor

    return DTensor


def is_sharded(tensor: Any) -> bool:
    """Whether ``tensor`` is a DTensor (a sharded parameter, gradient or optimiser state)."""
    return isinstance(tensor, torch.Tensor) and isinstance(tensor, _dtensor_type())


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: the modules whose class it names in ``_no_split_modules`` (as accelerate wraps them)."""
    names = set()
    for module in model.modules():
        names |= set(getattr(module, "_no_split_modules", None) or ())
    return [module for module in model.modules() if type(module).__name__ in names]


def shard_module(module: nn.Module, mesh) -> list[nn.Module]:
    """``fully_shard`` each decoder layer of ``module``, then ``module`` itself, over ``mesh``; return the units, outermost last."""
    from torch.distributed.fsdp import fully_shard

    units = []
    for layer in decoder_layers(module):
        fully_shard(layer, mesh=mesh)
        units.append(layer)
    fully_shard(module, mesh=mesh)
    units.append(module)
    for unit in units:
        unit.set_gradient_divide_factor(1.0)  # the ranks' gradients are summed, as the replicated update does
        unit.set_force_sum_reduction_for_comms(True)  # gloo has no pre-scaled sum
    return units


class ShardedAgents:
    """The FSDP2 units of the LM agents of a run, and the phases in which their weights are kept whole.

    Parameters
    ----------
    policies : Mapping[str, LMPolicy]
        The agents' live policies (not the reference's frozen copies), after
        the warm start and before the optimiser is built: sharding replaces
        their parameters.
    """

    def __init__(self, policies: Mapping[str, nn.Module]) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        self.policies = dict(policies)
        self.units: list[nn.Module] = []
        # One mesh of every rank, on the agents' device type (fully_shard's default would take the accelerator's).
        device = next(iter(self.policies.values())).banned.device
        mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
        sharded: set[int] = set()
        for policy in self.policies.values():
            if id(policy.model) not in sharded:  # a model that plays several roles (share_policy_with) is sharded once
                sharded.add(id(policy.model))
                self.units += shard_module(policy.model, mesh)
            head = policy.value_head
            if head is not None:
                if head.body is not None:
                    self.units += shard_module(head.body, mesh)
                self.units += shard_module(head.linear, mesh)
            policy.lockstep = True
            policy.sharded = True

    @contextmanager
    def gathered(self) -> Iterator[None]:
        """Keep every unit's weights whole inside the block: forwards take no collective (sampling, evaluation, test).

        Entering and leaving are collectives (every rank enters the same
        blocks); inside, the ranks may run different numbers of forwards.
        """
        for policy in self.policies.values():
            policy.lockstep = False
        for unit in self.units:
            unit.set_reshard_after_forward(False)
            unit.unshard()
        try:
            yield
        finally:
            for unit in self.units:
                unit.set_reshard_after_forward(True)
                unit.reshard()
            for policy in self.policies.values():
                policy.lockstep = True


def whole(value: Any) -> Any:
    """``value`` with every DTensor in it made whole (a collective: every rank calls it on the same structure)."""
    if is_sharded(value):
        return value.full_tensor()
    if isinstance(value, dict):
        return {key: whole(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(whole(item) for item in value)
    return value


def _shard_of(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's shard of the whole tensor ``value``, laid out as the DTensor ``like`` (no communication)."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(value.to(like.device), like.device_mesh, like.placements, src_data_rank=None)


def shard_like(state: Mapping[str, Any], template: Mapping[str, Any]) -> dict[str, Any]:
    """A whole-tensor ``state`` (a state dict) cut to ``template``'s shards where the template holds DTensors (no communication)."""
    cut = {}
    for key, value in state.items():
        like = template.get(key)
        if is_sharded(like) and isinstance(value, torch.Tensor) and not is_sharded(value):
            value = _shard_of(value, like)
        cut[key] = value
    return cut


def shard_optimizer_state(state: dict[str, Any], params: Iterable[nn.Parameter]) -> dict[str, Any]:
    """An optimiser state dict of whole tensors cut to the shards of its (sharded) parameters, in the optimiser's order."""
    ordered = list(params)
    per_param = {}
    for index, entries in state["state"].items():
        param = ordered[int(index)]
        if is_sharded(param):
            entries = {
                name: _shard_of(value, param) if isinstance(value, torch.Tensor) and value.shape == param.shape and value.dim() else value
                for name, value in entries.items()
            }
        per_param[index] = entries
    return {**state, "state": per_param}


def local_abs_max(param: torch.Tensor) -> torch.Tensor:
    """The largest magnitude of this rank's part of ``param`` (0 for an empty shard): reduce it over the ranks with max."""
    local = param.detach().to_local() if is_sharded(param) else param.detach()
    return local.abs().max() if local.numel() else local.new_zeros(())
