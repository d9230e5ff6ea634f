"""A text model behind any OpenAI-compatible chat-completions server.

:class:`OpenAIChatModel` sends each chat as one ``/v1/chat/completions``
request (the ``openai`` package), several in flight at once. Any server that
speaks the protocol works: vLLM (``vllm serve``), TGI, ``transformers serve``,
a hosted API.

Failures are bounded by :class:`~nip_like.openai_client.OpenAIClient`'s
retries and timeout; when one request of a batch fails for good, the requests
still queued are dropped and those in flight stop retrying.
:func:`check_text_model_server` asks the server for its models (``GET
<base_url>/models``) with the same retries, so that a run refuses a server
that does not answer before it starts.

Each request carries its own seed (derived from the batch's seed and the
chat's position), which servers that honour ``seed`` use to sample
reproducibly.
"""

from __future__ import annotations

import os
import threading
from typing import Sequence

from nip_like.checkpoint import derive_seed
from nip_like.errors import ConfigError, ModelServerError
from nip_like.openai_client import MalformedAnswer, OpenAIClient, check_base_url, one_line
from nip_like.text.interface import Chat, Sampling, TextModel

#: Where the base URL comes from when the config does not give one.
BASE_URL_ENV = "OPENAI_BASE_URL"

__all__ = ["BASE_URL_ENV", "MalformedAnswer", "OpenAIChatModel", "check_base_url", "check_text_model_server"]


class OpenAIChatModel(OpenAIClient, TextModel):
    """Replies from a chat-completions server (see the module docstring; the parameters are :class:`~nip_like.openai_client.OpenAIClient`'s)."""

    @classmethod
    def from_config(cls, config, default_model: str) -> "OpenAIChatModel":
        """The client of a :class:`~nip_like.text.interface.TextModelConfig` with ``backend: openai``."""
        base_url = config.base_url or os.environ.get(BASE_URL_ENV)
        if not base_url:
            raise ConfigError(f"backend openai needs the server's URL: set base_url or the {BASE_URL_ENV} environment variable")
        check_base_url(str(base_url), "base_url" if config.base_url else BASE_URL_ENV)
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
        return self.map(lambda item, failed: self._request(*item, sampling, failed), list(zip(chats, seeds)))

    def _request(self, chat: Chat, seed: int, sampling: Sampling, failed: threading.Event | None = None) -> str:
        def ask() -> str:
            try:
                response = self.client.chat.completions.create(
                    model=self.model,
                    messages=list(chat),
                    max_tokens=sampling.max_new_tokens,
                    temperature=sampling.temperature,
                    top_p=sampling.top_p,
                    seed=seed,
                )
            except ValueError as error:  # the body is not JSON (json.JSONDecodeError) or not the protocol's
                raise MalformedAnswer(f"malformed JSON answer: {one_line(error)}") from None
            try:
                content = response.choices[0].message.content
            except (AttributeError, IndexError, KeyError, TypeError) as error:
                raise MalformedAnswer(f"an answer without choices[0].message.content ({type(error).__name__}: {one_line(error)})") from None
            if content is not None and not isinstance(content, str):
                raise MalformedAnswer(f"an answer whose message content is not text: {content!r:.80}")
            return content or ""

        return self.with_retries(ask, f"model {self.model}", failed)


def check_text_model_server(config, where: str) -> None:
    """Refuse, in one line, the server of an ``openai`` text model that does not answer (see the module docstring).

    Parameters
    ----------
    config : TextModelConfig
        The text model's config (``backend: openai``): its URL, key, timeout and retries.
    where : str
        The config path of the model, which the message names (``scenario.default_model``).

    Raises
    ------
    ConfigError
        No URL is set.
    ModelServerError
        The server does not answer, after the retries.
    """
    try:
        client = OpenAIChatModel.from_config(config, default_model="")
    except ConfigError as error:
        message = str(error)
        raise ConfigError(f"{where}.{message}" if message.startswith("base_url ") else f"{where}: {message}") from None
    try:
        client.check_server()
    except ModelServerError as error:
        raise ModelServerError(f"{where}: {error}") from None
    finally:
        client.close()
