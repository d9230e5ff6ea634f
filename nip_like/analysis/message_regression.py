"""Does the transcript carry the answer? Predict the label from the provers' messages alone.

Given the messages of played episodes (:class:`~nip_like.scenarios.messaging.MessageFeatures`,
one per prover) with each episode's label and whether the verifier decided it
correctly, :func:`regress_messages` fits one regressor per prover, and one on
all provers' messages together, on a seeded share of the episodes and scores
it on the rest (the held-out episodes). Beside each score stand the
majority-label baseline and the verifier's accuracy on the same held-out
episodes. A regressor well above the baseline means the messages alone tell
the label: a prover that simply announces the answer, which a verifier could
copy without checking anything.

The regressor depends on the form of the messages:

* ``vector`` (one-hot choices, flattened): an MLP with one hidden layer;
* ``image`` (messages laid out on the image, ``C, H, W``): a small CNN
  (two 3x3 convolutions, global average pooling, a linear layer);
* ``tokens`` (language-model messages): a linear probe (logistic
  regression, fitted by L-BFGS on all fitting episodes at once) on the mean
  of the sender's input embeddings over the message's tokens.

Every input is standardised on the fitting episodes. The reference
framework (``nip/message_regression.py`` of the NIP repository) fits an MLP
on the first message of each agent during training; this analysis runs on a
finished run's test episodes instead (``python -m nip_like.analyse
message-regression``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nip_like.errors import ConfigError
from nip_like.scenarios.messaging import MESSAGE_KINDS, MessageFeatures


@dataclass(frozen=True)
class RegressionOptions:
    """How the regressors are fitted.

    Parameters
    ----------
    held_out : float
        Share of the episodes kept out of fitting and scored, in ``(0, 1)``.
    seed : int
        Seed of the split and of the regressors' initial weights.
    epochs : int
        Passes over the fitting episodes.
    hidden_size : int
        Width of the MLP's hidden layer and of the CNN's channels.
    learning_rate : float
        Adam's learning rate.
    batch_size : int
        Episodes per optimiser step.
    weight_decay : float
        Adam's L2 penalty (keeps a probe on few episodes from fitting noise).
    """

    held_out: float = 0.2
    seed: int = 0
    epochs: int = 60
    hidden_size: int = 64
    learning_rate: float = 1e-3
    batch_size: int = 64
    weight_decay: float = 1e-4

    def __post_init__(self) -> None:
        if not 0 < self.held_out < 1:
            raise ConfigError(f"--held-out must be in (0, 1), got {self.held_out}")
        for name in ("epochs", "hidden_size", "batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class RegressionScore:
    """One regressor's result on the held-out episodes.

    Parameters
    ----------
    who : str
        A prover, or ``provers`` for all provers' messages together.
    kind : str
        The form of the messages (``vector``, ``image``, ``tokens``).
    regressor : str
        ``mlp``, ``cnn`` or ``linear probe``.
    inputs : int
        Size of one episode's input to the regressor.
    fitted : int
        Episodes it was fitted on.
    held_out : int
        Episodes it was scored on.
    accuracy : float
        Its accuracy on the held-out episodes.
    majority : float
        Accuracy on them of always answering the fitting episodes' most common label.
    verifier : float
        The verifier's accuracy on the same held-out episodes.
    """

    who: str
    kind: str
    regressor: str
    inputs: int
    fitted: int
    held_out: int
    accuracy: float
    majority: float
    verifier: float

    def as_dict(self) -> dict[str, Any]:
        """The score as a JSON-ready dict."""
        return asdict(self)


def pooled_inputs(features: MessageFeatures) -> torch.Tensor:
    """A regressor's input of ``features`` on the CPU, in float32: token messages become their mean input embedding."""
    if features.kind not in MESSAGE_KINDS:
        raise ConfigError(f"messages of {features.who} are of kind {features.kind!r}; allowed: {list(MESSAGE_KINDS)}")
    if features.kind != "tokens":
        return features.values.detach().float().cpu()
    if features.embedding is None or features.mask is None:
        raise ConfigError(f"token messages of {features.who} need the sender's embedding and a token mask")
    with torch.no_grad():
        embedded = features.embedding(features.values).float()
        mask = features.mask.unsqueeze(-1).to(embedded.dtype)
        pooled = (embedded * mask).sum(1) / mask.sum(1).clamp(min=1.0)
    return pooled.cpu()


def together(features: list[MessageFeatures], inputs: list[torch.Tensor]) -> tuple[str, torch.Tensor]:
    """All provers' inputs side by side (``vector`` and pooled ``tokens``: concatenated; ``image``: stacked as channels)."""
    kinds = {item.kind for item in features}
    if kinds == {"image"}:
        return "image", torch.cat(inputs, dim=1)
    return ("tokens" if "tokens" in kinds else "vector"), torch.cat([item.flatten(1) for item in inputs], dim=1)


def _regressor(kind: str, inputs: torch.Tensor, options: RegressionOptions) -> tuple[str, nn.Module]:
    if kind == "image":
        channels = inputs.shape[1]
        return "cnn", nn.Sequential(
            nn.Conv2d(channels, options.hidden_size, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(options.hidden_size, options.hidden_size, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(options.hidden_size, 2),
        )
    size = inputs[0].numel()
    if kind == "tokens":
        return "linear probe", nn.Linear(size, 2)
    return "mlp", nn.Sequential(nn.Linear(size, options.hidden_size), nn.ReLU(), nn.Linear(options.hidden_size, 2))


def _fit_probe(model: nn.Module, x: torch.Tensor, labels: torch.Tensor, options: RegressionOptions) -> None:
    """Logistic regression: the cross-entropy plus ``weight_decay / 2 * |W|^2``, minimised over the whole fitting set by L-BFGS."""
    optimizer = torch.optim.LBFGS(model.parameters(), max_iter=200, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), labels) + 0.5 * options.weight_decay * model.weight.pow(2).sum()
        loss.backward()
        return loss

    optimizer.step(closure)


def fit_and_score(
    who: str,
    kind: str,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    correct: torch.Tensor,
    options: RegressionOptions,
) -> RegressionScore:
    """Fit a regressor of ``kind`` on a seeded share of the episodes; score it on the rest.

    Parameters
    ----------
    who, kind : str
        As in :class:`RegressionScore`.
    inputs : Tensor
        ``E, ...``: each episode's input (pooled already, see :func:`pooled_inputs`).
    labels : Tensor
        ``E``: each episode's label (bool).
    correct : Tensor
        ``E``: whether the verifier decided the episode correctly (bool).
    options : RegressionOptions
        The split and the fitting.

    Raises
    ------
    ConfigError
        If the split would leave no episode to fit on or to score.
    """
    episodes = inputs.shape[0]
    held = math.ceil(episodes * options.held_out)
    if episodes - held < 1 or held < 1:
        raise ConfigError(f"{episodes} episodes are too few to fit on {1 - options.held_out:.0%} and score on the rest")
    generator = torch.Generator().manual_seed(options.seed)
    order = torch.randperm(episodes, generator=generator)
    fit, test = order[held:], order[:held]
    labels = labels.long().cpu()
    correct = correct.bool().cpu()
    # Standardised on the fitting episodes (per input entry; a constant entry stays 0).
    mean = inputs[fit].mean(0, keepdim=True)
    scale = inputs[fit].std(0, keepdim=True, unbiased=False).clamp(min=1e-6)
    x = (inputs - mean) / scale
    torch.manual_seed(options.seed)
    name, model = _regressor(kind, x, options)
    model.train()
    if name == "linear probe":
        _fit_probe(model, x[fit], labels[fit], options)
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=options.learning_rate, weight_decay=options.weight_decay)
        for _ in range(options.epochs):
            for batch in fit[torch.randperm(fit.numel(), generator=generator)].split(options.batch_size):
                optimizer.zero_grad()
                F.cross_entropy(model(x[batch]), labels[batch]).backward()
                optimizer.step()
    model.eval()
    with torch.no_grad():
        predicted = model(x[test]).argmax(-1)
    majority = int(labels[fit].float().mean().item() >= 0.5)
    return RegressionScore(
        who=who,
        kind=kind,
        regressor=name,
        inputs=int(x[0].numel()),
        fitted=int(fit.numel()),
        held_out=int(test.numel()),
        accuracy=float((predicted == labels[test]).float().mean()),
        majority=float((labels[test] == majority).float().mean()),
        verifier=float(correct[test].float().mean()),
    )


def regress_messages(
    features: list[MessageFeatures],
    labels: torch.Tensor,
    correct: torch.Tensor,
    options: RegressionOptions | None = None,
) -> list[RegressionScore]:
    """Score a regressor per prover, and one on all provers together (when there are several).

    Parameters
    ----------
    features : list of MessageFeatures
        Each prover's messages in the same ``E`` episodes.
    labels, correct : Tensor
        ``E``: each episode's label, and whether the verifier was right.
    options : RegressionOptions, optional
        The split and the fitting (defaults if not given).

    Raises
    ------
    ConfigError
        If there is no prover (the solo verifier: nothing to regress on).
    """
    options = options or RegressionOptions()
    if not features:
        raise ConfigError("this protocol has no prover: there are no messages to regress the label on")
    inputs = [pooled_inputs(item) for item in features]
    scores = [fit_and_score(item.who, item.kind, value, labels, correct, options) for item, value in zip(features, inputs)]
    if len(features) > 1:
        kind, joined = together(features, inputs)
        scores.append(fit_and_score("provers", kind, joined, labels, correct, options))
    return scores


def format_scores(scores: list[RegressionScore]) -> str:
    """The scores as an aligned text table."""
    rows = [("messages of", "regressor", "inputs", "held out", "accuracy", "majority", "verifier")]
    rows += [
        (s.who, s.regressor, str(s.inputs), str(s.held_out), f"{s.accuracy:.3f}", f"{s.majority:.3f}", f"{s.verifier:.3f}")
        for s in scores
    ]
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)
