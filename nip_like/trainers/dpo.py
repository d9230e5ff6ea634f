"""Preference objectives on episode pairs: DPO and IPO."""

from __future__ import annotations

from nip_like.errors import ConfigError
from nip_like.objectives.dpo import DPOLoss
from nip_like.objectives.reference import ReferencePolicy
from nip_like.registry import register_trainer
from nip_like.trainers.rl import TensorDictRlTrainer


@register_trainer("dpo")
class DpoTrainer(TensorDictRlTrainer):
    """Online DPO over grouped episodes (options under ``trainer.dpo``; needs ``trainer.group_size >= 2``).

    ``trainer.dpo.loss_type`` picks the loss (sigmoid, ipo, hinge); the
    ``ipo`` trainer is this one fixed to the IPO loss.
    """

    #: A loss type the trainer always runs, or ``None`` to read ``trainer.dpo.loss_type``.
    fixed_loss_type: str | None = None

    def _get_loss_module_and_gae(self):
        tc = self.config.trainer
        options = tc.dpo
        if tc.group_size < 2:
            raise ConfigError(
                f"trainer {tc.trainer_type} pairs episodes within groups: "
                f"set trainer.group_size >= 2, got {tc.group_size}"
            )
        if self.fixed_loss_type not in (None, options.loss_type):
            raise ConfigError(
                f"trainer {tc.trainer_type} runs the {self.fixed_loss_type} loss, but trainer.dpo.loss_type is "
                f"{options.loss_type!r}; use trainer=dpo trainer.dpo.loss_type={options.loss_type} instead"
            )
        # A reference that moves gets its own copy: objective/kl stays measured from the initial policy.
        reference = ReferencePolicy(self.policy) if options.ref_sync_every > 0 else self.reference_policy
        try:
            loss = DPOLoss(
                self.policy,
                self.agent_names,
                reference,
                beta=options.beta,
                loss_type=options.loss_type,
                margin=options.margin,
                length_normalize=options.length_normalize,
                label_smoothing=options.label_smoothing,
                ref_sync_every=options.ref_sync_every,
                ref_mixup_alpha=options.ref_mixup_alpha,
            )
        except ValueError as error:
            # DPOLoss checks its options and names each field; they live under trainer.dpo.
            raise ConfigError(f"trainer.dpo.{error}") from error
        return loss, None


@register_trainer("ipo")
class IpoTrainer(DpoTrainer):
    """IPO: :class:`DpoTrainer` fixed to the IPO loss (``trainer=ipo`` sets its defaults)."""

    fixed_loss_type = "ipo"
