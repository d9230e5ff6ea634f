"""Trainers: base classes, the standard RL loop, one short file per algorithm."""

from nip_like.trainers.base import IterationContext, TensorDictTrainer, Trainer, attach_progress_bar
from nip_like.trainers.dpo import DpoTrainer, IpoTrainer
from nip_like.trainers.grpo import GrpoTrainer
from nip_like.trainers.ppo import PpoTrainer
from nip_like.trainers.reinforce import ReinforceTrainer
from nip_like.trainers.rl import TensorDictRlTrainer
from nip_like.trainers.solo_agent import SoloAgentTrainer

__all__ = [
    "DpoTrainer",
    "GrpoTrainer",
    "IpoTrainer",
    "IterationContext",
    "PpoTrainer",
    "ReinforceTrainer",
    "SoloAgentTrainer",
    "TensorDictRlTrainer",
    "TensorDictTrainer",
    "Trainer",
    "attach_progress_bar",
]
