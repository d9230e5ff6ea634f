"""A user-defined trainer in its own file: TorchRL's A2C loss with GAE.

Run it from the folder holding this file, with no edit to nip_like:

    python -m nip_like preset=none trainer.trainer_type=a2c_trainer.A2CTrainer trainer.num_epochs=1 trainer.minibatch_size=1536

A2C is on-policy, so each batch is used for one full-batch gradient step.
"""

from torchrl.objectives import A2CLoss, ValueEstimators

from nip_like.trainers import TensorDictRlTrainer


class A2CTrainer(TensorDictRlTrainer):
    """Advantage actor-critic: the loss module and its GAE, nothing else."""

    def _get_loss_module_and_gae(self):
        settings = self.config.trainer
        loss = A2CLoss(
            self.policy,
            self.value,
            entropy_coeff=settings.entropy_coeff,
            critic_coeff=settings.critic_coeff,
        )
        self.use_agent_keys(loss)  # ("agents", ...) keys; inactive agents masked out
        loss.make_value_estimator(ValueEstimators.GAE, gamma=settings.gamma, lmbda=settings.lmbda)
        return loss, loss.value_estimator
