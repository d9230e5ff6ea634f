"""The graph-isomorphism scenario."""
