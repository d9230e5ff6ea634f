"""Loss modules (TorchRL ``LossModule`` subclasses), one file per family."""

from nip_like.objectives.masking import per_agent_mean, standardize_per_agent
from nip_like.objectives.ppo import MultiAgentPPOLoss

__all__ = ["MultiAgentPPOLoss", "per_agent_mean", "standardize_per_agent"]
