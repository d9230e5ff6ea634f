"""SimPO: a reference-free preference objective, written as one loss and one hook.

SimPO (Meng et al., 2024) scores an episode by its *mean* log-probability and
asks the chosen episode to beat the rejected one by a target margin ``gamma``:

    loss = -log sigmoid(beta * (mean log pi(chosen) - mean log pi(rejected)) - gamma)

The pairs are DPO's (best against worst episode of each group, per agent), so
the loss inherits :class:`~nip_like.objectives.dpo.DPOLoss`'s
``layout_rollouts`` and replaces only ``forward``. Run it from the folder
holding this file, on the DPO trainer config (grouped rollouts, minibatches of
pairs):

    python -m nip_like preset=none trainer=dpo trainer.trainer_type=simpo_trainer.SimpoTrainer +trainer.extra.gamma=0.5
"""

import torch.nn.functional as F
from tensordict import TensorDict, TensorDictBase

from nip_like.objectives.dpo import CHOSEN, REJECTED, DPOLoss
from nip_like.trainers.rl import TensorDictRlTrainer


class SimPOLoss(DPOLoss):
    """SimPO on DPO's episode pairs: length-normalised, no reference policy."""

    uses_reference = False  # the layout skips the reference's log-probs

    def __init__(self, *args, gamma: float = 0.5, **kwargs) -> None:
        super().__init__(*args, length_normalize=True, **kwargs)
        self.gamma = gamma

    def forward(self, tensordict: TensorDictBase) -> TensorDict:
        logps = self.pair_log_probs(tensordict, self.policy_logits)
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


class SimpoTrainer(TensorDictRlTrainer):
    """SimPO; ``beta`` from ``trainer.dpo.beta``, ``gamma`` from ``trainer.extra.gamma``."""

    def _get_loss_module_and_gae(self):
        tc = self.config.trainer
        loss = SimPOLoss(
            self.policy,
            self.agent_names,
            self.reference_policy,  # unused by the loss; DPOLoss's signature wants one
            beta=tc.dpo.beta,
            margin=tc.dpo.margin,
            gamma=float(tc.extra.get("gamma", 0.5)),
        )
        return loss, None
