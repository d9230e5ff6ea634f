"""The loss passes of the update: plain in one process; which passes a rank adds under torchrun."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torchrl.objectives import LossModule

from nip_like.distributed import Distributed
from nip_like.trainers.data_parallel import LossPasses, is_last_owned, stand_in_count, total_loss


class _Squares(LossModule):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor([1.0, 2.0]))

    def forward(self, sample):
        value = (self.weight * sample["x"]).sum()
        return TensorDict({"loss_a": value**2, "loss_b": value, "entropy": value.detach()}, [])


def test_one_process_runs_the_loss_module_itself_and_sums_its_loss_terms():
    module = _Squares()
    passes = LossPasses(module, Distributed(), lockstep=False)
    losses, loss = passes.forward(TensorDict({"x": torch.tensor([1.0, 1.0])}, []), last=True)
    assert loss.item() == 9.0 + 3.0 == total_loss(losses).item()  # the loss_* entries, not the entropy
    passes.backward(loss, last=True)
    assert module.weight.grad.tolist() == [7.0, 7.0]  # 2 * 3 + 1 for each weight
    assert passes.stand_ins(1) == 0 and passes.is_last(0, 1)


@pytest.mark.parametrize(
    ("window", "world_size", "lockstep", "expected"),
    [
        (4, 2, False, [0, 0]),  # every rank owns two: no stand-ins
        (1, 2, False, [0, 1]),  # a short last window: rank 1 owns none and joins DDP's reduction once
        (1, 3, False, [0, 1, 1]),
        (3, 2, False, [0, 0]),  # rank 1 owns one, rank 0 two: DDP needs one reduction each, no stand-in
        (3, 2, True, [0, 1]),  # FSDP2 in lockstep: as many passes as the rank that runs most
        (1, 3, True, [0, 1, 1]),
    ],
)
def test_a_rank_adds_stand_ins_only_where_it_would_miss_a_collective(window, world_size, lockstep, expected):
    assert [stand_in_count(window, rank, world_size, lockstep, replicated=True) for rank in range(world_size)] == expected
    assert stand_in_count(window, 0, world_size, lockstep, replicated=False) == (expected[0] if lockstep else 0)


def test_the_last_owned_pass_of_a_window_is_the_one_that_sums():
    dist = Distributed(rank=1, world_size=2)
    owned = [position for position in range(5) if dist.owns(position)]
    assert owned == [1, 3]
    assert [is_last_owned(position, 5, dist.world_size) for position in owned] == [False, True]
    assert [is_last_owned(position, 4, 2) for position in (0, 2)] == [False, True]
