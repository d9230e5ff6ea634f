"""The text trainers: text agents trained by fine-tune jobs, in stages (sampling, tests, jobs), resumable after each.

:class:`~nip_like.trainers.text.pure_text.PureTextRlTrainer` is their base;
:mod:`~nip_like.trainers.text.expert_iteration` and :mod:`~nip_like.trainers.text.malt`
are the built-in algorithms.
"""

from nip_like.trainers.text.fine_tune_jobs import sft_record
from nip_like.trainers.text.pure_text import PureTextRlTrainer
from nip_like.trainers.text.state import STAGES

__all__ = ["PureTextRlTrainer", "STAGES", "sft_record"]
