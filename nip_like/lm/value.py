"""The value head of a language-model agent.

The value of a state (prompt plus message so far) is a linear function of
the last hidden state at its last real token. The hidden state comes either
from the policy's own transformer (a shared body: one forward pass gives
log-probabilities and value) or from a separate transformer body of the
same architecture, initialised as a copy of the policy's.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from nip_like.precision import float32_region

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class LMValueHead(nn.Module):
    """A linear value head, with an optional transformer body of its own.

    Parameters
    ----------
    hidden_size : int
        Width of the hidden states the head reads.
    body : PreTrainedModel, optional
        A transformer without LM head (such as ``model.base_model``) whose
        last hidden state the head reads; None: the head reads the policy's
        last hidden state (shared body).
    device : torch.device or str, optional
        Where the linear layer is made (the model's device); None: the
        default device.
    """

    def __init__(self, hidden_size: int, body: Optional[PreTrainedModel] = None, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.body = body
        self.linear = nn.Linear(hidden_size, 1, device=device)

    @classmethod
    def for_model(cls, model: PreTrainedModel, shared_body: bool = True) -> "LMValueHead":
        """Make a value head for ``model``.

        Parameters
        ----------
        model : PreTrainedModel
            The policy's causal LM.
        shared_body : bool
            True: read the policy's last hidden state. False: own a deep copy
            of ``model.base_model`` (same weights at the start, trained
            separately).

        Returns
        -------
        LMValueHead
        """
        hidden_size = model.config.get_text_config().hidden_size
        body = None if shared_body else copy.deepcopy(model.base_model)
        return cls(hidden_size, body, device=next(model.parameters()).device)

    @property
    def shared_body(self) -> bool:
        """Whether the head reads the policy's hidden states (no body of its own)."""
        return self.body is None

    def forward(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """Values from hidden states.

        Parameters
        ----------
        last_hidden : torch.Tensor
            ``(B, hidden_size)``: the last hidden state at each row's last
            real token.

        Returns
        -------
        torch.Tensor
            ``(B,)`` float32 values. The head computes in its weights' dtype
            (float32), also under autocast, whose linear layers would round
            the values to its dtype.
        """
        with float32_region(last_hidden.device):  # the module is called: under FSDP2 its call gathers the weights
            return self.linear(last_hidden.to(self.linear.weight.dtype)).float().squeeze(-1)

    def body_last_hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """The own body's last hidden states, ``(B, L, hidden_size)``.

        Parameters
        ----------
        input_ids, attention_mask, position_ids : torch.Tensor
            ``(B, L)`` inputs, as for the policy's forward pass.

        Returns
        -------
        torch.Tensor
        """
        if self.body is None:
            raise RuntimeError("this value head shares the policy's body; it has none of its own")
        output = self.body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
        return output.last_hidden_state
