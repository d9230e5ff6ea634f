"""PPO: clipped or adaptive-KL surrogate, per-agent advantages, GAE."""

from __future__ import annotations

from nip_like.objectives.ppo import MultiAgentPPOLoss, PPOConfig
from nip_like.registry import register_trainer
from nip_like.trainers.rl import TensorDictRlTrainer


@register_trainer("ppo", objective=PPOConfig)
class PpoTrainer(TensorDictRlTrainer):
    """Multi-agent PPO (options under ``trainer.objective``, :class:`~nip_like.objectives.ppo.PPOConfig`).

    A subclass can swap in a loss with the same constructor by setting
    :attr:`loss_class`.
    """

    #: The loss module class, called with the PPO options.
    loss_class: type[MultiAgentPPOLoss] = MultiAgentPPOLoss

    def _get_loss_module_and_gae(self):
        loss = self.loss_class(self.policy, self.value, self.agent_names, **self.objective_options)
        return loss, loss.value_estimator
