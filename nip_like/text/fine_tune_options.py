"""How the text trainers' fine-tune jobs train (``trainer.fine_tune``): the options each job's spec is made from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from nip_like.allowed import checked


@dataclass
class FineTuneOptions:
    """How each fine-tune job trains (:func:`~nip_like.text.worker.run_job`; where it runs is ``trainer.jobs``)."""

    epochs: int = checked(2, ge=1)  # passes over the job's dataset
    lr: float = checked(3e-4, gt=0)  # AdamW learning rate
    batch_size: int = checked(32, ge=1)  # examples per optimiser step
    max_grad_norm: Optional[float] = checked(1.0, gt=0)  # gradient clipping; null = none
    beta: float = checked(0.1, gt=0)  # DPO: inverse temperature (IPO: regularisation)
    loss_type: str = checked("sigmoid", choices=("sigmoid", "ipo", "hinge"))  # DPO loss
    rpo_alpha: Optional[float] = checked(None, ge=0)  # DPO: weight of the chosen replies' token NLL added to the loss (TRL's rpo_alpha); null = none
    timeout: Optional[float] = checked(None, gt=0)  # seconds to wait for a job; null = no limit
