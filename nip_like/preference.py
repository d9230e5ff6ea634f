"""The per-pair preference losses of DPO, IPO and SLiC, on torch alone.

Kept apart from :mod:`nip_like.objectives.dpo` (which builds on TorchRL and
TensorDict) so that a fine-tune job's process (:mod:`nip_like.text.fine_tune`)
imports no more than it uses: every job is a process of its own, and its
start-up is paid once per job.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: The preference losses :func:`preference_loss` computes.
LOSS_TYPES = ("sigmoid", "ipo", "hinge")


def preference_loss(
    logits: torch.Tensor, beta: float, loss_type: str = "sigmoid", label_smoothing: float = 0.0
) -> torch.Tensor:
    """The per-pair preference loss of a log-ratio difference.

    Parameters
    ----------
    logits : torch.Tensor
        ``(pi_c - pi_r) - (ref_c - ref_r)``: how much more the policy than the
        reference prefers the chosen episode (log-probabilities).
    beta : float
        Inverse temperature (DPO, hinge) or regularisation strength (IPO).
    loss_type : str
        ``"sigmoid"``: ``-log sigmoid(beta * logits)`` (DPO, Rafailov et al.
        2023), with ``label_smoothing`` the conservative DPO mix;
        ``"ipo"``: ``(logits - 1 / (2 beta))^2`` (Azar et al. 2023);
        ``"hinge"``: ``max(0, 1 - beta * logits)`` (SLiC, Zhao et al. 2023).
    label_smoothing : float
        Assumed probability that a preference is flipped (sigmoid only).

    Returns
    -------
    torch.Tensor
        The loss of each pair, shape of ``logits``.
    """
    if loss_type == "sigmoid":
        return -(1 - label_smoothing) * F.logsigmoid(beta * logits) - label_smoothing * F.logsigmoid(-beta * logits)
    if loss_type == "ipo":
        return (logits - 1 / (2 * beta)) ** 2
    if loss_type == "hinge":
        return torch.relu(1 - beta * logits)
    raise ValueError(f"unknown preference loss type {loss_type!r}; choose one of {', '.join(LOSS_TYPES)}")
