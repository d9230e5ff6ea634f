"""The hidden-bits scenario: a prover must tell the verifier a hidden bit string."""

from nip_like.scenarios.hidden_bits.environment import HiddenBitsEnv
from nip_like.scenarios.hidden_bits.scenario import HiddenBitsScenario

__all__ = ["HiddenBitsEnv", "HiddenBitsScenario"]
