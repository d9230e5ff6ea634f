"""Teacher-forced scoring of given messages: their tokens' log-probabilities, entropies and the value, in one pass.

:func:`score_rows` is one pass of :meth:`nip_like.lm.policy.LMPolicy.evaluate`
over some rows: the prompts and messages go through the model together, and
the logits that predict the message give each token's log-probability under
:func:`~nip_like.lm.sampling.processed_log_probs` (the distribution the
tokens were sampled from) and its entropy; the value head reads the last
hidden state at the last real token. With ``score_chunk_tokens``, the logits
are computed a chunk of positions at a time (:func:`chunked_scores`), so the
float32 logits are never held whole; ``"auto"`` (the default of an agent whose
model allows it) does so in passes with gradients only, in chunks of at most
:data:`AUTO_CHUNK_BYTES` of logits, since with gradients the last hidden state
is kept for the backward pass anyway while without them it would be extra.
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from nip_like.errors import ConfigError
from nip_like.lm.padding import position_ids
from nip_like.lm.sampling import SamplingSettings, entropy, processed_log_probs
from nip_like.lm.value import LMValueHead

#: Automatic chunking's limit on one chunk's float32 logits (rows x positions x vocabulary x 4 bytes): 256 MiB.
AUTO_CHUNK_BYTES = 2**28


def auto_chunk_positions(rows: int, vocab_size: int, message_length: int) -> int:
    """Positions per chunk under automatic chunking: as many as keep a chunk's logits within :data:`AUTO_CHUNK_BYTES`."""
    return max(1, min(message_length, AUTO_CHUNK_BYTES // max(1, rows * vocab_size * 4)))


def score_rows(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    tokens: torch.Tensor,
    token_mask: torch.Tensor,
    with_log_probs: bool,
    with_value: bool,
    value_of_prompt: bool = False,
    *,
    value_head: Optional[LMValueHead],
    banned: torch.Tensor,
    settings: SamplingSettings,
    keeps_logits: bool,
    score_chunk_tokens: Optional[int | str],
) -> dict[str, torch.Tensor]:
    """One teacher-forced pass over the given rows.

    Parameters
    ----------
    model : nn.Module
        The causal LM.
    prompt_ids, prompt_mask, tokens, token_mask : torch.Tensor
        ``(B, P)`` prompts and ``(B, T)`` messages, as for
        :meth:`~nip_like.lm.policy.LMPolicy.log_probs`.
    with_log_probs : bool
        Compute ``"token_log_probs"`` and ``"entropy"``.
    with_value : bool
        Compute ``"value"`` (``value_head`` must be given).
    value_of_prompt : bool
        The value at the prompt's last real token instead of the message's.
    value_head : LMValueHead, optional
        The value head.
    banned : torch.Tensor
        ``(vocab,)`` booleans: the tokens never sampled.
    settings : SamplingSettings
        Temperature, top-k and top-p.
    keeps_logits : bool
        Whether the model's ``forward`` takes ``logits_to_keep``.
    score_chunk_tokens : int or "auto", optional
        Score this many positions at a time (:func:`chunked_scores`); ``"auto"``:
        in chunks of :func:`auto_chunk_positions` when gradients are enabled or
        the message's logits would exceed :data:`AUTO_CHUNK_BYTES`, all at once
        otherwise; None: all at once.

    Returns
    -------
    dict of str to torch.Tensor
        The entries asked for, as :meth:`~nip_like.lm.policy.LMPolicy.evaluate` returns them.
    """
    prompt_length, message_length = prompt_ids.shape[1], tokens.shape[1]
    input_ids = torch.cat([prompt_ids, tokens], dim=-1)
    attention_mask = torch.cat([prompt_mask, token_mask], dim=-1).long()
    positions = position_ids(attention_mask)
    shared_hidden = with_value and value_head.shared_body
    if score_chunk_tokens == "auto":
        # With gradients, always (the chunks' logits are recomputed in the backward pass instead of kept). Without,
        # only when the message's logits would exceed one chunk: then the last hidden states (a few KiB a position)
        # are held instead of megabytes of logits a position, as with a 262,144-token vocabulary.
        vocab_size = banned.shape[0]
        whole = tokens.shape[0] * message_length * vocab_size * 4
        score_chunk_tokens = (
            auto_chunk_positions(tokens.shape[0], vocab_size, message_length)
            if torch.is_grad_enabled() or whole > AUTO_CHUNK_BYTES
            else None
        )
    chunked = with_log_probs and score_chunk_tokens is not None and message_length > 0  # no positions: nothing to chunk
    result: dict[str, torch.Tensor] = {}
    if with_log_probs or shared_hidden:
        extra = {}
        if keeps_logits:
            # Only the logits that predict the message: the last message_length + 1 positions (chunked: none kept).
            extra["logits_to_keep"] = message_length + 1 if with_log_probs and not chunked else 1
        output = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions,
            use_cache=False,
            output_hidden_states=shared_hidden or chunked,
            **extra,
        )
    if chunked:
        hidden = output.hidden_states[-1][:, prompt_length - 1 : prompt_length - 1 + message_length]
        token_log_probs, token_entropy = chunked_scores(
            model.get_output_embeddings(), hidden, tokens, score_chunk_tokens, banned, settings
        )
        result["token_log_probs"] = torch.where(token_mask, token_log_probs, 0.0)
        result["entropy"] = torch.where(token_mask, token_entropy, 0.0)
    elif with_log_probs:
        # The logits at position i predict token i + 1: the message's tokens are predicted from P - 1 on.
        first = 0 if keeps_logits else prompt_length - 1
        logits = output.logits[:, first : first + message_length]
        log_probs = processed_log_probs(logits, banned, settings)
        token_log_probs = log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        result["token_log_probs"] = torch.where(token_mask, token_log_probs, 0.0)
        result["entropy"] = torch.where(token_mask, entropy(log_probs), 0.0)
    if with_value:
        if shared_hidden:
            hidden = output.hidden_states[-1]
        else:
            hidden = value_head.body_last_hidden(input_ids, attention_mask, positions)
        counted = prompt_mask.long() if value_of_prompt else attention_mask
        last_real = (counted * torch.arange(counted.shape[1], device=counted.device)).argmax(-1)
        last_hidden = hidden[torch.arange(hidden.shape[0], device=hidden.device), last_real]
        result["value"] = value_head(last_hidden.float())
    return result


def chunked_scores(
    head: nn.Module, hidden: torch.Tensor, tokens: torch.Tensor, chunk_tokens: int, banned: torch.Tensor, settings: SamplingSettings
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, T)`` log-probabilities and entropies from the hidden states that predict ``tokens``, chunk by chunk.

    With gradients, each chunk's logits are recomputed in the backward pass
    instead of kept.
    """
    score = partial(chunk_scores, banned=banned, settings=settings)
    scores = []
    for start in range(0, tokens.shape[1], chunk_tokens):
        part = slice(start, start + chunk_tokens)
        if torch.is_grad_enabled():
            # A contiguous copy: a view would keep the whole hidden-state tensor alive for the recomputation.
            scores.append(checkpoint(score, head, hidden[:, part].contiguous(), tokens[:, part], use_reentrant=False))
        else:
            scores.append(score(head, hidden[:, part], tokens[:, part]))
    return torch.cat([lp for lp, _ in scores], dim=1), torch.cat([ent for _, ent in scores], dim=1)


def chunk_scores(
    head: nn.Module, hidden: torch.Tensor, tokens: torch.Tensor, *, banned: torch.Tensor, settings: SamplingSettings
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of :func:`chunked_scores`: the output layer on ``hidden``, then each token's log-probability and the entropy."""
    log_probs = processed_log_probs(head(hidden), banned, settings)
    return log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), entropy(log_probs)


def scores_in_chunks(model: nn.Module, output) -> bool:
    """Whether ``model``'s logits are its output layer applied to its last hidden state (so it can be scored in chunks).

    Parameters
    ----------
    model : nn.Module
        The causal LM.
    output
        Its output on a probe input, with ``output_hidden_states=True``.
    """
    with torch.no_grad():
        head = model.get_output_embeddings()
        if head is None:
            return False
        expected = output.logits[:, -1].float()
        found = head(output.hidden_states[-1][:, -1]).float()
    return found.shape == expected.shape and torch.allclose(found, expected, rtol=1e-4, atol=1e-4)


def check_chunking(model: nn.Module, output) -> None:
    """Refuse ``score_chunk_tokens`` for a model whose logits are not its output layer on its last hidden state.

    The model and its probe output are those of :func:`scores_in_chunks`.

    Raises
    ------
    ConfigError
        If the logits differ from the output layer applied to the last hidden state.
    """
    if not scores_in_chunks(model, output):
        raise ConfigError(
            f"score_chunk_tokens: the logits of {type(model).__name__} are not its output layer applied to its "
            "last hidden state (a soft cap or scale between them); set score_chunk_tokens=null (automatic: off for such a "
            "model) or 0 (all logits at once)"
        )
