"""The protocol of adaptive stress testing: one auditor speaks in every turn of a conversation with a target.

The target is no agent of the protocol: it is part of the scenario's system
(:mod:`nip_like.scenarios.stress_test`), which answers each of the auditor's
utterances and rewards it. The protocol only says how many turns a
conversation lasts (``turns``, ASTRA-RL's ``tree_depth``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nip_like.allowed import checked
from nip_like.errors import ConfigError
from nip_like.protocols.base import Protocol, ProtocolConfig, refuse_zero_knowledge
from nip_like.registry import register_protocol

#: The one agent: the trained auditor.
AUDITOR = "auditor"


@dataclass
class StressTestProtocolConfig(ProtocolConfig):
    """A conversation of ``turns`` auditor utterances, each answered by the target."""

    name: str = "stress_test"  # protocol name
    turns: int = checked(3, ge=1)  # auditor utterances per conversation (the tree's depth); the target answers each
    zero_knowledge: bool = False  # not available here; true is refused


@register_protocol("stress_test", StressTestProtocolConfig)
class StressTestProtocol(Protocol):
    """The auditor acts in every round; an episode is ``turns`` rounds (see the module docstring).

    Parameters
    ----------
    name : str
        The protocol's name.
    turns : int
        Rounds of an episode, at least 1.
    zero_knowledge : bool
        Must be false.
    """

    agent_names = (AUDITOR,)

    def __init__(self, name: str = "stress_test", turns: int = 3, zero_knowledge: bool = False) -> None:
        super().__init__(name)
        refuse_zero_knowledge(name, zero_knowledge)
        if int(turns) < 1:
            raise ConfigError(f"protocol.turns must be at least 1, got {turns}")
        self.turns = int(turns)

    @property
    def num_rounds(self) -> int:
        return self.turns

    def active_agents(self, round_index: torch.Tensor) -> torch.Tensor:
        return torch.ones(*round_index.shape, 1, dtype=torch.bool, device=round_index.device)
