"""A user-defined trainer in its own file: TorchRL's A2C loss with GAE.

Run it from the folder holding this file, with no edit to nip_like:

    python -m nip_like preset=none trainer.trainer_type=a2c_trainer.A2CTrainer trainer.num_epochs=1 trainer.minibatch_size=1536

The trainer registers itself with the schema of its objective's options, so
importing it (which ``trainer.trainer_type`` does before the config is
composed) selects them: ``trainer.objective.entropy_coeff=0.02`` and the like
work on the command line. A2C is on-policy, so each batch is used for one
full-batch gradient step.
"""

from dataclasses import dataclass

from torchrl.objectives import A2CLoss, ValueEstimators

from nip_like.objectives import ObjectiveConfig, use_agent_keys
from nip_like.registry import register_trainer
from nip_like.trainers import TensorDictRlTrainer


@dataclass
class A2CConfig(ObjectiveConfig):
    """Options of the A2C objective (``trainer.objective``)."""

    entropy_coeff: float = 0.01  # weight of the entropy bonus
    critic_coeff: float = 0.5  # weight of the value loss
    gamma: float = 0.99  # discount factor of GAE
    lmbda: float = 0.95  # GAE lambda


@register_trainer("a2c", objective=A2CConfig)
class A2CTrainer(TensorDictRlTrainer):
    """Advantage actor-critic: the loss module and its GAE, nothing else."""

    def _get_loss_module_and_gae(self):
        options = self.objective_options
        loss = A2CLoss(self.policy, self.value, entropy_coeff=options["entropy_coeff"], critic_coeff=options["critic_coeff"])
        use_agent_keys(loss)  # ("agents", ...) keys; inactive agents masked out
        loss.make_value_estimator(ValueEstimators.GAE, gamma=options["gamma"], lmbda=options["lmbda"])
        return loss, loss.value_estimator
