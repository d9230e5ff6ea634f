"""The base of interactive-proof protocols: turns, channels, decisions and rewards.

A verifier and one or more provers take turns; each step of an episode is one
turn, in which one or more agents act at once. The verifier may decide
(accept or reject) on any of its turns from ``min_rounds`` on and must decide
on its last turn within ``max_rounds`` steps. A message reaches every channel
its sender belongs to; an agent sees the messages of the channels it is in.
Each prover argues for one decision (``prover_sides``). With
``zero_knowledge: true`` a protocol with provers gets a second verifier and a
simulator (:mod:`nip_like.protocols.zero_knowledge`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torchrl.data import Binary

from nip_like.allowed import checked
from nip_like.errors import ConfigError
from nip_like.protocols.base import Protocol, ProtocolConfig, zero_knowledge_protocols
from nip_like.protocols.zero_knowledge import (
    ADVERSARIAL_KEY,
    ADVERSARIAL_VERIFIER,
    SIMULATOR,
    ZERO_KNOWLEDGE_AGENTS,
    simulator_distance,
    zero_knowledge_rewards,
)

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
    zero_knowledge: bool = False  # add a second verifier and a simulator (the zero-knowledge version; protocols with a prover)
    zk_simulator_reward: float = checked(1.0, gt=0)  # c_z: per step, the second verifier gets c_z * d and the simulator -c_z * d (d: their distance)
    zk_prover_reward: float = checked(1.0, ge=0)  # c_p: per step of the second verifier's episodes, each prover gets -c_p * d
    zk_adversarial_share: float = checked(0.5, gt=0, lt=1)  # share of episodes in which the second verifier takes the verifier's place


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
    zero_knowledge : bool
        Add the second verifier and the simulator after the protocol's own
        agents (:mod:`nip_like.protocols.zero_knowledge`); a protocol without
        provers refuses it.
    zk_simulator_reward, zk_prover_reward : float
        ``c_z`` and ``c_p`` of :meth:`zero_knowledge_rewards`.
    zk_adversarial_share : float
        The probability that an episode is the second verifier's.
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
        zero_knowledge: bool = False,
        zk_simulator_reward: float = 1.0,
        zk_prover_reward: float = 1.0,
        zk_adversarial_share: float = 0.5,
    ) -> None:
        super().__init__(name)
        self._set_zero_knowledge(
            bool(zero_knowledge), float(zk_simulator_reward), float(zk_prover_reward), float(zk_adversarial_share)
        )
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
        # (pattern length, agents): who acts in each step of the pattern. The second verifier and the
        # simulator may act whenever the verifier may (which of them does is drawn per episode).
        self._pattern_active = torch.tensor(
            [[self._role(agent) in group for agent in self.agent_names] for group in self.pattern], dtype=torch.bool
        )
        self._sides = torch.tensor([self.prover_sides.get(agent, True) for agent in self.transcript_agent_names])

    # ------------------------------------------------------ zero knowledge
    def _set_zero_knowledge(
        self, zero_knowledge: bool, simulator_reward: float, prover_reward: float, adversarial_share: float
    ) -> None:
        own = type(self).agent_names
        if zero_knowledge and not self.can_be_zero_knowledge:
            raise ConfigError(
                f"protocol {self.name} cannot be made zero-knowledge (it has no prover); "
                f"protocol.zero_knowledge=true needs one of {zero_knowledge_protocols()}"
            )
        defaults = {field.name: field.default for field in dataclasses.fields(ProofRewardsConfig)}
        given = {"zk_simulator_reward": simulator_reward, "zk_prover_reward": prover_reward, "zk_adversarial_share": adversarial_share}
        ignored = [key for key, value in given.items() if value != defaults[key]]
        if ignored and not zero_knowledge:
            raise ConfigError(f"protocol.{ignored[0]} is set but protocol.zero_knowledge is false; set both or neither")
        if not 0 < adversarial_share < 1:
            raise ConfigError(f"protocol.zk_adversarial_share must be in (0, 1), got {adversarial_share}")
        self.zero_knowledge = zero_knowledge
        self.zk_simulator_reward = simulator_reward
        self.zk_prover_reward = prover_reward
        self.zk_adversarial_share = adversarial_share
        if zero_knowledge:
            # An instance attribute: the class keeps the base protocol's agents.
            self.agent_names = (*own, *ZERO_KNOWLEDGE_AGENTS)

    @classmethod
    def _has_provers(cls) -> bool:
        return any(agent != VERIFIER for agent in cls.agent_names)

    @classmethod
    def has_zero_knowledge_version(cls) -> bool:
        """Whether ``zero_knowledge: true`` is allowed: the protocol has a prover whose knowledge could leak."""
        return cls._has_provers()

    @property
    def can_be_zero_knowledge(self) -> bool:
        """Whether ``zero_knowledge: true`` is allowed on this protocol (:meth:`has_zero_knowledge_version`)."""
        return self.has_zero_knowledge_version()

    @property
    def transcript_agent_names(self) -> tuple[str, ...]:
        """The agents whose messages make up the transcript: the protocol's own, without the added two.

        In a second verifier's episode its messages take the verifier's place
        in the transcript; the simulator's messages are kept apart.
        """
        return type(self).agent_names

    def _role(self, agent: str) -> str:
        """The transcript agent whose turns ``agent`` takes: the verifier's for the added two."""
        return VERIFIER if agent in ZERO_KNOWLEDGE_AGENTS else agent

    @property
    def adversarial_index(self) -> int:
        """Position of the second verifier (zero-knowledge protocols only)."""
        return self.agent_index(ADVERSARIAL_VERIFIER)

    @property
    def simulator_index(self) -> int:
        """Position of the simulator (zero-knowledge protocols only)."""
        return self.agent_index(SIMULATOR)

    @property
    def prover_indices(self) -> list[int]:
        """Positions of the provers."""
        return [index for index, agent in enumerate(self.transcript_agent_names) if agent != VERIFIER]

    def simulator_distance(self, logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``(B,)``: :func:`~nip_like.protocols.zero_knowledge.simulator_distance` of a step's logits and masks."""
        return simulator_distance(logits, mask, self.adversarial_index, self.simulator_index)

    def zero_knowledge_rewards(
        self, rewards: torch.Tensor, adversarial: torch.Tensor, distance: torch.Tensor
    ) -> torch.Tensor:
        """``(B, N)``: :func:`~nip_like.protocols.zero_knowledge.zero_knowledge_rewards` with this protocol's coefficients."""
        return zero_knowledge_rewards(
            rewards,
            adversarial,
            distance,
            self.adversarial_index,
            self.simulator_index,
            self.prover_indices,
            self.zk_simulator_reward,
            self.zk_prover_reward,
        )

    # ------------------------------------------------------------- schedule
    @property
    def num_rounds(self) -> int:
        return self._num_rounds

    @property
    def leader_order(self) -> tuple[tuple[str, ...], ...] | None:
        """The verifier leads, the provers follow (``None`` without provers).

        In a zero-knowledge protocol the second verifier follows the provers
        and the simulator follows it, in the order of the quantifiers of
        zero knowledge (the provers are fixed before any second verifier, and
        a simulator is chosen for each second verifier).
        """
        provers = tuple(name for name in self.transcript_agent_names if name != VERIFIER)
        if not provers:
            return None
        if self.zero_knowledge:
            return ((VERIFIER,), provers, (ADVERSARIAL_VERIFIER,), (SIMULATOR,))
        return ((VERIFIER,), provers)

    def active_agents(self, round_index: torch.Tensor) -> torch.Tensor:
        """Who may act in each round; in a zero-knowledge protocol the added two may whenever the verifier may."""
        table = self._pattern_active.to(round_index.device)
        return table[round_index.clamp(min=0) % len(self.pattern)]

    def turns_in(self, state) -> torch.Tensor:
        """Who acts in each episode of ``state``, before the verifier's place is given to the second verifier.

        The hook of protocols whose turns depend on the episode (a randomly
        drawn speaker); by default the round's :meth:`active_agents`.
        """
        return self.active_agents(state["round"])

    def active_agents_in(self, state) -> torch.Tensor:
        """``(B, N)``: :meth:`turns_in`; in a zero-knowledge protocol, the verifier's turns go to the second
        verifier and the simulator in the second verifier's episodes, and to the verifier alone in the others."""
        active = self.turns_in(state)
        if not self.zero_knowledge:
            return active
        active = active.clone()
        adversarial = state[ADVERSARIAL_KEY]
        verifier_turn = active[..., self.verifier_index].clone()
        active[..., self.verifier_index] = verifier_turn & ~adversarial
        active[..., self.adversarial_index] = verifier_turn & adversarial
        active[..., self.simulator_index] = verifier_turn & adversarial
        return active

    def state_spec(self, batch: torch.Size, device: torch.device) -> dict[str, object]:
        """``adversarial`` (whether the episode is the second verifier's) in a zero-knowledge protocol."""
        if not self.zero_knowledge:
            return {}
        return {ADVERSARIAL_KEY: Binary(shape=batch, dtype=torch.bool, device=device)}

    def initial_state(self, num_episodes: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """Draw, in a zero-knowledge protocol, which episodes are the second verifier's."""
        if not self.zero_knowledge:
            return {}
        return {ADVERSARIAL_KEY: torch.rand(num_episodes, generator=generator) < self.zk_adversarial_share}

    def may_decide(self, round_index: torch.Tensor) -> torch.Tensor:
        """Whether the verifier may accept or reject in this step."""
        active = self.active_agents(round_index)[..., self.verifier_index]
        return active & (round_index >= self.min_rounds - 1)

    def message_rounds(self) -> int:
        return self._num_rounds - 1

    def visibility(self) -> torch.Tensor:
        """``(M, M)`` booleans over the :attr:`transcript_agent_names`: entry ``[i, j]``, agent i sees agent j's messages.

        The second verifier sees what the verifier would in its place, and the
        simulator its own messages alone (the scenario shows them so).
        """
        agents = self.transcript_agent_names
        if self.channels is None:
            return torch.ones(len(agents), len(agents), dtype=torch.bool)
        member = torch.tensor([[agent in channel for channel in self.channels] for agent in agents])
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
            With ``shared_reward`` every agent of the transcript gets the
            verifier's reward. The second verifier and the simulator get
            nothing here (see :meth:`zero_knowledge_rewards`).
        """
        correct = accept == label
        verifier = torch.where(
            decided,
            torch.where(correct, self.verifier_reward, -self.verifier_incorrect_penalty),
            torch.where(verifier_acted, self.verifier_continue_reward, 0.0),
        )
        transcript = len(self.transcript_agent_names)
        rewards = verifier.new_zeros(verifier.shape[0], self.num_agents)
        if self.shared_reward:
            rewards[:, :transcript] = verifier.unsqueeze(-1)
            return rewards
        sides = self._sides.to(accept.device)
        rewards[:, :transcript] = (decided.unsqueeze(-1) & (accept.unsqueeze(-1) == sides)).float() * self.prover_reward
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

    def __init__(self, name: str, **options: float) -> None:
        super().__init__(
            name, min_rounds=1, max_rounds=self.fixed_rounds, first_speaker=self.fixed_first_speaker, **options
        )
