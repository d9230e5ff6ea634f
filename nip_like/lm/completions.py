"""Requests to an OpenAI-compatible ``/v1/completions`` endpoint in token ids, and reading their answers.

The wire protocol of the inference-server sampler (:mod:`nip_like.lm.server`):
a prompt goes out as token ids with vLLM's ``return_tokens_as_token_ids``,
and a reply comes back as token ids (tokens named ``token_id:<id>``) with
their log-probabilities, or as text that the agent's tokenizer re-tokenizes
(:func:`read_choice`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Sequence

from nip_like.openai_client import MalformedAnswer, OpenAIClient

#: A token named by its id (vLLM's ``return_tokens_as_token_ids``).
TOKEN_ID = re.compile(r"^token_id:(\d+)$")
#: The OpenAI logit bias that bans a token.
BAN = -100


class NoLogProbs(Exception):
    """A completion without per-token log-probabilities."""


@dataclass(frozen=True)
class CompletionPrompt:
    """One prompt's request: its token ids, the most tokens of the reply, its seed."""

    ids: list[int]
    max_tokens: int
    seed: int


def completion_settings(temperature: float, top_k: int, top_p: float) -> dict[str, Any]:
    """The sampling settings of a request."""
    return {"temperature": temperature, "top_k": top_k, "top_p": top_p}


def completions_client(sampler: Any) -> OpenAIClient:
    """The client of an agent's server (``sampler``: its :class:`~nip_like.lm.server.SamplerConfig`), with its retries and timeout."""
    return OpenAIClient(
        model=str(sampler.model or ""),
        base_url=str(sampler.base_url),
        api_key=os.environ.get(str(sampler.api_key_env)),
        max_concurrency=int(sampler.max_concurrency),
        max_retries=int(sampler.max_retries),
        retry_backoff=float(sampler.retry_backoff),
        timeout=float(sampler.timeout),
        label="inference server",
    )


def complete(client, model: str, prompt: CompletionPrompt, settings: dict[str, Any], stop: Sequence[str], bias: dict[str, int], failed=None):
    """One ``/v1/completions`` request for one prompt, with the client's retries; its first choice."""
    extra = {
        "return_tokens_as_token_ids": True,  # vLLM: tokens named token_id:<id>
        "skip_special_tokens": False,
        "include_stop_str_in_output": True,
        "top_k": settings["top_k"] if settings["top_k"] else -1,
    }

    def ask():
        try:
            response = client.client.completions.create(
                model=model,
                prompt=[prompt.ids],
                max_tokens=prompt.max_tokens,
                temperature=settings["temperature"],
                top_p=settings["top_p"],
                logprobs=1,
                seed=prompt.seed,
                stop=list(stop) or None,
                logit_bias=bias or None,
                extra_body=extra,
            )
        except ValueError as error:
            raise MalformedAnswer(f"malformed JSON answer: {' '.join(str(error).split())}") from None
        try:
            return response.choices[0]
        except (AttributeError, IndexError, TypeError) as error:
            raise MalformedAnswer(f"an answer without choices[0] ({type(error).__name__})") from None

    return client.with_retries(ask, f"completions of model {model}", failed)


def read_choice(choice, tokenizer) -> tuple[list[int], list[float], str, bool, bool]:
    """A choice's token ids, their log-probabilities, its finish reason, whether it was re-tokenized and whether that differed."""
    logprobs = getattr(choice, "logprobs", None)
    names = getattr(logprobs, "tokens", None) if logprobs is not None else None
    values = getattr(logprobs, "token_logprobs", None) if logprobs is not None else None
    if names is None or values is None or len(names) != len(values) or any(value is None for value in values):
        raise NoLogProbs()
    reason = str(getattr(choice, "finish_reason", None) or "length")
    matches = [TOKEN_ID.match(str(name)) for name in names]
    if all(matches):
        return [int(match.group(1)) for match in matches], [float(value) for value in values], reason, False, False
    if tokenizer is None:
        return [], [float(value) for value in values], reason, True, False
    ids = tokenizer(str(choice.text or ""), add_special_tokens=False)["input_ids"]
    pieces = [tokenizer.decode([token]) for token in ids]
    mismatch = pieces != [str(name) for name in names]
    # Re-tokenized text keeps the server's log-probabilities only where the tokens agree.
    server = [float(value) for value in values] if not mismatch else [float("nan")] * len(ids)
    return list(ids), server, reason, True, mismatch
