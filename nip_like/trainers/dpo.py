"""Preference objectives on episode pairs: DPO (with its hinge and IPO losses) and IPO."""

from __future__ import annotations

from nip_like.objectives.dpo import DPOConfig, DPOLoss, IPOConfig
from nip_like.objectives.reference import ReferencePolicy
from nip_like.registry import register_trainer
from nip_like.trainers.rl import TensorDictRlTrainer


@register_trainer("dpo", objective=DPOConfig)
class DpoTrainer(TensorDictRlTrainer):
    """Online DPO over grouped episodes (options under ``trainer.objective``; needs ``trainer.group_size >= 2``).

    ``trainer.objective.loss_type`` picks the loss (sigmoid, ipo, hinge).
    """

    def _get_loss_module_and_gae(self):
        return self._preference_loss(**self.objective_options), None

    def _preference_loss(self, **options) -> DPOLoss:
        # The options were checked against their declared ranges when the experiment was built.
        # A reference that moves gets its own copy: objective/kl stays measured from the initial policy.
        reference = ReferencePolicy(self.policy, moving=True) if options["ref_sync_every"] > 0 else self.reference_policy
        return DPOLoss(self.policy, self.agent_names, reference, **options)


@register_trainer("ipo", objective=IPOConfig)
class IpoTrainer(DpoTrainer):
    """IPO: DPO's pairs with the IPO loss (Azar et al. 2023); its options have no loss type."""

    def _get_loss_module_and_gae(self):
        return self._preference_loss(loss_type="ipo", **self.objective_options), None
