"""Message channels that change with the step: the ``multi_channel_test`` protocol.

The proof protocols (:class:`~nip_like.protocols.proof.ProofProtocol`) give
each agent a fixed set of channels, and a message reaches every channel its
sender is in, so who reads a message depends on its sender alone
(:meth:`~nip_like.protocols.proof.ProofProtocol.visibility`). In the NIP
reference's ``multi_channel_test`` an agent speaks in a given channel at a given
step, and the same agent's messages of two steps can have two different
audiences. :func:`message_visibility` gives, for any protocol, who reads whose
message at each step, ``(T, M, M)``; a scenario that reads messages through it
(``image_classification``) plays both kinds.

``multi_channel_test`` rebuilds the reference's test protocol: three provers
and a verifier, and three channels,

* ``main``: every agent;
* ``prover0_verifier``: ``prover0`` and the verifier;
* ``prover_chat``: the three provers;

and a schedule that repeats every three steps (step ``t``, ``t mod 3``):

===========  ==========  ====================  ===========
``t mod 3``  ``main``    ``prover0_verifier``  ``prover_chat``
===========  ==========  ====================  ===========
0            prover1                           prover0
1            prover2     prover0               prover1
2            verifier    verifier              prover2
===========  ==========  ====================  ===========

An agent acts at most once a step, and its one message goes to the channels
it speaks in at that step (the verifier's, at ``t mod 3 = 2``, to ``main`` and
``prover0_verifier``). So ``prover0``'s messages of steps ``0, 3, ...`` reach
the provers only, and those of steps ``1, 4, ...`` the verifier only (and
``prover0`` itself). The verifier may decide on its turns from step
``min_rounds`` (1-based) on and must decide on its last turn within
``max_rounds`` steps; the reference's limits (2 and 8) are the defaults, so an
episode is the six steps up to the verifier's turn at step 5. As in the
reference the provers are not rewarded: only the verifier is, for a right
decision.

It is not a :class:`~nip_like.protocols.proof.ProofProtocol`, whose channels
cannot depend on the step: the scenarios that read one visibility per sender
(``graph_isomorphism``, ``duplicates``) refuse it in one line, as they refuse
any protocol that is not an interactive proof. It has no zero-knowledge
version.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nip_like.allowed import checked
from nip_like.errors import ConfigError
from nip_like.protocols.base import Protocol, ProtocolConfig
from nip_like.protocols.proof import VERIFIER
from nip_like.registry import register_protocol

#: The channels of ``multi_channel_test`` and their members.
CHANNELS: dict[str, tuple[str, ...]] = {
    "main": ("prover0", "prover1", "prover2", VERIFIER),
    "prover0_verifier": ("prover0", VERIFIER),
    "prover_chat": ("prover0", "prover1", "prover2"),
}

#: Who speaks in which channel at each step of the repeating schedule (step ``t`` plays entry ``t mod 3``).
SCHEDULE: tuple[dict[str, tuple[str, ...]], ...] = (
    {"main": ("prover1",), "prover_chat": ("prover0",)},
    {"main": ("prover2",), "prover0_verifier": ("prover0",), "prover_chat": ("prover1",)},
    {"main": (VERIFIER,), "prover0_verifier": (VERIFIER,), "prover_chat": ("prover2",)},
)


def message_visibility(protocol) -> torch.Tensor:
    """``(T, M, M)`` booleans: entry ``[t, i, j]``, agent ``i`` reads the message agent ``j`` sends at step ``t``.

    ``M`` counts the protocol's transcript agents (a zero-knowledge
    protocol's own agents, without the second verifier and the simulator).
    A protocol whose audiences change with the step gives its own
    (``step_visibility()``); for any other, every step has the protocol's
    :meth:`~nip_like.protocols.proof.ProofProtocol.visibility`.

    Parameters
    ----------
    protocol : Protocol
        A proof protocol, or one with ``step_visibility()`` such as :class:`MultiChannelTestProtocol`.
    """
    own = getattr(protocol, "step_visibility", None)
    if own is not None:
        return own()
    return protocol.visibility().unsqueeze(0).expand(protocol.num_rounds, -1, -1).clone()


@dataclass
class MultiChannelTestConfig(ProtocolConfig):
    """Options of ``multi_channel_test``: the verifier's rewards and its turn limits (the provers get nothing)."""

    shared_reward: bool = False  # every agent gets the verifier's reward
    verifier_reward: float = checked(1.0)  # the verifier's reward for a correct decision
    verifier_incorrect_penalty: float = checked(0.0, ge=0)  # subtracted from the verifier's reward for a wrong decision
    verifier_continue_reward: float = checked(0.0)  # the verifier's reward for each turn it lets pass
    min_rounds: int = checked(2, ge=1)  # the verifier may decide from this step on (1-based)
    max_rounds: int = checked(8, ge=3)  # the verifier must decide on its last turn within this many steps


@register_protocol("multi_channel_test", MultiChannelTestConfig)
class MultiChannelTestProtocol(Protocol):
    """The NIP reference's channel test: three provers and a verifier in three channels that change with the step.

    See the module docstring for the channels and the schedule. It offers
    what a proof scenario reads of a protocol (the verifier's index, its
    turns and decisions, the sides of the provers, the rewards), and
    :meth:`step_visibility` in place of a visibility per sender.

    Parameters
    ----------
    name : str
        The protocol's name.
    shared_reward, verifier_reward, verifier_incorrect_penalty, verifier_continue_reward
        The verifier's rewards (:meth:`step_rewards`).
    min_rounds, max_rounds : int
        The verifier may decide from step ``min_rounds`` (1-based) and must on
        its last turn within ``max_rounds`` steps.
    """

    agent_names = ("prover0", "prover1", "prover2", VERIFIER)
    #: The side each prover is shown arguing for in demonstrations; no prover is rewarded.
    prover_sides = {"prover0": True, "prover1": True, "prover2": True}

    def __init__(
        self,
        name: str,
        *,
        shared_reward: bool = False,
        verifier_reward: float = 1.0,
        verifier_incorrect_penalty: float = 0.0,
        verifier_continue_reward: float = 0.0,
        min_rounds: int = 2,
        max_rounds: int = 8,
    ) -> None:
        super().__init__(name)
        self.verifier_index = self.agent_index(VERIFIER)
        agents = self.agent_names
        # (pattern, agents): who acts; (pattern, sender, reader): who reads the sender's message.
        self._pattern_active = torch.tensor(
            [[any(agent in speakers for speakers in step.values()) for agent in agents] for step in SCHEDULE]
        )
        self._pattern_audience = torch.tensor(
            [
                [
                    [any(sender in step.get(channel, ()) and reader in members for channel, members in CHANNELS.items()) for reader in agents]
                    for sender in agents
                ]
                for step in SCHEDULE
            ]
        )
        max_rounds = int(max_rounds)
        verifier_steps = [step for step in range(max_rounds) if self._pattern_active[step % len(SCHEDULE), self.verifier_index]]
        if not verifier_steps:
            raise ConfigError(f"protocol.max_rounds ({max_rounds}) leaves the verifier no turn; its first is step 3")
        self._num_rounds = verifier_steps[-1] + 1
        self.min_rounds = int(min_rounds)
        if not 1 <= self.min_rounds <= self._num_rounds:
            raise ConfigError(
                f"protocol.min_rounds must be between 1 and the episode length {self._num_rounds}, got {self.min_rounds}"
            )
        self.shared_reward = bool(shared_reward)
        self.verifier_reward = float(verifier_reward)
        self.verifier_incorrect_penalty = float(verifier_incorrect_penalty)
        self.verifier_continue_reward = float(verifier_continue_reward)

    # ------------------------------------------------------------ schedule
    @property
    def num_rounds(self) -> int:
        return self._num_rounds

    @property
    def transcript_agent_names(self) -> tuple[str, ...]:
        """The agents whose messages make up the transcript: all of them."""
        return self.agent_names

    @property
    def prover_indices(self) -> list[int]:
        """Positions of the provers."""
        return [index for index, agent in enumerate(self.agent_names) if agent != VERIFIER]

    @property
    def leader_order(self) -> tuple[tuple[str, ...], ...]:
        """The verifier leads, the provers follow."""
        return ((VERIFIER,), tuple(self.agent_names[index] for index in self.prover_indices))

    def active_agents(self, round_index: torch.Tensor) -> torch.Tensor:
        """Who acts at each step: those who speak in some channel then."""
        table = self._pattern_active.to(round_index.device)
        return table[round_index.clamp(min=0) % len(SCHEDULE)]

    def may_decide(self, round_index: torch.Tensor) -> torch.Tensor:
        """Whether the verifier may accept or reject in this step."""
        return self.active_agents(round_index)[..., self.verifier_index] & (round_index >= self.min_rounds - 1)

    def step_visibility(self) -> torch.Tensor:
        """``(T, M, M)``: entry ``[t, i, j]``, agent ``i`` reads agent ``j``'s message of step ``t`` (see :func:`message_visibility`)."""
        steps = torch.arange(self._num_rounds) % len(SCHEDULE)
        return self._pattern_audience[steps].transpose(1, 2).clone()

    def channels_of(self, agent: str) -> list[str]:
        """The channels ``agent`` is a member of, in the order of :data:`CHANNELS`."""
        return [channel for channel, members in CHANNELS.items() if agent in members]

    # ------------------------------------------------------------- rewards
    def step_rewards(
        self, decided: torch.Tensor, accept: torch.Tensor, label: torch.Tensor, verifier_acted: torch.Tensor
    ) -> torch.Tensor:
        """``(B, 4)`` rewards of one step: the verifier's as in a proof protocol, none for the provers.

        The verifier gets ``verifier_reward`` for a right decision,
        ``-verifier_incorrect_penalty`` for a wrong one and
        ``verifier_continue_reward`` for a turn it let pass; with
        ``shared_reward`` every agent gets the verifier's reward.
        """
        verifier = torch.where(
            decided,
            torch.where(accept == label, self.verifier_reward, -self.verifier_incorrect_penalty),
            torch.where(verifier_acted, self.verifier_continue_reward, 0.0),
        )
        if self.shared_reward:
            return verifier.unsqueeze(-1).expand(-1, self.num_agents).clone()
        rewards = verifier.new_zeros(verifier.shape[0], self.num_agents)
        rewards[:, self.verifier_index] = verifier
        return rewards
