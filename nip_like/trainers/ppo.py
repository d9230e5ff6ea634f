"""PPO: clipped or adaptive-KL surrogate, per-agent advantages, GAE."""

from __future__ import annotations

from nip_like.objectives.ppo import MultiAgentPPOLoss
from nip_like.registry import register_trainer
from nip_like.trainers.rl import TensorDictRlTrainer


@register_trainer("ppo")
class PpoTrainer(TensorDictRlTrainer):
    """Multi-agent PPO (options under ``trainer.ppo``).

    A subclass can swap in a loss with the same constructor by setting
    :attr:`loss_class`.
    """

    #: The loss module class, called with the PPO options.
    loss_class: type[MultiAgentPPOLoss] = MultiAgentPPOLoss

    def _get_loss_module_and_gae(self):
        tc = self.config.trainer
        loss = self.loss_class(
            self.policy,
            self.value,
            self.agent_names,
            variant=tc.ppo.variant,
            clip_epsilon=tc.ppo.clip_epsilon,
            kl_beta=tc.ppo.kl_beta,
            kl_target=tc.ppo.kl_target,
            kl_adaptive=tc.ppo.kl_adaptive,
            entropy_coeff=tc.entropy_coeff,
            critic_coeff=tc.critic_coeff,
            normalize_advantage=tc.ppo.normalize_advantage,
            loss_critic_type=tc.ppo.loss_critic_type,
        )
        loss.make_value_estimator(gamma=tc.gamma, lmbda=tc.lmbda)
        return loss, loss.value_estimator
