"""The text trainers' options (``trainer.objective``): the loop's and the fine-tune jobs'."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from nip_like.allowed import checked

#: When the test stage runs.
TEST_SCHEMES = ("none", "all", "last", "first_and_last")


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


@dataclass
class TextTrainingConfig:
    """Options shared by the text trainers (``trainer.objective``)."""

    episodes: int = checked(256, ge=1)  # episodes sampled per iteration (train split)
    test_scheme: str = checked("last", choices=TEST_SCHEMES)  # iterations that run the test stage
    test_episodes: int = checked(512, ge=1)  # episodes of a test (test split, same lists every time)
    test_greedy: bool = True  # tests decode greedily (temperature 0)
    warm_start_episodes: int = checked(0, ge=0)  # honest-play demonstrations for an SFT job before the first iteration; 0 = none
    warm_start_epochs: int = checked(2, ge=1)  # passes of the warm start's SFT
    warm_start_lr: float = checked(1e-3, gt=0)  # learning rate of the warm start's SFT
    fine_tune: FineTuneOptions = field(default_factory=FineTuneOptions)  # the jobs' training settings
