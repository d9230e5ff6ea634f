"""Scenarios: environments, agents and data of each task."""

from nip_like.scenarios.base import Scenario
from nip_like.scenarios.environment import InteractionEnv
from nip_like.scenarios.graph_isomorphism import GraphIsomorphismScenario
from nip_like.scenarios.hidden_bits import HiddenBitsScenario

__all__ = ["GraphIsomorphismScenario", "HiddenBitsScenario", "InteractionEnv", "Scenario"]
