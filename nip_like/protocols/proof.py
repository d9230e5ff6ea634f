"""The base of interactive-proof protocols: turns, channels, decisions and rewards.

A verifier and one or more provers take turns; each step of an episode is one
turn, in which one or more agents act at once. The verifier may decide
(accept or reject) on any of its turns from ``min_rounds`` on and must decide
on its last turn within ``max_rounds`` steps. A message reaches every channel
its sender belongs to; an agent sees the messages of the channels it is in.
Each prover argues for one decision (``prover_sides``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nip_like.allowed import checked
from nip_like.errors import ConfigError
from nip_like.protocols.base import Protocol, ProtocolConfig

VERIFIER = "verifier"
#: Who may open a turn-based proof protocol.
FIRST_SPEAKERS = ("verifier", "prover")


@dataclass
class ProofRewardsConfig(ProtocolConfig):
    """Rewards of an interactive-proof protocol; all the options of one whose turns are fixed."""

    shared_reward: bool = False  # every agent gets the verifier's reward (cooperative)
    verifier_reward: float = checked(1.0)  # the verifier's reward for a correct decision
    verifier_incorrect_penalty: float = checked(0.0, ge=0)  # subtracted from the verifier's reward for a wrong decision
    verifier_continue_reward: float = checked(0.0)  # the verifier's reward for each turn it lets pass (small; negative = a cost)
    prover_reward: float = checked(1.0)  # a prover's reward when the verifier decides its side


@dataclass
class ProofTurnsConfig(ProofRewardsConfig):
    """An interactive-proof protocol whose turns repeat until the verifier decides (NIP, debate, MNIP, ...)."""

    min_rounds: int = checked(1, ge=1)  # the verifier may decide from this step on (1-based)
    max_rounds: int = checked(8, ge=1)  # the verifier must decide on its last turn within this many steps
    first_speaker: str = checked("verifier", choices=FIRST_SPEAKERS)  # verifier | prover: who opens


class ProofProtocol(Protocol):
    """A verifier and provers taking turns, with channels and prover sides.

    Subclasses set :attr:`agent_names`, :attr:`turns`, :attr:`prover_sides`
    and optionally :attr:`channels`. The keyword arguments are the fields of
    :class:`ProofTurnsConfig`.

    Parameters
    ----------
    name : str
        The protocol's name (``protocol.name``).
    shared_reward, verifier_reward, verifier_incorrect_penalty, verifier_continue_reward, prover_reward
        The rewards (see :meth:`step_rewards`).
    min_rounds : int
        The verifier may decide from this step on (1-based).
    max_rounds : int
        The verifier must decide on its last turn within this many steps.
    first_speaker : str
        ``"verifier"`` or ``"prover"``: who opens.
    """

    #: The repeating turn pattern, beginning with the verifier's turn: groups of agents acting together.
    turns: tuple[tuple[str, ...], ...] = ((VERIFIER,),)
    #: The decision each prover argues for: ``True`` accept, ``False`` reject.
    prover_sides: dict[str, bool] = {}
    #: Groups of agents sharing messages; ``None``: one public channel.
    channels: tuple[tuple[str, ...], ...] | None = None

    def __init__(
        self,
        name: str,
        *,
        shared_reward: bool = False,
        verifier_reward: float = 1.0,
        verifier_incorrect_penalty: float = 0.0,
        verifier_continue_reward: float = 0.0,
        prover_reward: float = 1.0,
        min_rounds: int = 1,
        max_rounds: int = 8,
        first_speaker: str = "verifier",
    ) -> None:
        super().__init__(name)
        if first_speaker not in FIRST_SPEAKERS:
            raise ConfigError(f"protocol.first_speaker must be one of {list(FIRST_SPEAKERS)}, got {first_speaker!r}")
        pattern = list(self.turns)
        if first_speaker == "prover" and len(pattern) > 1:
            pattern = pattern[1:] + pattern[:1]
        self.pattern = tuple(pattern)
        max_rounds = int(max_rounds)
        verifier_steps = [step for step in range(max_rounds) if VERIFIER in self.pattern[step % len(self.pattern)]]
        if max_rounds < 1 or not verifier_steps:
            raise ConfigError(
                f"protocol {name}: protocol.max_rounds ({max_rounds}) leaves the verifier no turn; "
                f"its turns repeat every {len(self.pattern)} steps"
            )
        self._num_rounds = verifier_steps[-1] + 1
        self.min_rounds = int(min_rounds)
        if not 1 <= self.min_rounds <= self._num_rounds:
            raise ConfigError(
                f"protocol.min_rounds must be between 1 and the episode length {self._num_rounds}, "
                f"got {self.min_rounds}"
            )
        self.shared_reward = bool(shared_reward)
        self.verifier_reward = float(verifier_reward)
        self.verifier_incorrect_penalty = float(verifier_incorrect_penalty)
        self.verifier_continue_reward = float(verifier_continue_reward)
        self.prover_reward = float(prover_reward)
        self.verifier_index = self.agent_index(VERIFIER)
        # (pattern length, agents): who acts in each step of the pattern.
        self._pattern_active = torch.tensor(
            [[agent in group for agent in self.agent_names] for group in self.pattern], dtype=torch.bool
        )
        self._sides = torch.tensor([self.prover_sides.get(agent, True) for agent in self.agent_names])

    # ------------------------------------------------------------- schedule
    @property
    def num_rounds(self) -> int:
        return self._num_rounds

    @property
    def leader_order(self) -> tuple[tuple[str, ...], ...] | None:
        """The verifier leads, the provers follow (``None`` without provers)."""
        provers = tuple(name for name in self.agent_names if name != VERIFIER)
        return ((VERIFIER,), provers) if provers else None

    def active_agents(self, round_index: torch.Tensor) -> torch.Tensor:
        table = self._pattern_active.to(round_index.device)
        return table[round_index.clamp(min=0) % len(self.pattern)]

    def may_decide(self, round_index: torch.Tensor) -> torch.Tensor:
        """Whether the verifier may accept or reject in this step."""
        active = self.active_agents(round_index)[..., self.verifier_index]
        return active & (round_index >= self.min_rounds - 1)

    def message_rounds(self) -> int:
        return self._num_rounds - 1

    def visibility(self) -> torch.Tensor:
        """``(num_agents, num_agents)`` booleans: entry ``[i, j]``, agent i sees agent j's messages."""
        if self.channels is None:
            return torch.ones(self.num_agents, self.num_agents, dtype=torch.bool)
        member = torch.tensor([[agent in channel for channel in self.channels] for agent in self.agent_names])
        return (member.float() @ member.float().T) > 0

    # ------------------------------------------------------------- rewards
    def step_rewards(
        self, decided: torch.Tensor, accept: torch.Tensor, label: torch.Tensor, verifier_acted: torch.Tensor
    ) -> torch.Tensor:
        """Per-agent rewards of one step.

        Parameters
        ----------
        decided : torch.Tensor
            ``(B,)``: the verifier accepted or rejected in this step.
        accept : torch.Tensor
            ``(B,)``: its decision was to accept (meaningful where ``decided``).
        label : torch.Tensor
            ``(B,)``: the right decision is to accept.
        verifier_acted : torch.Tensor
            ``(B,)``: the verifier had a turn in this step.

        Returns
        -------
        torch.Tensor
            ``(B, num_agents)`` floats. The verifier gets ``verifier_reward``
            for a correct decision, ``-verifier_incorrect_penalty`` for a wrong
            one and ``verifier_continue_reward`` for a turn it let pass; a
            prover gets ``prover_reward`` when the verifier decides its side.
            With ``shared_reward`` every agent gets the verifier's reward.
        """
        correct = accept == label
        verifier = torch.where(
            decided,
            torch.where(correct, self.verifier_reward, -self.verifier_incorrect_penalty),
            torch.where(verifier_acted, self.verifier_continue_reward, 0.0),
        )
        if self.shared_reward:
            return verifier.unsqueeze(-1).expand(-1, self.num_agents).clone()
        sides = self._sides.to(accept.device)
        provers = (decided.unsqueeze(-1) & (accept.unsqueeze(-1) == sides)).float() * self.prover_reward
        rewards = provers.clone()
        rewards[:, self.verifier_index] = verifier
        return rewards


class FixedTurnsProofProtocol(ProofProtocol):
    """A proof protocol whose episode is a fixed sequence of turns (one message, then the decision).

    Its options are the rewards alone (:class:`ProofRewardsConfig`): it has no
    round limits and no choice of first speaker to configure, so a config
    cannot set one and have it ignored.
    """

    #: Steps in an episode.
    fixed_rounds: int = 2
    #: Who opens.
    fixed_first_speaker: str = "prover"

    def __init__(self, name: str, **rewards: float) -> None:
        super().__init__(
            name, min_rounds=1, max_rounds=self.fixed_rounds, first_speaker=self.fixed_first_speaker, **rewards
        )
