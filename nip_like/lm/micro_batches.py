"""Scoring rows in micro-batches within a token budget, with the gradient of one pass.

:meth:`nip_like.lm.policy.LMPolicy.evaluate` sends its rows through the model
in groups of at most ``max_tokens_per_micro_batch`` padded tokens
(:func:`micro_batches`), rows of similar length together. With gradients and
``recompute``, each group's activations are freed after its forward pass and
recomputed in the backward pass (:func:`micro_batch_pass`), so the graph of
the whole update holds one group's activations at a time, while the loss
still sees every row: the gradient equals the one-pass gradient. Under FSDP2
every rank takes as many passes (:func:`lockstep_stand_ins`).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from nip_like import distributed
from nip_like.interrupts import stop_point
from nip_like.lm.padding import trim_padding_columns

#: One scoring pass over some rows: ``(prompt_ids, prompt_mask, tokens, token_mask, *options) -> scores``.
ScoreRows = Callable[..., dict[str, torch.Tensor]]


def micro_batches(lengths: torch.Tensor, width: int, budget: Optional[int]) -> list[torch.Tensor]:
    """Rows in groups whose padded size stays within a token budget, sorted by length.

    Parameters
    ----------
    lengths : torch.Tensor
        ``(B,)`` real tokens (prompt plus message) of each row.
    width : int
        Padded width of a row; a group of rows costs ``rows x longest row`` tokens.
    budget : int, optional
        Largest ``rows x longest row`` of a group; None: one group of all rows.

    Returns
    -------
    list of torch.Tensor
        Row indices of each group, rows of similar length together (shortest
        first), so that little of each pass is padding.

    Raises
    ------
    ValueError
        If one row alone is longer than the budget.
    """
    rows = lengths.shape[0]
    if budget is None or rows == 0:
        return [torch.arange(rows, device=lengths.device)]
    longest = int(lengths.max())
    if longest > budget:
        raise ValueError(
            f"max_tokens_per_micro_batch ({budget}) is below the longest sequence ({longest} tokens): "
            f"it must hold at least one prompt plus message"
        )
    order = lengths.argsort(stable=True).tolist()
    sorted_lengths = lengths[order].tolist()
    groups, start = [], 0
    for end in range(1, rows + 1):
        # Rows are sorted, so the group's longest row is its last one.
        if end == rows or (end + 1 - start) * sorted_lengths[end] > budget:
            groups.append(torch.tensor(order[start:end], device=lengths.device))
            start = end
    return groups


def largest_across_ranks(count: int, device: torch.device) -> int:
    """The largest ``count`` of all ranks (one ``all_reduce``), so that ranks in lockstep decide alike."""
    most = torch.tensor([count], device=device)
    torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
    return int(most)


def lockstep_stand_ins(passes: int, device: torch.device) -> int:
    """Stand-in passes this rank adds so that every rank takes as many scoring passes as the rank with most."""
    return largest_across_ranks(passes, device) - passes


def micro_batch_pass(score_rows: ScoreRows, inputs: tuple[torch.Tensor, ...], options: tuple, recompute: bool) -> dict[str, torch.Tensor]:
    """One micro-batch's pass; with gradients and ``recompute``, its activations are recomputed in the backward pass."""
    if recompute and torch.is_grad_enabled():
        return checkpoint(score_rows, *inputs, *options, use_reentrant=False)
    return score_rows(*inputs, *options)


def scores_by_micro_batch(
    score_rows: ScoreRows,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    tokens: torch.Tensor,
    token_mask: torch.Tensor,
    options: tuple,
    *,
    budget: Optional[int],
    lockstep: bool,
    recompute: Optional[bool],
    counts: list[int],
) -> dict[str, torch.Tensor]:
    """Score every row with ``score_rows``, in one pass or in micro-batches within ``budget``, and merge the scores.

    Parameters
    ----------
    score_rows : callable
        One pass over some rows (:func:`~nip_like.lm.teacher_forcing.score_rows` with
        the policy's model and distribution): ``score_rows(prompt_ids,
        prompt_mask, tokens, token_mask, *options)``.
    prompt_ids, prompt_mask, tokens, token_mask : torch.Tensor
        ``(B, P)`` prompts (already checked) and ``(B, T)`` messages.
    options : tuple
        The options handed on to ``score_rows``.
    budget : int, optional
        Token budget of one micro-batch (:func:`micro_batches`); None: one pass.
    lockstep : bool
        Take as many passes as the rank with most (:func:`lockstep_stand_ins`);
        a stand-in pass scores the first row and counts zero.
    recompute : bool, optional
        Recompute each micro-batch's activations in the backward pass; None:
        when there are several micro-batches.
    counts : list of int
        Real and padded tokens of the passes so far, incremented in place.

    Returns
    -------
    dict of str to torch.Tensor
        What ``score_rows`` returns, over all ``B`` rows: ``(B, T)`` entries
        (zero-padded past each group's longest message) and ``(B,)`` values.
    """
    lengths = prompt_mask.sum(-1) + token_mask.sum(-1)
    groups = micro_batches(lengths, prompt_ids.shape[1] + tokens.shape[1], budget)
    stand_ins = lockstep_stand_ins(len(groups), lengths.device) if lockstep else 0
    recompute = len(groups) > 1 if recompute is None else recompute
    if len(groups) == 1 and not stand_ins and not recompute:
        counts[0] += int(lengths.sum())
        counts[1] += lengths.numel() * (prompt_ids.shape[1] + tokens.shape[1])
        return score_rows(prompt_ids, prompt_mask, tokens, token_mask, *options)
    # Micro-batches: with recompute, each group's activations are freed after its forward pass and recomputed
    # in the backward pass (activation checkpointing per group), so the graph holds one group's activations
    # at a time, while the loss still sees every row: the gradient equals the one-pass gradient.
    parts = []
    # A stop request that has waited its grace ends the scoring between two micro-batches, in one process only:
    # under torchrun a rank that stopped there would leave the others waiting in their gradient sums.
    stops = not lockstep and not distributed.current().enabled
    for rows in groups:
        if stops:
            stop_point("a language model's scoring pass")
        group = trim_padding_columns(prompt_ids[rows], prompt_mask[rows])
        width = int(token_mask[rows].sum(-1).max())
        inputs = (*group, tokens[rows, :width], token_mask[rows, :width])
        counts[0] += int(lengths[rows].sum())
        counts[1] += rows.numel() * (group[0].shape[1] + width)
        parts.append((rows, micro_batch_pass(score_rows, inputs, options, recompute)))
    # Lockstep (FSDP2): as many passes as the rank with most micro-batches; a stand-in pass counts zero.
    for _ in range(stand_ins):
        rows = groups[0][:1]
        inputs = (*trim_padding_columns(prompt_ids[rows], prompt_mask[rows]), tokens[rows], token_mask[rows])
        part = micro_batch_pass(score_rows, inputs, options, recompute)
        parts.append((rows, {name: value * 0 for name, value in part.items()}))
    result = {}
    for name in parts[0][1]:
        shape = (tokens.shape[0], *(() if name == "value" else (tokens.shape[1],)))
        merged = None
        for rows, part in parts:
            value = part[name]
            if value.dim() == 2:
                value = nn.functional.pad(value, (0, tokens.shape[1] - value.shape[1]))
            if merged is None:
                merged = value.new_zeros(shape)
            # index_put keeps the gradient path into each group's pass (a stand-in adds its zeros).
            merged = merged.index_put((rows,), value, accumulate=True)
        result[name] = merged
    return result
