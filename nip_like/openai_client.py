"""A client of an OpenAI-compatible server with bounded failures, shared by the text models and the LM agents' sampler.

:class:`OpenAIClient` holds an ``openai`` client whose own retries are off and
retries itself: each request waits at most ``timeout`` seconds, and one that
could not reach the server, timed out, was rate limited, met a server error
(HTTP 5xx) or got an answer that is not the protocol's JSON is retried
``max_retries`` times with exponential backoff (``retry_backoff`` seconds,
doubled each time). After the last try, or at once for a request the server
refuses (another HTTP 4xx), the caller stops with one
:class:`~nip_like.errors.ModelServerError` line naming the server, what was
asked and the last error. :meth:`OpenAIClient.check_server` asks the server
for its models (``GET <base_url>/models``) with the same retries.

The text agents' chat model (:class:`~nip_like.text.remote.OpenAIChatModel`)
and the inference-server sampler of LM agents (:mod:`nip_like.lm.server`)
both talk to their servers through it.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Callable, TypeVar
from urllib.parse import urlsplit

from nip_like.errors import ConfigError, ModelServerError

T = TypeVar("T")


class MalformedAnswer(Exception):
    """A server's answer that is not the protocol's JSON (retried like a server error)."""


class Abandoned(Exception):
    """A request given up because another request of the same batch failed for good."""


class OpenAIClient:
    """A connection to an OpenAI-compatible server, with the retries and timeout of the module docstring.

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
                raise MalformedAnswer(f"malformed JSON answer to GET /models: {one_line(error)}") from None

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
                raise Abandoned()
            try:
                return call()
            except retryable as error:
                if attempt == self.max_retries:
                    if failed is not None:
                        failed.set()
                    raise ModelServerError(
                        f"text-model server {self.base_url} ({action}) failed after {attempt + 1} "
                        f"{'try' if attempt == 0 else 'tries'} (timeout "
                        f"{self.timeout:g} s): {reason(error)}"
                    ) from None
                delay = self.retry_backoff * 2**attempt
                if failed is None:
                    time.sleep(delay)
                elif failed.wait(delay):  # another request failed for good meanwhile
                    raise Abandoned() from None
            except openai.APIStatusError as error:
                if failed is not None:
                    failed.set()
                raise ModelServerError(f"text-model server {self.base_url} refused {action}: {reason(error)}") from None
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


def one_line(error: BaseException) -> str:
    """An error's text on one line."""
    return " ".join(str(error).split())


def reason(error: Exception) -> str:
    """An API error in one line: its status code (if any) and message."""
    if isinstance(error, MalformedAnswer):
        return str(error)
    status = getattr(error, "status_code", None)
    message = one_line(error)
    return f"HTTP {status}: {message}" if status is not None else f"{type(error).__name__}: {message}"
