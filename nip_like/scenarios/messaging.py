"""The Messaging capability: a game whose provers' messages a regressor can read on their own.

``python -m nip_like.analyse message-regression`` asks each scenario with
this capability for its provers' messages in played episodes
(:meth:`Messaging.message_features`, as :class:`MessageFeatures`) and fits
a regressor that predicts the label from them alone
(:mod:`nip_like.analysis.message_regression`). Re-exported by
:mod:`nip_like.scenarios.base` beside the other capabilities.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from tensordict import TensorDictBase


#: The forms of message a regressor reads (:class:`MessageFeatures`).
MESSAGE_KINDS = ("vector", "image", "tokens")


@dataclass
class MessageFeatures:
    """What one agent (or several together) said in each of a batch of episodes, as a regressor's input.

    Parameters
    ----------
    who : str
        The agent (a prover).
    kind : str
        ``vector`` (``values`` is ``E, F``: one-hot messages, flattened),
        ``image`` (``E, C, H, W``: messages laid out on the image) or
        ``tokens`` (``E, L`` token ids, with ``mask``).
    values : Tensor
        The messages of each episode.
    mask : Tensor, optional
        For ``tokens``: which of the ``L`` tokens are real (``E, L``, bool).
    embedding : nn.Module, optional
        For ``tokens``: the sender's input embedding, whose mean over an
        episode's tokens a linear probe reads.
    """

    who: str
    kind: str
    values: torch.Tensor
    mask: torch.Tensor | None = None
    embedding: torch.nn.Module | None = None


class Messaging(ABC):
    """Capability: the provers' messages can be read on their own (``python -m nip_like.analyse message-regression``).

    Does the transcript carry the answer, or does the verifier decide from its
    own view? A scenario with this capability lays out each prover's messages
    in played episodes (:meth:`message_features`); the analysis fits a
    regressor that predicts the label from them alone and scores it on
    held-out episodes, beside the verifier's accuracy on the same episodes.
    The verifier's own messages are left out (its last one is its decision).
    """

    provides: ClassVar[str] = "messages a regressor can read"

    @abstractmethod
    def message_features(self, episodes: TensorDictBase, policy: Any) -> list[MessageFeatures]:
        """Each prover's messages in ``episodes`` (the analysis also reads them all together).

        Parameters
        ----------
        episodes : TensorDictBase
            As for :meth:`Scenario.episode_metrics`: the final step of each finished episode.
        policy : Any
            The agents' policy (a language-model agent's embedding is read from it).
        """

    def episode_labels(self, episodes: TensorDictBase) -> torch.Tensor:
        """Each episode's correct decision (``E``, bool: accept), read from ``("state", "label")`` by default."""
        return episodes["state", "label"].bool().reshape(-1)

    def episode_correct(self, episodes: TensorDictBase) -> torch.Tensor:
        """Whether the verifier decided each episode correctly (``E``, bool); undecided is wrong.

        Read from ``("state", "decision")`` (1 accept, 0 reject, -1 none) by default.
        """
        decision = episodes["state", "decision"].reshape(-1)
        return decision == self.episode_labels(episodes).long()


def one_hot_messages(sent: torch.Tensor, names: tuple[str, ...], provers: list[int], width: int) -> list[MessageFeatures]:
    """:class:`MessageFeatures` of messages that are choices among ``width`` (a node, a pixel), one-hot per step.

    Parameters
    ----------
    sent : Tensor
        ``E, T, M``: what each of the ``M`` transcript agents sent at each step, ``-1`` for nothing.
    names : tuple of str
        The ``M`` agents' names.
    provers : list of int
        The provers' positions among them.
    width : int
        How many messages an agent can choose from.

    Returns
    -------
    list of MessageFeatures
        One ``vector`` (``E, T * width``) per prover.
    """
    episodes, steps, _ = sent.shape
    one_hot = torch.zeros(episodes, steps, sent.shape[-1], width + 1, device=sent.device)
    one_hot.scatter_(-1, sent.remainder(width + 1).unsqueeze(-1), 1.0)  # nothing sent (-1) lands in the last slot
    return [MessageFeatures(names[index], "vector", one_hot[:, :, index, :width].reshape(episodes, -1)) for index in provers]
