"""Interaction protocols: who speaks when, who sees what, who is rewarded."""

from nip_like.protocols.base import Protocol
from nip_like.protocols.prover_verifier import ProverVerifierProtocol, SoloVerifierProtocol

__all__ = ["Protocol", "ProverVerifierProtocol", "SoloVerifierProtocol"]
