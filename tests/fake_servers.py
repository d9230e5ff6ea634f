"""Fake OpenAI-compatible servers on 127.0.0.1 for the tests: ones that fail in each way, and one that answers.

:func:`fake_server` starts an :class:`http.server.ThreadingHTTPServer` in a
thread and yields it: its API root ``url`` (``http://127.0.0.1:<port>/v1``),
its record of ``requests``, and its ``behaviour`` (:data:`BEHAVIOURS`), which
says how ``GET /v1/models`` and ``POST /v1/chat/completions`` are answered and
which a test may change while it runs (a server that fails mid-run). A
server given ``dies_after=n`` dies at its ``n + 1``-th chat request, as a
crashed server process does: that request and every later one get no answer,
and its port refuses connections from then on (a new server may be started on
the same ``port``). ``reply`` may be a function of the request's JSON body (its
``seed``, say). The server stops when the block ends.
"""

from __future__ import annotations

import json
import socket
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Iterator, Union

#: Each behaviour: how it answers the model list and a chat request.
BEHAVIOURS = (
    "ok",  # both answer: the list of one model, and the chat with ``reply``
    "error_500",  # both answer HTTP 500
    "malformed",  # both answer HTTP 200 with a body that is not JSON
    "no_choices",  # the list answers; a chat gets JSON without choices
    "hang",  # both accept the request and never answer
    "unauthorized",  # both answer HTTP 401
    "no_model_list",  # the list answers 404 (a server without /models); a chat answers
    "chat_500",  # the list answers; a chat gets HTTP 500 (a server that fails mid-run)
    # The start-up checks answer (the list, an LM sampler's one-token probe of /completions); every other chat or
    # completion is accepted and never answered (a server that hangs once the run is under way).
    "chat_hang",
)

#: The answer to a one-token /completions probe: token 0 with its log-probability, as vLLM names tokens.
PROBE_CHOICE = {"index": 0, "text": "", "finish_reason": "length", "logprobs": {"tokens": ["token_id:0"], "token_logprobs": [-0.5]}}


def free_port() -> int:
    """A local TCP port that nothing listens on (a server there refuses connections)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def refusing_url() -> str:
    """The API root of a server that refuses connections (nothing listens on its port)."""
    return f"http://127.0.0.1:{free_port()}/v1"


class _Handler(BaseHTTPRequestHandler):
    server: "FakeServer"

    def log_message(self, *args) -> None:  # quiet
        pass

    def _answer(self, status: int, body: bytes | dict) -> None:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _handle(self, kind: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        self.server.requests.append((kind, json.loads(body) if body else None))
        if self.server.dead or (self.server.dies_after is not None and self.server.kinds().count("chat") > self.server.dies_after):
            self.server.die()
            self.close_connection = True  # no answer: the client sees the connection dropped
            return
        behaviour = self.server.behaviour
        if behaviour == "chat_hang" and kind == "completion" and (json.loads(body) or {}).get("max_tokens") == 1:
            self._answer(200, {"id": "x", "object": "text_completion", "model": "fake", "choices": [PROBE_CHOICE]})
            return
        if behaviour == "hang" or (behaviour == "chat_hang" and kind in ("chat", "completion")):
            self.server.stopped.wait(60)
            return
        if behaviour == "error_500" or (behaviour == "chat_500" and kind == "chat"):
            self._answer(500, {"error": {"message": "the model crashed", "type": "server_error"}})
        elif behaviour == "malformed":
            self._answer(200, b"{not json")
        elif behaviour == "unauthorized":
            self._answer(401, {"error": {"message": "invalid api key", "type": "invalid_request_error"}})
        elif kind == "models":
            if behaviour == "no_model_list":
                self._answer(404, {"detail": "Not Found"})
            else:
                self._answer(200, {"object": "list", "data": [{"id": "fake", "object": "model"}]})
        elif kind == "chat" and behaviour == "no_choices":
            self._answer(200, {"id": "x", "object": "chat.completion"})
        elif kind == "chat":
            reply = self.server.reply
            message = {"role": "assistant", "content": reply(json.loads(body)) if callable(reply) else reply}
            choice = {"index": 0, "message": message, "finish_reason": "stop"}
            self._answer(200, {"id": "x", "object": "chat.completion", "created": 0, "model": "fake", "choices": [choice]})
        else:
            self._answer(404, {"detail": "Not Found"})

    def do_GET(self) -> None:
        self._handle("models" if self.path.rstrip("/").endswith("/models") else "other")

    def do_POST(self) -> None:
        path = self.path.rstrip("/")
        self._handle("chat" if path.endswith("/chat/completions") else "completion" if path.endswith("/completions") else "other")


class FakeServer(ThreadingHTTPServer):
    """A fake chat-completions server (see the module docstring)."""

    daemon_threads = True
    behaviour: str  # how it answers (BEHAVIOURS)
    reply: Union[str, Callable[[dict], str]]  # the content of every chat answer, or a function of the request body
    requests: list  # (kind, json_body) of each request so far; kind: models, chat or other
    stopped: threading.Event
    dies_after: int | None = None  # the number of chat requests it answers before it dies
    dead: bool = False

    def die(self) -> None:
        """Stop listening (its port refuses connections) and answer nothing more, as a crashed server."""
        if not self.dead:
            self.dead = True
            threading.Thread(target=lambda: (self.shutdown(), self.socket.close()), daemon=True).start()

    @property
    def url(self) -> str:
        """The API root, ``http://127.0.0.1:<port>/v1``."""
        return f"http://127.0.0.1:{self.server_port}/v1"

    def kinds(self) -> list[str]:
        """The kind of each request so far."""
        return [kind for kind, _ in self.requests]


@contextmanager
def fake_server(
    behaviour: str, reply: Union[str, Callable[[dict], str]] = "accept", dies_after: int | None = None, port: int = 0
) -> Iterator[FakeServer]:
    """Serve ``behaviour`` (one of :data:`BEHAVIOURS`) on 127.0.0.1 while the block runs.

    Parameters
    ----------
    behaviour : str
        How the server answers.
    reply : str or callable
        The content of every chat answer (behaviours that answer chats), or
        a function of the request's JSON body that returns it.
    dies_after : int, optional
        Die at the chat request after this many (see the module docstring).
    port : int
        The port to listen on; 0 picks a free one.

    Yields
    ------
    FakeServer
        The running server.
    """
    if behaviour not in BEHAVIOURS:
        raise ValueError(f"unknown behaviour {behaviour!r}; one of {BEHAVIOURS}")
    server = FakeServer(("127.0.0.1", port), _Handler)
    server.behaviour, server.reply, server.requests, server.stopped = behaviour, reply, [], threading.Event()
    server.dies_after = dies_after
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.stopped.set()
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
