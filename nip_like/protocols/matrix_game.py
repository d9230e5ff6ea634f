"""The protocol of one-shot two-player matrix games: both players move at once, once."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nip_like.allowed import checked
from nip_like.errors import ConfigError
from nip_like.protocols.base import Protocol, ProtocolConfig, refuse_zero_knowledge
from nip_like.registry import register_protocol

#: The two players, in the order of the agent dimension.
PLAYERS = ("row", "column")
#: Who may lead: nobody, or one of the players.
LEADERS = ("none", *PLAYERS)


@dataclass
class MatrixGameProtocolConfig(ProtocolConfig):
    """A one-shot game between a row and a column player."""

    name: str = "matrix_game"  # protocol name
    leader: str = checked("none", choices=LEADERS)  # none | row | column: who leads (for trainers with leaders and followers)
    zero_knowledge: bool = False  # not available here (the interactive-proof protocols have it); true is refused


@register_protocol("matrix_game", MatrixGameProtocolConfig)
class MatrixGameProtocol(Protocol):
    """Both players choose an action in the one and only round; the payoff table rewards them.

    The rewards come from the scenario's payoff table
    (:mod:`nip_like.scenarios.matrix_game`), not from a verifier's decision.
    With ``leader: row`` (or ``column``) that player leads and the other
    follows (:attr:`leader_order`), as in a Stackelberg game; by default
    neither does.

    Parameters
    ----------
    name : str
        The protocol's name.
    leader : str
        ``"none"``, ``"row"`` or ``"column"``.
    zero_knowledge : bool
        Must be false: a matrix game has no zero-knowledge version.
    """

    agent_names = PLAYERS

    def __init__(self, name: str = "matrix_game", leader: str = "none", zero_knowledge: bool = False) -> None:
        super().__init__(name)
        refuse_zero_knowledge(name, zero_knowledge)
        if leader not in LEADERS:
            raise ConfigError(f"protocol.leader must be one of {list(LEADERS)}, got {leader!r}")
        self.leader = leader

    @property
    def num_rounds(self) -> int:
        return 1

    def active_agents(self, round_index: torch.Tensor) -> torch.Tensor:
        return torch.ones(*round_index.shape, len(PLAYERS), dtype=torch.bool, device=round_index.device)

    @property
    def leader_order(self) -> tuple[tuple[str, ...], ...] | None:
        """``((leader,), (follower,))``, or ``None`` when nobody leads."""
        if self.leader == "none":
            return None
        follower = next(name for name in PLAYERS if name != self.leader)
        return ((self.leader,), (follower,))
