"""The config of a frozen co-player played by an OpenAI-compatible chat server (``served:``).

Its own module, below the LM agents' config (:class:`~nip_like.lm.models.LMAgentConfig`
has a ``served`` field) and the players themselves (:mod:`nip_like.text.served`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from nip_like.allowed import checked

__all__ = ["ServedConfig", "is_served"]


@dataclass
class ServedConfig:
    """A frozen co-player played by an OpenAI-compatible chat server (``served:`` in the co-player's config).

    The co-player's chat (the messages a local co-player would read through
    its chat template) is sent as one ``/v1/chat/completions`` request, and
    the answer's text is its reply, read as a local co-player's reply text
    is. Requests go through :class:`~nip_like.openai_client.OpenAIClient`,
    the client of the text models and of the inference-server sampler: at
    most ``max_concurrency`` in flight, each waiting ``timeout`` seconds,
    retried ``max_retries`` times with backoff, and a stop request (SIGINT,
    SIGTERM) answered while the run waits. A server that fails for good stops
    the run with one :class:`~nip_like.errors.ModelServerError` line; the
    run's last checkpoint resumes it.
    """

    base_url: Optional[str] = None  # the server's API root, e.g. http://127.0.0.1:8000/v1; null = not served (played locally)
    model: Optional[str] = None  # the served model's name, sent with each request
    api_key_env: str = "OPENAI_API_KEY"  # environment variable holding the server's key (a local server needs none)
    max_concurrency: int = checked(8, ge=1)  # requests in flight at once
    max_retries: int = checked(3, ge=0)  # retries of a request that could not connect, met a 429/5xx or got malformed JSON
    retry_backoff: float = checked(0.5, gt=0)  # seconds before the first retry, doubled for each next one
    timeout: float = checked(60.0, gt=0)  # seconds a request may wait for its answer; one that gets none fails the run at once


def is_served(served: Any) -> bool:
    """Whether a ``served`` entry names a server (its ``base_url`` is set)."""
    return served is not None and bool(getattr(served, "base_url", None))
