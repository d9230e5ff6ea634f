"""PPO on whole trajectory segments: a loss module that lays out its own buffer.

The collector's batch has batch dims ``(env, time)``. By default the trainer
flattens it into single transitions. This loss keeps each environment's row
of ``frames_per_batch / num_envs`` consecutive steps together, so a minibatch
holds ``trainer.minibatch_size`` segments instead of that many transitions
(a layout a recurrent policy or a sequence-level statistic would need).

Run it from the folder holding this file:

    python -m nip_like preset=none trainer.trainer_type=segment_ppo_trainer.SegmentPpoTrainer trainer.minibatch_size=8
"""

from tensordict import TensorDictBase

from nip_like.objectives.ppo import MultiAgentPPOLoss
from nip_like.trainers.ppo import PpoTrainer


class SegmentPPOLoss(MultiAgentPPOLoss):
    """Multi-agent PPO whose replay-buffer items are trajectory segments."""

    def layout_rollouts(self, batch: TensorDictBase) -> TensorDictBase:
        # batch: (env, time) after GAE; one buffer item per environment row.
        return batch


class SegmentPpoTrainer(PpoTrainer):
    """The PPO trainer with :class:`SegmentPPOLoss` in place of the default loss."""

    loss_class = SegmentPPOLoss
