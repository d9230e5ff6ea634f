"""A text model behind any OpenAI-compatible chat-completions server.

:class:`OpenAIChatModel` sends each chat as one ``/v1/chat/completions``
request (the ``openai`` package), several in flight at once, and retries a
request that could not reach the server, timed out, was rate limited or met a
server error, with exponential backoff. Any server that speaks the protocol
works: vLLM (``vllm serve``), TGI, ``transformers serve``, a hosted API. A
server that cannot be reached, or refuses a request, stops the caller with one
:class:`~nip_like.errors.ModelServerError` line naming the server, the model
and the reason.

Each request carries its own seed (derived from the batch's seed and the
chat's position), which servers that honour ``seed`` use to sample
reproducibly.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from nip_like.checkpoint import derive_seed
from nip_like.errors import ConfigError, ModelServerError
from nip_like.text.models import Chat, Sampling, TextModel

#: Where the base URL comes from when the config does not give one.
BASE_URL_ENV = "OPENAI_BASE_URL"


class OpenAIChatModel(TextModel):
    """Replies from a chat-completions server (see the module docstring).

    Parameters
    ----------
    model : str
        The model name sent with each request (for ``transformers serve``, a
        model folder's path).
    base_url : str
        The server's API root, e.g. ``http://127.0.0.1:8000/v1``.
    api_key : str, optional
        Sent as the bearer token; local servers need none.
    max_concurrency : int
        Requests in flight at once.
    max_retries : int
        Retries of a request that failed for a reason worth retrying.
    retry_backoff : float
        Seconds before the first retry; doubled for each next one.
    timeout : float
        Seconds before a request counts as failed.
    """

    def __init__(
        self,
        model: str,
        base_url: str,
        api_key: str | None = None,
        max_concurrency: int = 8,
        max_retries: int = 3,
        retry_backoff: float = 0.5,
        timeout: float = 60.0,
    ) -> None:
        try:
            import openai
        except ImportError as error:  # pragma: no cover - openai is a dependency
            raise ConfigError("backend openai needs the openai package: pip install openai") from error
        self._openai = openai
        self.model = model
        self.base_url = base_url
        self.max_concurrency = int(max_concurrency)
        self.max_retries = int(max_retries)
        self.retry_backoff = float(retry_backoff)
        # The client's own retries are off: this class retries, with its own backoff and error line.
        self.client = openai.OpenAI(base_url=base_url, api_key=api_key or "none", max_retries=0, timeout=timeout)

    @classmethod
    def from_config(cls, config, default_model: str) -> "OpenAIChatModel":
        """The client of a :class:`~nip_like.text.models.TextModelConfig` with ``backend: openai``."""
        base_url = config.base_url or os.environ.get(BASE_URL_ENV)
        if not base_url:
            raise ConfigError(f"backend openai needs the server's URL: set base_url or the {BASE_URL_ENV} environment variable")
        return cls(
            model=str(config.model or default_model),
            base_url=str(base_url),
            api_key=os.environ.get(str(config.api_key_env)),
            max_concurrency=int(config.max_concurrency),
            max_retries=int(config.max_retries),
            retry_backoff=float(config.retry_backoff),
            timeout=float(config.timeout),
        )

    def reply(self, chats: Sequence[Chat], sampling: Sampling, seed: int) -> list[str]:
        seeds = [derive_seed(seed, f"request:{index}") for index in range(len(chats))]
        with ThreadPoolExecutor(max_workers=self.max_concurrency) as pool:
            return list(pool.map(lambda args: self._request(*args, sampling), zip(chats, seeds)))

    def _request(self, chat: Chat, seed: int, sampling: Sampling) -> str:
        openai = self._openai
        retryable = (openai.APIConnectionError, openai.APITimeoutError, openai.RateLimitError, openai.InternalServerError)
        for attempt in range(self.max_retries + 1):
            try:
                response = self.client.chat.completions.create(
                    model=self.model,
                    messages=list(chat),
                    max_tokens=sampling.max_new_tokens,
                    temperature=sampling.temperature,
                    top_p=sampling.top_p,
                    seed=seed,
                )
                return response.choices[0].message.content or ""
            except retryable as error:
                if attempt == self.max_retries:
                    reason = _reason(error)
                    raise ModelServerError(
                        f"text-model server {self.base_url} (model {self.model}) failed after {attempt + 1} tries: {reason}"
                    ) from None
                time.sleep(self.retry_backoff * 2**attempt)
            except openai.APIStatusError as error:
                raise ModelServerError(
                    f"text-model server {self.base_url} refused model {self.model}: {_reason(error)}"
                ) from None
        raise AssertionError("unreachable")  # pragma: no cover

    def close(self) -> None:
        self.client.close()


def _reason(error: Exception) -> str:
    """An API error in one line: its status code (if any) and message."""
    status = getattr(error, "status_code", None)
    message = " ".join(str(error).split())
    return f"HTTP {status}: {message}" if status is not None else f"{type(error).__name__}: {message}"
