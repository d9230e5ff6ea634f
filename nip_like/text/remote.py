"""A text model behind any OpenAI-compatible chat-completions server.

:class:`OpenAIChatModel` sends each chat as one ``/v1/chat/completions``
request (the ``openai`` package), several in flight at once. Any server that
speaks the protocol works: vLLM (``vllm serve``), TGI, ``transformers serve``,
a hosted API.

Failures are bounded: each request waits at most ``timeout`` seconds, and a
request that could not reach the server, timed out, was rate limited, met a
server error (HTTP 5xx) or got an answer that is not the protocol's JSON is
retried ``max_retries`` times with exponential backoff (``retry_backoff``
seconds, doubled each time). After the last try, or at once for a request the
server refuses (another HTTP 4xx), the caller stops with one
:class:`~nip_like.errors.ModelServerError` line naming the server, the model
and the last error; the requests still queued are dropped and those in flight
stop retrying. :func:`check_text_model_server` asks the server for its models
(``GET <base_url>/models``) with the same retries, so that a run refuses a
server that does not answer before it starts.

Each request carries its own seed (derived from the batch's seed and the
chat's position), which servers that honour ``seed`` use to sample
reproducibly.
"""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Callable, Sequence, TypeVar
from urllib.parse import urlsplit

from nip_like.checkpoint import derive_seed
from nip_like.errors import ConfigError, ModelServerError
from nip_like.text.interface import Chat, Sampling, TextModel

#: Where the base URL comes from when the config does not give one.
BASE_URL_ENV = "OPENAI_BASE_URL"

T = TypeVar("T")


class MalformedAnswer(Exception):
    """A server's answer that is not the protocol's JSON (retried like a server error)."""


class _Abandoned(Exception):
    """A request given up because another request of the same batch failed for good."""


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
        self.timeout = float(timeout)
        # The client's own retries are off: this class retries, with its own backoff and error line.
        self.client = openai.OpenAI(base_url=base_url, api_key=api_key or "none", max_retries=0, timeout=timeout)

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
        failed = threading.Event()  # set by the first request that fails for good: the others stop
        pool = ThreadPoolExecutor(max_workers=self.max_concurrency)
        try:
            futures = [pool.submit(self._request, chat, chat_seed, sampling, failed) for chat, chat_seed in zip(chats, seeds)]
            wait(futures, return_when=FIRST_EXCEPTION)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        errors = [future.exception() for future in futures if not future.cancelled() and future.exception() is not None]
        if errors:
            # The request that failed for good, not one that stopped because of it.
            raise next((error for error in errors if not isinstance(error, _Abandoned)), errors[0])
        return [future.result() for future in futures]

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
                raise MalformedAnswer(f"malformed JSON answer: {_one_line(error)}") from None
            try:
                content = response.choices[0].message.content
            except (AttributeError, IndexError, KeyError, TypeError) as error:
                raise MalformedAnswer(f"an answer without choices[0].message.content ({type(error).__name__}: {_one_line(error)})") from None
            if content is not None and not isinstance(content, str):
                raise MalformedAnswer(f"an answer whose message content is not text: {content!r:.80}")
            return content or ""

        return self.with_retries(ask, f"model {self.model}", failed)

    def check_server(self) -> None:
        """Ask the server for its models (``GET <base_url>/models``), with the retries and timeout of a request.

        A server that answers the request with JSON passes; one that answers
        404 or 405 (it serves no model list) passes too, as it answers.

        Raises
        ------
        ModelServerError
            The server cannot be reached, does not answer in time, answers
            with a server error or malformed JSON after every retry, or
            refuses the request (e.g. HTTP 401 for a wrong key), in one line.
        """
        import httpx

        def ask() -> None:
            try:
                response = self.client.get("/models", cast_to=httpx.Response)
            except self._openai.APIStatusError as error:
                if error.status_code in (404, 405):
                    return
                raise
            try:
                json.loads(response.content)
            except ValueError as error:
                raise MalformedAnswer(f"malformed JSON answer to GET /models: {_one_line(error)}") from None

        self.with_retries(ask, "GET /models")

    def with_retries(self, call: Callable[[], T], action: str, failed: threading.Event | None = None) -> T:
        """``call()``, retried with backoff on the failures worth retrying; one :class:`ModelServerError` line otherwise.

        Parameters
        ----------
        call : callable
            One try.
        action : str
            What is asked, for the message (``model <name>``, ``GET /models``).
        failed : threading.Event, optional
            Shared by the requests of one batch: set when one fails for good,
            after which the others stop instead of retrying.
        """
        openai = self._openai
        retryable = (openai.APIConnectionError, openai.RateLimitError, openai.InternalServerError, MalformedAnswer)
        for attempt in range(self.max_retries + 1):
            if failed is not None and failed.is_set():
                raise _Abandoned()
            try:
                return call()
            except retryable as error:
                if attempt == self.max_retries:
                    if failed is not None:
                        failed.set()
                    raise ModelServerError(
                        f"text-model server {self.base_url} ({action}) failed after {attempt + 1} "
                        f"{'try' if attempt == 0 else 'tries'} (timeout "
                        f"{self.timeout:g} s): {_reason(error)}"
                    ) from None
                delay = self.retry_backoff * 2**attempt
                if failed is None:
                    time.sleep(delay)
                elif failed.wait(delay):  # another request failed for good meanwhile
                    raise _Abandoned() from None
            except openai.APIStatusError as error:
                if failed is not None:
                    failed.set()
                raise ModelServerError(f"text-model server {self.base_url} refused {action}: {_reason(error)}") from None
        raise AssertionError("unreachable")  # pragma: no cover

    def close(self) -> None:
        self.client.close()


def check_base_url(url: str, source: str = "base_url") -> None:
    """Refuse, in one line, a server URL that is not ``http(s)://host[:port][/path]``.

    Parameters
    ----------
    url : str
        The URL.
    source : str
        Where it comes from (the option or environment variable), for the message.

    Raises
    ------
    ConfigError
        The URL has another scheme or no host.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{source} must be an http:// or https:// URL with a host (e.g. http://127.0.0.1:8000/v1), not {url!r}")


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


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


def _reason(error: Exception) -> str:
    """An API error in one line: its status code (if any) and message."""
    if isinstance(error, MalformedAnswer):
        return str(error)
    status = getattr(error, "status_code", None)
    message = _one_line(error)
    return f"HTTP {status}: {message}" if status is not None else f"{type(error).__name__}: {message}"
