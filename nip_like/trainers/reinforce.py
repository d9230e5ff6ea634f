"""REINFORCE, with or without a learned baseline."""

from __future__ import annotations

from nip_like.objectives.reinforce import MultiAgentReinforceLoss, ReinforceConfig
from nip_like.registry import register_trainer
from nip_like.trainers.rl import TensorDictRlTrainer


@register_trainer("reinforce", objective=ReinforceConfig)
class ReinforceTrainer(TensorDictRlTrainer):
    """REINFORCE (options under ``trainer.objective``)."""

    def _get_loss_module_and_gae(self):
        return MultiAgentReinforceLoss(self.policy, self.value, self.agent_names, **self.objective_options), None
