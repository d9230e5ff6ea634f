"""The interactive-proof protocols of the NIP paper (Hammond and Adam-Day, 2025).

Each is a :class:`~nip_like.protocols.proof.ProofProtocol`: a turn pattern, the
sides the provers argue for and, for MNIP, private channels.
"""

from __future__ import annotations

import torch
from torchrl.data import Unbounded

from dataclasses import dataclass

from nip_like.allowed import checked
from nip_like.errors import ConfigError
from nip_like.protocols.proof import (
    VERIFIER,
    FixedTurnsProofProtocol,
    ProofProtocol,
    ProofRewardsConfig,
    ProofTurnsConfig,
)
from nip_like.registry import register_protocol

SPEAKER_KEY = "speaker"


@register_protocol("nip", ProofTurnsConfig)
class NipProtocol(ProofProtocol):
    """Neural interactive proof: the verifier and one prover alternate.

    The prover argues for acceptance. With ``first_speaker: prover`` the prover
    opens.
    """

    agent_names = ("prover", VERIFIER)
    turns = ((VERIFIER,), ("prover",))
    prover_sides = {"prover": True}


@register_protocol("adp", ProofRewardsConfig)
class AdpProtocol(FixedTurnsProofProtocol):
    """Abstract decision problem: the prover sends one message, then the verifier decides.

    Always two steps; its options are the rewards alone.
    """

    agent_names = ("prover", VERIFIER)
    turns = ((VERIFIER,), ("prover",))
    prover_sides = {"prover": True}


@dataclass
class TwoProverTurnsConfig(ProofTurnsConfig):
    """Options of debate and MNIP: those of :class:`ProofTurnsConfig` and the order of the two provers."""

    sequential: bool = False  # the provers speak one after the other, each in its own step (false: both at once)
    prover0_first: bool = True  # with sequential: prover0 speaks before prover1 (false: prover1 first)


class TwoProverProtocol(ProofProtocol):
    """A proof protocol with ``prover0`` and ``prover1`` whose prover turns may be simultaneous or sequential.

    With ``sequential: false`` (the default) both provers answer in the same
    step; with ``sequential: true`` a prover turn becomes two steps, one per
    prover, ``prover0`` first unless ``prover0_first: false``. In a public
    channel (debate) the second prover then reads the first one's message of
    the same round before it answers. The other keyword arguments are those
    of :class:`~nip_like.protocols.proof.ProofProtocol`.
    """

    def __init__(self, name: str, *, sequential: bool = False, prover0_first: bool = True, **options) -> None:
        self.sequential = bool(sequential)
        self.prover0_first = bool(prover0_first)
        if not self.sequential and not self.prover0_first:
            raise ConfigError(
                f"protocol.prover0_first is false but protocol.sequential is false: the provers of {name} speak "
                "at once unless protocol.sequential=true; set both or neither"
            )
        if self.sequential:
            order = ("prover0", "prover1") if self.prover0_first else ("prover1", "prover0")
            # An instance attribute: the class keeps the simultaneous pattern.
            self.turns = ((VERIFIER,), (order[0],), (order[1],))
        super().__init__(name, **options)


@register_protocol("debate", TwoProverTurnsConfig)
class DebateProtocol(TwoProverProtocol):
    """Debate: two provers argue opposite sides, every message public.

    ``prover0`` argues for acceptance and ``prover1`` for rejection; in a
    prover turn both answer at once, or one after the other with
    ``sequential: true`` (:class:`TwoProverProtocol`).
    """

    agent_names = ("prover0", "prover1", VERIFIER)
    turns = ((VERIFIER,), ("prover0", "prover1"))
    prover_sides = {"prover0": True, "prover1": False}


@register_protocol("mnip", TwoProverTurnsConfig)
class MnipProtocol(TwoProverProtocol):
    """Multi-prover NIP: two provers, each alone in a private channel with the verifier.

    Both argue for acceptance and answer at once (or one after the other with
    ``sequential: true``); neither sees the other's messages, so the verifier
    can check one against the other.
    """

    agent_names = ("prover0", "prover1", VERIFIER)
    turns = ((VERIFIER,), ("prover0", "prover1"))
    prover_sides = {"prover0": True, "prover1": True}
    channels = (("prover0", VERIFIER), ("prover1", VERIFIER))


@register_protocol("merlin_arthur", ProofRewardsConfig)
class MerlinArthurProtocol(FixedTurnsProofProtocol):
    """Merlin-Arthur classifier: one of two provers, drawn at random, speaks once.

    Merlin (``prover0``) argues for acceptance, Morgana (``prover1``) for
    rejection; the verifier does not know which spoke. Two steps; its options
    are the rewards alone.
    """

    agent_names = ("prover0", "prover1", VERIFIER)
    turns = ((VERIFIER,), ("prover0", "prover1"))
    prover_sides = {"prover0": True, "prover1": False}

    def state_spec(self, batch: torch.Size, device: torch.device) -> dict[str, object]:
        return {**super().state_spec(batch, device), SPEAKER_KEY: Unbounded(shape=batch, dtype=torch.int64, device=device)}

    def initial_state(self, num_episodes: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        speaker = torch.randint(0, 2, (num_episodes,), generator=generator)
        return {SPEAKER_KEY: speaker, **super().initial_state(num_episodes, generator)}

    def turns_in(self, state) -> torch.Tensor:
        active = self.active_agents(state["round"]).clone()
        prover_turn = ~active[..., self.verifier_index]
        speaker = state[SPEAKER_KEY]
        active[..., 0] = prover_turn & (speaker == 0)
        active[..., 1] = prover_turn & (speaker == 1)
        return active


@register_protocol("solo_verifier", ProofRewardsConfig)
class SoloVerifierProtocol(FixedTurnsProofProtocol):
    """No prover: the verifier decides in the first and only step. The baseline."""

    agent_names = (VERIFIER,)
    turns = ((VERIFIER,),)
    fixed_rounds = 1
    fixed_first_speaker = "verifier"


@dataclass
class SoloOpeningConfig(ProofRewardsConfig):
    """Options of ``solo_opening``: the rewards, and how many turns the verifier may open parts of the instance."""

    opens: int = checked(1, ge=1)  # turns in which the verifier may reveal parts of the instance itself before its last, deciding turn


@register_protocol("solo_opening", SoloOpeningConfig)
class SoloOpeningProtocol(ProofProtocol):
    """No prover, but the verifier may look for itself: the fair baseline for "the prover helps".

    The verifier acts alone for ``opens + 1`` steps. In each of the first
    ``opens`` it may send a message that the scenario reads as it reads a
    prover's (in the duplicates game: naming two cells reveals their values
    to the verifier) or decide early; on the last it must decide. It means
    something where the verifier sees only part of the instance (``duplicates``
    with ``verifier_view: cells``): beside ``solo_verifier``, which sees
    nothing, it measures what the verifier finds on its own with as many
    messages as a prover would send it. Where the verifier sees the whole
    instance (graph isomorphism, ``verifier_view: full``) its openings reveal
    nothing, and it is ``solo_verifier`` with more steps.
    """

    agent_names = (VERIFIER,)
    turns = ((VERIFIER,),)

    def __init__(self, name: str, *, opens: int = 1, **options: float) -> None:
        self.opens = int(opens)
        super().__init__(name, min_rounds=1, max_rounds=self.opens + 1, first_speaker="verifier", **options)
