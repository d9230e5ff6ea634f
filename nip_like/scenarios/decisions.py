"""What the decision scenarios share: their start-up checks and the metrics of a verifier's decisions."""

from __future__ import annotations

import torch

from nip_like.errors import ConfigError
from nip_like.protocols.proof import ProofProtocol
from nip_like.registry import PROTOCOLS


def check_proof_scenario(scenario: str, config, protocol) -> None:
    """Refuse, in one line, a protocol or split sizes that a labelled interactive-proof scenario cannot use.

    Parameters
    ----------
    scenario : str
        The scenario's registered name, for messages.
    config : DictConfig
        The scenario's node: ``agents`` (per-agent entries, if it has them), ``val_fraction``
        and ``test_fraction``.
    protocol : Protocol
        The protocol: it must be an interactive-proof protocol, and
        ``config.agents`` may only name its agents.
    """
    if not isinstance(protocol, ProofProtocol):
        raise ConfigError(
            f"scenario {scenario} needs an interactive-proof protocol "
            f"({', '.join(PROTOCOLS.names(subclass_of=ProofProtocol))}), got {protocol.name!r}"
        )
    unknown = sorted(set(config.get("agents", {})) - set(protocol.agent_names))
    if unknown:
        raise ConfigError(
            f"scenario.agents names {unknown}, which protocol {protocol.name!r} "
            f"does not have; its agents are {list(protocol.agent_names)}"
        )
    fractions = (config.val_fraction, config.test_fraction)
    if min(fractions) <= 0 or sum(fractions) >= 1:
        raise ConfigError(
            f"scenario.val_fraction and scenario.test_fraction must be positive and sum to less than 1, "
            f"got {config.val_fraction} and {config.test_fraction}"
        )


def precision_recall(accept: torch.Tensor, label: torch.Tensor) -> dict[str, float]:
    """Precision and recall of ``accept`` decisions against ``label`` (accept = positive); 0 when undefined."""
    true_positive = (accept & label).sum().item()
    return {
        "precision": true_positive / max(int(accept.sum()), 1),
        "recall": true_positive / max(int(label.sum()), 1),
    }


def decision_metrics(decision: torch.Tensor, label: torch.Tensor, datapoint: torch.Tensor) -> dict[str, float]:
    """Accuracy (per episode, per datapoint, worst datapoint), the share of datapoints always decided wrong, precision and recall.

    ``always_wrong`` is the NIP paper's second measure: the share of
    datapoints on which every episode's decision was wrong. It means most
    when each datapoint is played several times (the RL test's
    ``trainer.test_rollouts``); ``episodes_per_datapoint`` says how many.

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
        "always_wrong": (per_datapoint == 0).float().mean().item(),
        "episodes_per_datapoint": float(len(which)) / len(per_datapoint),
        **precision_recall(accept, label),
    }
