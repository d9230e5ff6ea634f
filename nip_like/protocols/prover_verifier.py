"""The prover-verifier protocol of the hidden-bits scenario."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nip_like.allowed import checked
from nip_like.errors import ConfigError
from nip_like.protocols.base import Protocol, ProtocolConfig, refuse_zero_knowledge
from nip_like.registry import register_protocol


@dataclass
class ProverVerifierConfig(ProtocolConfig):
    """A prover sends messages for some rounds, then the verifier decides."""

    name: str = "prover_verifier"  # protocol name
    message_rounds: int = checked(2, ge=1)  # rounds in which the prover speaks before the verifier decides
    shared_reward: bool = True  # the prover is rewarded when the verifier is right (cooperative)
    zero_knowledge: bool = False  # not available here (the interactive-proof protocols have it); true is refused


@register_protocol("prover_verifier", ProverVerifierConfig)
class ProverVerifierProtocol(Protocol):
    """The prover speaks for ``message_rounds`` rounds, then the verifier decides.

    With ``shared_reward`` the prover gets the verifier's reward (a cooperative
    game, as in the hidden-bits scenario); without it the prover gets nothing,
    which isolates what the verifier can learn on its own. It has no
    zero-knowledge version (``zero_knowledge`` must be false).
    """

    agent_names = ("prover", "verifier")

    def __init__(
        self, name: str = "prover_verifier", message_rounds: int = 2, shared_reward: bool = True, zero_knowledge: bool = False
    ) -> None:
        super().__init__(name)
        refuse_zero_knowledge(name, zero_knowledge)
        if message_rounds < 1:
            raise ConfigError(f"protocol.message_rounds must be at least 1, got {message_rounds}")
        # Plain values: the environment asks for them at every step.
        self._num_rounds = int(message_rounds) + 1
        self._shared_reward = bool(shared_reward)

    @property
    def num_rounds(self) -> int:
        return self._num_rounds

    @property
    def leader_order(self) -> tuple[tuple[str, ...], ...]:
        """The verifier leads, the prover follows."""
        return (("verifier",), ("prover",))

    def active_agents(self, round_index: torch.Tensor) -> torch.Tensor:
        deciding = self.decision_round(round_index)
        return torch.stack([~deciding, deciding], dim=-1)

    def rewards(self, verifier_correct: torch.Tensor) -> torch.Tensor:
        prover = verifier_correct if self._shared_reward else torch.zeros_like(verifier_correct)
        return torch.stack([prover, verifier_correct], dim=-1)
