"""One-shot two-player matrix games, whose policies' parameters are the logits."""

from nip_like.scenarios.matrix_game.environment import MatrixGameEnv
from nip_like.scenarios.matrix_game.scenario import MatrixGameScenario

__all__ = ["MatrixGameEnv", "MatrixGameScenario"]
