"""The interaction-protocol base: who speaks when, and who is rewarded."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from omegaconf import MISSING
from tensordict import TensorDictBase


@dataclass
class ProtocolConfig:
    """Base of the protocol schemas; ``name`` selects the registered protocol."""

    name: str = MISSING  # registered protocol name, or dotted path module.Class


class Protocol(ABC):
    """An interaction protocol between a fixed set of agents.

    A protocol says which agents act in each round, how many rounds an episode
    lasts, and in which round the verifier decides. Scenarios interpret what an
    action means (a message, a decision); the protocol only schedules them.

    A protocol is built from its schema's fields (``Protocol(**options)``):
    the constructor of each registered protocol takes exactly the fields of the
    schema it is registered with.

    Parameters
    ----------
    name : str
        The name the protocol was selected by (``protocol.name``), for messages.
    """

    #: Names of the agents, in the order of the agent dimension.
    agent_names: tuple[str, ...] = ()
    #: Whether the protocol has the second verifier and the simulator of a zero-knowledge protocol
    #: (:mod:`nip_like.protocols.zero_knowledge`); a scenario that cannot play one refuses it.
    zero_knowledge: bool = False

    def __init__(self, name: str) -> None:
        self.name = name

    @classmethod
    def has_zero_knowledge_version(cls) -> bool:
        """Whether ``zero_knowledge: true`` may be set on this protocol (no by default; the proof protocols with a prover)."""
        return False

    @property
    def num_agents(self) -> int:
        """Number of agents."""
        return len(self.agent_names)

    def agent_index(self, name: str) -> int:
        """Return the position of agent ``name`` in the agent dimension."""
        return self.agent_names.index(name)

    @property
    def leader_order(self) -> tuple[tuple[str, ...], ...] | None:
        """Who leads whom, for trainers in which leaders account for how their followers learn.

        Groups of agents, leaders first: every agent of a group leads the
        agents of all later groups and follows those of earlier ones. ``None``
        (the default) declares no leaders and followers; the interactive-proof
        protocols let the verifier lead the provers, and a protocol may
        declare its own order by overriding this property. The groups hold
        every agent once (:func:`check_leader_order`).
        """
        return None

    @property
    @abstractmethod
    def num_rounds(self) -> int:
        """Number of rounds (environment steps) in an episode."""

    @abstractmethod
    def active_agents(self, round_index: torch.Tensor) -> torch.Tensor:
        """Return which agents act in each round.

        Parameters
        ----------
        round_index : torch.Tensor
            Integer tensor of any shape ``S`` holding round numbers.

        Returns
        -------
        torch.Tensor
            Boolean tensor of shape ``(*S, num_agents)``.
        """

    def active_agents_in(self, state: TensorDictBase) -> torch.Tensor:
        """Who acts in each episode of ``state`` (``(B, num_agents)`` booleans).

        By default this depends on the round only; a protocol whose turns
        depend on the episode (a randomly drawn speaker) overrides it.
        """
        return self.active_agents(state["round"])

    def state_spec(self, batch: torch.Size, device: torch.device) -> dict[str, object]:
        """Specs of the protocol's own entries under ``"state"`` (none by default)."""
        return {}

    def initial_state(self, num_episodes: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """The protocol's own state entries for new episodes (none by default)."""
        return {}

    def decision_round(self, round_index: torch.Tensor) -> torch.Tensor:
        """Return a boolean tensor: is the verifier deciding in this round?"""
        return round_index == self.num_rounds - 1

    def message_rounds(self) -> int:
        """Number of rounds in which messages are sent before the decision."""
        return self.num_rounds - 1

    def rewards(self, verifier_correct: torch.Tensor) -> torch.Tensor:
        """Turn the verifier's correctness into per-agent rewards.

        Parameters
        ----------
        verifier_correct : torch.Tensor
            Float tensor of shape ``B``: 1 where the verifier decided correctly.

        Returns
        -------
        torch.Tensor
            Float tensor of shape ``(*B, num_agents)``.
        """
        return verifier_correct.unsqueeze(-1).expand(*verifier_correct.shape, self.num_agents).clone()


def check_leader_order(order: tuple[tuple[str, ...], ...], agent_names: tuple[str, ...]) -> None:
    """Refuse a leader order that is not a split of ``agent_names`` into at least two non-empty groups.

    Parameters
    ----------
    order : tuple of tuple of str
        Groups of agents, leaders first (:attr:`Protocol.leader_order`).
    agent_names : tuple of str
        The protocol's agents.

    Raises
    ------
    ValueError
        Naming what is wrong.
    """
    listed = [name for group in order for name in group]
    if len(order) < 2 or any(not group for group in order):
        raise ValueError(f"a leader order needs at least two non-empty groups, got {order}")
    if sorted(listed) != sorted(agent_names):
        raise ValueError(f"a leader order must list every agent {list(agent_names)} once, got {order}")


def refuse_zero_knowledge(protocol: str, zero_knowledge: bool) -> None:
    """Refuse ``zero_knowledge: true`` on a protocol that has no zero-knowledge version, naming those that have.

    Parameters
    ----------
    protocol : str
        The protocol's name.
    zero_knowledge : bool
        The option's value.

    Raises
    ------
    ConfigError
        If ``zero_knowledge`` is true.
    """
    if zero_knowledge:
        from nip_like.errors import ConfigError

        raise ConfigError(
            f"protocol {protocol} cannot be made zero-knowledge; "
            f"protocol.zero_knowledge=true needs one of {zero_knowledge_protocols()}"
        )


def zero_knowledge_protocols() -> list[str]:
    """The registered protocols that ``zero_knowledge: true`` can be set on (:meth:`Protocol.has_zero_knowledge_version`)."""
    from nip_like.registry import PROTOCOLS

    return [name for name in PROTOCOLS.names() if PROTOCOLS.get(name).has_zero_knowledge_version()]
