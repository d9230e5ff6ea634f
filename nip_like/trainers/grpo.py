"""GRPO: group-relative advantages over grouped rollouts, no critic."""

from __future__ import annotations

from nip_like.objectives.grpo import GRPOConfig, GRPOLoss
from nip_like.registry import register_trainer
from nip_like.trainers.rl import TensorDictRlTrainer


@register_trainer("grpo", objective=GRPOConfig)
class GrpoTrainer(TensorDictRlTrainer):
    """GRPO (options under ``trainer.objective``; needs ``trainer.group_size >= 2``)."""

    def _get_loss_module_and_gae(self):
        return GRPOLoss(self.policy, self.agent_names, self.reference_policy, **self.objective_options), None
