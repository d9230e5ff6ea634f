"""SimPO: a reference-free preference objective, written as one loss and one hook.

SimPO (Meng et al., 2024) scores an episode by its *mean* log-probability and
asks the chosen episode to beat the rejected one by a target margin ``gamma``:

    loss = -log sigmoid(beta * (mean log pi(chosen) - mean log pi(rejected)) - gamma)

The pairs are DPO's (best against worst episode of each group, per agent), so
the loss inherits :class:`~nip_like.objectives.dpo.DPOLoss`'s
``layout_rollouts`` and replaces only ``forward``. Run it from the folder
holding this file, on the DPO trainer config (grouped rollouts, minibatches of
pairs); the trainer registers the schema of its options, which naming it
selects, so ``trainer.objective.gamma`` is a checked option like any other:

    python -m nip_like preset=none trainer=dpo trainer.trainer_type=simpo_trainer.SimpoTrainer trainer.objective.gamma=0.5
"""

from dataclasses import dataclass

import torch.nn.functional as F
from tensordict import TensorDict, TensorDictBase

from nip_like.objectives import ObjectiveConfig
from nip_like.objectives.dpo import CHOSEN, REJECTED, DPOLoss
from nip_like.registry import register_trainer
from nip_like.trainers.rl import TensorDictRlTrainer


@dataclass
class SimPOConfig(ObjectiveConfig):
    """Options of the SimPO objective (``trainer.objective``)."""

    beta: float = 0.3  # inverse temperature of the length-normalised log-ratio
    margin: float = 0.0  # drop pairs whose return gap is below this
    gamma: float = 0.5  # target margin between the chosen and the rejected episode


class SimPOLoss(DPOLoss):
    """SimPO on DPO's episode pairs: length-normalised, no reference policy."""

    uses_reference = False  # the layout skips the reference's log-probs

    def __init__(self, *args, gamma: float = 0.5, **kwargs) -> None:
        super().__init__(*args, length_normalize=True, **kwargs)
        self.gamma = gamma

    def forward(self, tensordict: TensorDictBase) -> TensorDict:
        logps = self.pair_log_probs(tensordict, self.policy_scores)
        margins = self.beta * (logps[CHOSEN] - logps[REJECTED])
        return TensorDict(
            {
                "loss_objective": -F.logsigmoid(margins - self.gamma).mean(),
                "rewards/margins": margins.detach().mean(),
                "rewards/accuracies": (margins > 0).float().mean(),
                "logps/chosen": logps[CHOSEN].detach().mean(),
                "logps/rejected": logps[REJECTED].detach().mean(),
            }
        )


@register_trainer("simpo", objective=SimPOConfig)
class SimpoTrainer(TensorDictRlTrainer):
    """SimPO, with its options under ``trainer.objective``."""

    def _get_loss_module_and_gae(self):
        # The reference is unused by the loss; DPOLoss's signature wants one.
        return SimPOLoss(self.policy, self.agent_names, self.reference_policy, **self.objective_options), None
