"""GRPO: group-relative advantages over grouped rollouts, no critic."""

from __future__ import annotations

from nip_like.errors import ConfigError
from nip_like.objectives.grpo import GRPOLoss
from nip_like.registry import register_trainer
from nip_like.trainers.rl import TensorDictRlTrainer


@register_trainer("grpo")
class GrpoTrainer(TensorDictRlTrainer):
    """GRPO (options under ``trainer.grpo``; needs ``trainer.group_size >= 2``)."""

    def _get_loss_module_and_gae(self):
        tc = self.config.trainer
        if tc.group_size < 2:
            raise ConfigError(f"trainer grpo compares episodes within groups: set trainer.group_size >= 2, got {tc.group_size}")
        loss = GRPOLoss(
            self.policy,
            self.agent_names,
            self.reference_policy,
            clip_epsilon=tc.grpo.clip_epsilon,
            kl_coeff=tc.grpo.kl_coeff,
            entropy_coeff=tc.entropy_coeff,
        )
        return loss, None
