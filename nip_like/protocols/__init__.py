"""Interaction protocols: who speaks when, who sees what, who is rewarded."""

from nip_like.protocols.base import Protocol
from nip_like.protocols.proof import ProofProtocol
from nip_like.protocols.proofs import (
    AdpProtocol,
    DebateProtocol,
    MerlinArthurProtocol,
    MnipProtocol,
    NipProtocol,
    SoloVerifierProtocol,
)
from nip_like.protocols.prover_verifier import ProverVerifierProtocol

__all__ = [
    "AdpProtocol",
    "DebateProtocol",
    "MerlinArthurProtocol",
    "MnipProtocol",
    "NipProtocol",
    "ProofProtocol",
    "Protocol",
    "ProverVerifierProtocol",
    "SoloVerifierProtocol",
]
