"""Loss modules (TorchRL ``LossModule`` subclasses), one file per family, and the loss contract."""

from nip_like.objectives.contract import ObjectiveConfig, RolloutLoss, contract_of, use_agent_keys
from nip_like.objectives.masking import per_agent_mean, standardize_per_agent
from nip_like.objectives.ppo import MultiAgentPPOLoss

__all__ = [
    "MultiAgentPPOLoss",
    "ObjectiveConfig",
    "RolloutLoss",
    "contract_of",
    "per_agent_mean",
    "standardize_per_agent",
    "use_agent_keys",
]
