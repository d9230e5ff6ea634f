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
from typing import Callable, Sequence, TypeVar
from urllib.parse import urlsplit

from nip_like import interrupts
from nip_like.errors import ConfigError, ModelServerError

T = TypeVar("T")
X = TypeVar("X")


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
    label : str
        What the server is called in messages (``text-model server``,
        ``inference server``).
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
        label: str = "text-model server",
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
        self.label = label
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

        self.map(lambda _, failed: self.with_retries(ask, "GET /models", failed), [None])

    def map(self, request: Callable[[X, threading.Event], T], items: Sequence[X], what: str | None = None) -> list[T]:
        """``request(item, failed)`` for every item, ``max_concurrency`` at once in daemon threads; the results in order.

        The first request that fails for good sets ``failed`` (requests in
        flight stop retrying, those queued are dropped) and its error is
        raised at once, without waiting for the requests still in flight. A
        stop request raises :class:`~nip_like.interrupts.StopNow` the same way,
        naming ``what`` was waited for (by default an answer from this server).
        """
        if not items:
            return []
        failed, finished = threading.Event(), threading.Event()
        results: list = [None] * len(items)
        errors: list[BaseException] = []
        queue = list(enumerate(items))[::-1]
        lock = threading.Lock()
        running = workers = min(self.max_concurrency, len(items))

        def work() -> None:
            nonlocal running
            try:
                while not failed.is_set():
                    with lock:
                        if not queue:
                            return
                        index, item = queue.pop()
                    results[index] = request(item, failed)
            except BaseException as error:  # noqa: BLE001 - handed to the waiting thread
                if not isinstance(error, Abandoned):
                    errors.append(error)
                failed.set()
            finally:
                with lock:
                    running -= 1
                    if running == 0 or errors:
                        finished.set()

        for number in range(workers):
            threading.Thread(target=work, name=f"nip_like-request-{number}", daemon=True).start()
        what = what or f"an answer from the {self.label} at {self.base_url}"
        try:
            while not finished.wait(interrupts.POLL_SECONDS):
                interrupts.raise_if_stop_requested(what)
        except BaseException:  # a stop request, or a second signal's KeyboardInterrupt
            failed.set()
            raise
        if errors:
            raise errors[0]
        return results

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

        Notes
        -----
        Run it in :meth:`map`'s threads: called in the main thread, a silent
        server holds that thread for ``timeout`` seconds, signals or not.
        """
        openai = self._openai
        failed = threading.Event() if failed is None else failed
        retryable = (openai.APIConnectionError, openai.RateLimitError, openai.InternalServerError, MalformedAnswer)
        for attempt in range(self.max_retries + 1):
            if failed.is_set():
                raise Abandoned()
            try:
                return call()
            except openai.APITimeoutError:  # an APIConnectionError too, but not worth retrying: see the module docstring
                failed.set()
                raise ModelServerError(
                    f"{self.label} {self.base_url} ({action}) gave no answer within its timeout of {self.timeout:g} s "
                    f"(hung or overloaded; a slow server needs a longer timeout)"
                ) from None
            except retryable as error:
                if attempt == self.max_retries:
                    failed.set()
                    raise ModelServerError(
                        f"{self.label} {self.base_url} ({action}) failed after {attempt + 1} "
                        f"{'try' if attempt == 0 else 'tries'} (timeout "
                        f"{self.timeout:g} s): {reason(error)}"
                    ) from None
                if failed.wait(self.retry_backoff * 2**attempt):  # another request failed for good meanwhile
                    raise Abandoned() from None
            except openai.APIStatusError as error:
                failed.set()
                raise ModelServerError(f"{self.label} {self.base_url} refused {action}: {reason(error)}") from None
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
