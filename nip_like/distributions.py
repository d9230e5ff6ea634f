"""Action distributions beyond TorchRL's.

:class:`GroupedMaskedCategorical` is a masked categorical whose greedy action
is chosen in two stages. An agent whose options are "send one of many
messages" or "take one of a few final actions" (a verifier that continues the
conversation or decides) spreads the first option over many actions, so a
plain argmax would pick a final action whenever it beats the single most
probable message, even when sending some message is far more probable. The
two-stage mode first picks the most probable option, then the most probable
action within it. :func:`masked_log_softmax` gives the log-probabilities of a
categorical restricted to its legal actions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torchrl.modules import MaskedCategorical


def masked_log_softmax(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Log-probabilities of a categorical restricted to the legal actions in ``mask``.

    Illegal actions get the log-softmax of the most negative finite number (a
    finite value far below any legal one, so no NaN appears downstream even
    when every action is illegal).
    """
    return F.log_softmax(logits.masked_fill(~mask, torch.finfo(logits.dtype).min), dim=-1)


class GroupedMaskedCategorical(MaskedCategorical):
    """A :class:`~torchrl.modules.MaskedCategorical` with a two-stage mode.

    The first ``group_size`` actions form one group; every other action is a
    group of its own. Sampling, log-probabilities and entropies are those of
    the masked categorical; only the mode (the action of deterministic
    exploration) differs: the group with the largest total probability over
    its legal actions, then the most probable action within it.

    Parameters
    ----------
    logits, probs : torch.Tensor, optional
        As for :class:`~torchrl.modules.MaskedCategorical`.
    group_size : int
        Number of leading actions that form the group.
    **kwargs
        Passed to :class:`~torchrl.modules.MaskedCategorical` (``mask`` among them).

    Examples
    --------
    >>> logits = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0]).log_softmax(-1)
    >>> dist = GroupedMaskedCategorical(logits, mask=torch.ones(5, dtype=torch.bool), group_size=4)
    >>> int(dist.probs.argmax()), int(dist.mode)  # the group of four is more probable
    (4, 0)
    """

    def __init__(
        self,
        logits: torch.Tensor | None = None,
        probs: torch.Tensor | None = None,
        *,
        group_size: int,
        **kwargs,
    ) -> None:
        super().__init__(logits, probs, **kwargs)
        self.group_size = int(group_size)

    @property
    def mode(self) -> torch.Tensor:
        probs = self.probs
        grouped = probs[..., : self.group_size]
        choices = torch.cat([grouped.sum(-1, keepdim=True), probs[..., self.group_size :]], dim=-1)
        choice = choices.argmax(-1)
        return torch.where(choice == 0, grouped.argmax(-1), choice - 1 + self.group_size)

    @property
    def deterministic_sample(self) -> torch.Tensor:
        return self.mode
