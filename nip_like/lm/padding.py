"""The padded layout of a language-model agent's prompts: positions, checks and trimming.

Prompts are dense ``(B, P)`` token tensors with a boolean mask, padded on the
left (any layout of the mask works: positions are counted over the real
tokens only). Position ids are ``mask.cumsum(-1) - 1`` clamped at 0
everywhere (:func:`position_ids`), so a left-padded row gets the same logits
as the same row unpadded, and columns that are padding in every row can be
dropped before a pass without changing its outputs at the real tokens.
"""

from __future__ import annotations

import torch


def position_ids(mask: torch.Tensor) -> torch.Tensor:
    """Position of each token among the real tokens of its row.

    Parameters
    ----------
    mask : torch.Tensor
        ``(B, L)`` attention mask (bool or 0/1).

    Returns
    -------
    torch.Tensor
        ``(B, L)`` long: ``mask.cumsum(-1) - 1`` clamped at 0 (padding
        before the first real token gets position 0).
    """
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def check_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> None:
    """Refuse prompts that are not ``(B, P)`` with a boolean mask of the same shape and a real token in every row.

    Raises
    ------
    ValueError
        Naming what is wrong with the prompts.
    """
    if prompt_ids.dim() != 2 or prompt_mask.shape != prompt_ids.shape:
        raise ValueError(
            f"prompts must be (B, P) with a mask of the same shape, got {tuple(prompt_ids.shape)} "
            f"and {tuple(prompt_mask.shape)}"
        )
    if prompt_mask.dtype != torch.bool:
        raise ValueError(f"the prompt mask must be boolean, got {prompt_mask.dtype}")
    if not bool(prompt_mask.any(-1).all()):
        raise ValueError("every prompt needs at least one real token (start prompts with <bos>)")


def trim_left_padding(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop the leading columns of left-padded ``(B, P)`` prompts that are padding in every row.

    Positions are counted over real tokens (:func:`position_ids`), so the
    model's outputs at the real tokens do not change; the pass gets shorter.
    """
    real_columns = mask.any(0)
    if not bool(real_columns.any()):
        return ids, mask
    first = int(real_columns.long().argmax())
    return ids[:, first:], mask[:, first:]


def kept_columns(mask: torch.Tensor) -> torch.Tensor:
    """``(P,)``: the columns of ``(B, P)`` prompts that :func:`trim_padding_columns` keeps (all of them when no row has a real token)."""
    keep = mask.any(0)
    if not bool(keep.any()):
        return torch.ones_like(keep)
    keep[-1] = True
    return keep


def trim_padding_columns(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop every column of ``(B, P)`` prompts that is padding in every row, but the last column.

    Besides the leading padding of left-padded prompts (:func:`trim_left_padding`),
    this drops the empty slots inside or at the end of fixed layouts (the
    token view's prompts: a prover that speaks first has 8 empty slots of 26).
    Positions are counted over real tokens and padding is never attended to,
    so the outputs at the remaining columns do not change (the teacher-forced
    scores come out bitwise equal on CPU); the pass gets shorter. The last
    column stays even where it is padding everywhere: its output predicts the
    message's first token.
    """
    keep = kept_columns(mask)
    if bool(keep.all()):
        return ids, mask
    return ids[:, keep], mask[:, keep]
