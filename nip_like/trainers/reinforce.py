"""REINFORCE, with or without a learned baseline."""

from __future__ import annotations

from nip_like.objectives.reinforce import MultiAgentReinforceLoss
from nip_like.registry import register_trainer
from nip_like.trainers.rl import TensorDictRlTrainer


@register_trainer("reinforce")
class ReinforceTrainer(TensorDictRlTrainer):
    """REINFORCE (options under ``trainer.reinforce``)."""

    def _get_loss_module_and_gae(self):
        tc = self.config.trainer
        loss = MultiAgentReinforceLoss(
            self.policy,
            self.value if tc.reinforce.baseline else None,
            self.agent_names,
            gamma=tc.gamma,
            entropy_coeff=tc.entropy_coeff,
            critic_coeff=tc.critic_coeff,
            normalize_advantage=tc.reinforce.normalize_advantage,
        )
        return loss, None
