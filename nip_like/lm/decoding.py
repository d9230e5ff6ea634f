"""The decoding loop of a language-model agent: one message per prompt, token by token, with the KV cache.

:func:`decode` is the loop behind :meth:`nip_like.lm.policy.LMPolicy.sample`:
one pass over the prompts, then one pass per token with the KV cache, each
token drawn from :func:`~nip_like.lm.sampling.processed_log_probs` (or its
most likely one), until every row has ended with ``<eos>`` or a stop string
or has ``max_new_tokens`` tokens. The messages come out dense and padded
(:func:`sampled_messages`). The KV cache's name in the model's ``forward``
changed in transformers 5.24 (:func:`cache_argument`). A stop request
(:mod:`nip_like.interrupts`) that has waited its grace ends the loop before
the next token (:func:`~nip_like.interrupts.stop_point`), and also before
each decoder layer of a pass (:func:`stop_points_in_layers`): a pass over
long prompts at a large batch (a 256-row evaluation of a 262,144-token
model: about a minute on one CPU thread) is cut between two layers, not
waited for. The messages under way are dropped, never returned half-written.

This is the *eager* path: the model's own cache grows by one slot per token
and each token is a few hundred kernel launches. The static KV cache and the
compiled step that ``LMPolicy.sample`` takes on CUDA, with the same inputs
and outputs, are in :mod:`nip_like.lm.static_decoding`.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import Callable, Iterator, Optional, Sequence

import torch
from torch import nn

from nip_like.interrupts import stop_point
from nip_like.lm.padding import check_prompts, position_ids, trim_left_padding
from nip_like.lm.sampling import SamplingSettings, entropy, processed_log_probs
from nip_like.lm.sharding import decoder_layers


#: Decoding, as a stop request in the middle of it is reported.
DECODING_PHASE = "a language model's decoding"


def cache_argument(model: nn.Module) -> str:
    """The name under which ``model.forward`` takes the KV cache: ``cache`` (transformers 5.24 on; ``past_key_values`` is deprecated there until 5.40) or ``past_key_values`` (4.56 to 5.23)."""
    return "cache" if "cache" in forward_parameters(model) else "past_key_values"


def forward_parameters(model: nn.Module) -> set[str]:
    """The keyword parameters of the transformers model's forward (under a peft wrapper, the base model's)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return set(inspect.signature(base.forward).parameters)


def _cache_of(output) -> object:
    """The KV cache a forward pass returned, under either of its names."""
    return output["cache"] if "cache" in output else output["past_key_values"]


def sampled_messages(
    tokens: torch.Tensor, token_mask: torch.Tensor, token_log_probs: torch.Tensor, token_entropy: torch.Tensor, finished: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The dict of :meth:`~nip_like.lm.policy.LMPolicy.sample`: the messages, their scores, and the sums and counts derived from them."""
    return {
        "tokens": tokens,
        "token_mask": token_mask,
        "token_log_probs": token_log_probs,
        "token_entropy": token_entropy,
        "log_prob": token_log_probs.sum(-1),
        "num_tokens": token_mask.sum(-1),
        "finished": finished,
    }


def draw_tokens(log_probs: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
    """One token per row from ``(B, vocab)`` log-probabilities, ``(B,)`` long.

    A generator on another device than ``log_probs`` gets the probabilities
    copied to its device; the tokens come back on ``log_probs``'s device.
    """
    probs = log_probs.exp()
    if generator is not None and generator.device != probs.device:
        probs = probs.to(generator.device)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1).to(log_probs.device)


def rows_ending_with_stop(
    tokens: torch.Tensor, candidates: torch.Tensor, ends_with_stop: Callable[[Sequence[int]], bool]
) -> torch.Tensor:
    """``(B,)``: rows among ``candidates`` whose last tokens' text contains a stop string (``ends_with_stop`` of the row's ids)."""
    hit = torch.zeros_like(candidates)
    rows = candidates.nonzero().squeeze(-1).tolist()
    if not rows:
        return hit
    for row in rows:
        hit[row] = ends_with_stop(tokens[row].tolist())
    return hit


def message_buffers(batch_size: int, length: int, pad_token_id: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """A decoding loop's buffers for ``batch_size`` messages of up to ``length`` tokens, on ``device``.

    Returns
    -------
    tuple of torch.Tensor
        ``tokens`` (pad-filled, long), ``token_mask``, ``token_log_probs`` and
        ``token_entropy`` (zeros), each ``(batch_size, length)``; ``alive``
        (ones) and ``ended`` (zeros), ``(batch_size,)`` booleans.
    """
    return (
        torch.full((batch_size, length), pad_token_id, dtype=torch.long, device=device),
        torch.zeros((batch_size, length), dtype=torch.bool, device=device),
        torch.zeros((batch_size, length), dtype=torch.float32, device=device),
        torch.zeros((batch_size, length), dtype=torch.float32, device=device),
        torch.ones(batch_size, dtype=torch.bool, device=device),
        torch.zeros(batch_size, dtype=torch.bool, device=device),
    )


def _layer_stop_point(module: nn.Module, args: tuple) -> None:
    stop_point(DECODING_PHASE)


@contextmanager
def stop_points_in_layers(model: nn.Module, stops: bool = True) -> Iterator[None]:
    """While it lasts, each decoder layer of ``model`` looks for a due stop request before it runs (a forward pre-hook).

    The layers are those FSDP2 shards one by one
    (:func:`~nip_like.lm.sharding.decoder_layers`). One pass of a large batch
    (the prompts' pass above all) is then cut within a layer's time of the
    grace's end. Nothing is registered when ``stops`` is false (a sharded
    model's ranks must take every pass together).
    """
    handles = [layer.register_forward_pre_hook(_layer_stop_point) for layer in decoder_layers(model)] if stops else []
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def decode(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    generator: Optional[torch.Generator],
    greedy: bool,
    *,
    max_new_tokens: int,
    pad_token_id: int,
    eos_token_id: int,
    banned: torch.Tensor,
    settings: SamplingSettings,
    keeps_logits: bool,
    cache_argument: str,
    ends_with_stop: Optional[Callable[[Sequence[int]], bool]] = None,
    stops: bool = True,
) -> dict[str, torch.Tensor]:
    """Sample one message per prompt with the KV cache (the model already in eval mode, gradients off).

    Parameters
    ----------
    model : nn.Module
        The causal LM.
    prompt_ids, prompt_mask : torch.Tensor
        ``(B, P)`` prompts (see :meth:`~nip_like.lm.policy.LMPolicy.sample`).
    generator : torch.Generator, optional
        Source of randomness (see :func:`draw_tokens`).
    greedy : bool
        Take the most likely token of the processed distribution at each step.
    max_new_tokens : int
        Length ``T`` of a message, ``<eos>`` included.
    pad_token_id, eos_token_id : int
        The tokenizer's pad and eos tokens.
    banned : torch.Tensor
        ``(vocab,)`` booleans: the tokens never sampled.
    settings : SamplingSettings
        Temperature, top-k and top-p.
    keeps_logits : bool
        Whether the model's ``forward`` takes ``logits_to_keep``.
    cache_argument : str
        The name of the KV cache in the model's ``forward`` (:func:`cache_argument`).
    ends_with_stop : callable, optional
        Whether a row's tokens end with a stop string; None: no stop strings.
    stops : bool
        Look for a stop request before each token and each decoder layer of a pass
        (:func:`~nip_like.interrupts.stop_point`, :func:`stop_points_in_layers`);
        False for a sharded model, whose ranks must take every pass together.

    Returns
    -------
    dict of str to torch.Tensor
        As :meth:`~nip_like.lm.policy.LMPolicy.sample` returns it (:func:`sampled_messages`).

    Raises
    ------
    StopNow
        If a stop request has waited its grace (:mod:`nip_like.interrupts`): no message is returned.
    """
    with stop_points_in_layers(model, stops):
        check_prompts(prompt_ids, prompt_mask)
        prompt_ids, prompt_mask = trim_left_padding(prompt_ids, prompt_mask)
        batch_size, device = prompt_ids.shape[0], prompt_ids.device
        length = max_new_tokens
        tokens, token_mask, token_log_probs, token_entropy, alive, ended = message_buffers(
            batch_size, length, pad_token_id, device
        )

        attention_mask = prompt_mask.long()
        next_position = attention_mask.sum(-1, keepdim=True)
        # The prompt's pass needs the logits of its last position only (as generate's logits_to_keep=1).
        last_logits = {"logits_to_keep": 1} if keeps_logits else {}
        output = model(
            input_ids=prompt_ids,
            attention_mask=attention_mask,
            position_ids=position_ids(attention_mask),
            use_cache=True,
            **last_logits,
        )
        for step in range(length):
            if stops:
                stop_point(DECODING_PHASE)
            log_probs = processed_log_probs(output.logits[:, -1], banned, settings)
            token = log_probs.argmax(-1) if greedy else draw_tokens(log_probs, generator)
            token_log_prob = log_probs.gather(-1, token.unsqueeze(-1)).squeeze(-1)
            tokens[:, step] = torch.where(alive, token, pad_token_id)
            token_mask[:, step] = alive
            token_log_probs[:, step] = torch.where(alive, token_log_prob, 0.0)
            token_entropy[:, step] = torch.where(alive, entropy(log_probs), 0.0)
            stopped = alive & (token == eos_token_id)
            if ends_with_stop is not None:
                stopped = stopped | rows_ending_with_stop(tokens[:, : step + 1], alive & ~stopped, ends_with_stop)
            ended = ended | stopped
            alive = alive & ~stopped
            if step == length - 1 or not bool(alive.any()):
                break
            attention_mask = torch.cat([attention_mask, token_mask[:, step : step + 1].long()], dim=-1)
            output = model(
                input_ids=tokens[:, step : step + 1],
                attention_mask=attention_mask,
                position_ids=next_position + step,
                use_cache=True,
                **{cache_argument: _cache_of(output)},
            )
        return sampled_messages(tokens, token_mask, token_log_probs, token_entropy, ended)
