"""Metrics of a verifier's accept/reject decisions, shared by the decision scenarios."""

from __future__ import annotations

import torch


def precision_recall(accept: torch.Tensor, label: torch.Tensor) -> dict[str, float]:
    """Precision and recall of ``accept`` decisions against ``label`` (accept = positive); 0 when undefined."""
    true_positive = (accept & label).sum().item()
    return {
        "precision": true_positive / max(int(accept.sum()), 1),
        "recall": true_positive / max(int(label.sum()), 1),
    }


def decision_metrics(decision: torch.Tensor, label: torch.Tensor, datapoint: torch.Tensor) -> dict[str, float]:
    """Accuracy (per episode, per datapoint, worst datapoint), precision and recall of final decisions.

    Parameters
    ----------
    decision : torch.Tensor
        ``(E,)`` long: 1 accept, 0 reject, -1 no decision (counted wrong).
    label : torch.Tensor
        ``(E,)`` bool: accepting is right.
    datapoint : torch.Tensor
        ``(E,)`` long: which datapoint each episode played, so that a
        datapoint played several times counts once in the per-datapoint mean.
    """
    accept = decision == 1
    correct = ((accept == label) & (decision >= 0)).float().cpu()
    _, which = datapoint.cpu().unique(return_inverse=True)
    per_datapoint = torch.zeros(int(which.max()) + 1).index_add_(0, which, correct)
    per_datapoint /= torch.bincount(which).float()
    return {
        "accuracy": correct.mean().item(),
        "accuracy_per_datapoint": per_datapoint.mean().item(),
        "accuracy_worst_datapoint": per_datapoint.min().item(),
        **precision_recall(accept, label),
    }
