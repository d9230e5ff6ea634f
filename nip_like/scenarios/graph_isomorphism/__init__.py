"""The graph-isomorphism scenario."""

from nip_like.scenarios.graph_isomorphism.scenario import GraphIsomorphismScenario

__all__ = ["GraphIsomorphismScenario"]
