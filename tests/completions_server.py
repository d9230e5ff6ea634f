"""An OpenAI-compatible completions server with vLLM's extensions, on transformers, for the tests on this machine.

``transformers serve`` answers ``logprobs`` with an error, and vLLM and SGLang
need a GPU; the server-sampling tests start this one on 127.0.0.1 instead. It
speaks the part of vLLM's protocol that :mod:`nip_like.lm.server` uses:

* ``GET /v1/models``;
* ``POST /v1/completions`` with a token-id prompt, ``max_tokens``,
  ``temperature`` (0: greedy), ``top_k`` (-1 or 0: off), ``top_p``,
  ``seed``, ``stop``, ``logit_bias``, ``logprobs`` and
  ``return_tokens_as_token_ids``: the sampled tokens with the log-probability
  of each under the distribution it was drawn from (vLLM's
  ``--logprobs-mode processed_logprobs``), the eos included, and
  ``finish_reason`` ``stop`` or ``length``;
* ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (vLLM's
  runtime LoRA updating): a request for model ``lora_name`` samples with that
  adapter over the served model;
* ``POST /update_weights_from_disk`` (SGLang's): the served weights are
  reloaded from ``model_path``.

``--text-tokens`` names tokens by their text (as servers without
``return_tokens_as_token_ids`` do). Run: ``python tests/completions_server.py
--model FOLDER --port PORT``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the tests package

from tests.fake_servers import free_port  # noqa: E402

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


class Engine:
    """The served model, its adapters and the sampling loop."""

    def __init__(self, folder: str, name: str, text_tokens: bool) -> None:
        self.name = name
        self.text_tokens = text_tokens
        self.lock = threading.Lock()
        self.adapters: dict[str, str] = {}
        self.load(folder)

    def load(self, folder: str) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        self.peft = None
        adapters, self.adapters = self.adapters, {}
        for name, path in adapters.items():
            self.add_adapter(name, path)

    def add_adapter(self, name: str, path: str) -> None:
        from peft import PeftModel

        if self.peft is None:
            self.peft = PeftModel.from_pretrained(self.model, path, adapter_name=name).eval()
        else:
            self.peft.load_adapter(path, adapter_name=name)
        self.adapters[name] = path

    def remove_adapter(self, name: str) -> None:
        if name in self.adapters and self.peft is not None:
            if len(self.adapters) > 1:
                self.peft.delete_adapter(name)
            del self.adapters[name]

    @torch.no_grad()
    def complete(self, body: dict) -> dict:
        prompt = body["prompt"]
        prompt = prompt[0] if prompt and isinstance(prompt[0], list) else prompt
        model = body.get("model")
        if model in self.adapters:
            self.peft.set_adapter(model)
            network = self.peft
        elif model == self.name:
            network = self.model if self.peft is None else None
        else:
            raise LookupError(f"The model `{model}` does not exist.")
        generator = torch.Generator().manual_seed(int(body.get("seed") or 0))
        temperature = float(body.get("temperature", 1.0))
        top_k, top_p = int(body.get("top_k") or -1), float(body.get("top_p", 1.0))
        bias = torch.zeros(self.model.config.get_text_config().vocab_size)
        for token, value in (body.get("logit_bias") or {}).items():
            bias[int(token)] = float(value)
        stops = [stop for stop in (body.get("stop") or []) if stop]
        ids = torch.tensor([prompt])
        if network is None:  # the base model while adapters are loaded
            with self.peft.disable_adapter():
                return self._loop(self.peft, ids, body, generator, temperature, top_k, top_p, bias, stops)
        return self._loop(network, ids, body, generator, temperature, top_k, top_p, bias, stops)

    def _loop(self, network, ids, body, generator, temperature, top_k, top_p, bias, stops) -> dict:
        tokens, log_probs, reason = [], [], "length"
        past = None
        step_input = ids
        for _ in range(int(body.get("max_tokens", 16))):
            output = network(input_ids=step_input, past_key_values=past, use_cache=True)
            past = output.past_key_values
            scores = output.logits[0, -1].float()
            scores = scores + bias[: scores.shape[0]].masked_fill(bias[: scores.shape[0]] <= -100, float("-inf"))
            scores = torch.log_softmax(scores, -1)
            if temperature > 0 and temperature != 1.0:
                scores = scores / temperature
            if top_k > 0 and top_k < scores.shape[0]:
                scores = scores.masked_fill(scores < torch.topk(scores, top_k).values[-1], float("-inf"))
            if top_p < 1.0:
                ordered, order = torch.sort(scores, descending=True)
                probs = ordered.softmax(-1)
                drop = (probs.cumsum(-1) - probs) >= top_p
                scores = scores.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
            distribution = torch.log_softmax(scores, -1)
            if temperature == 0:
                token = int(distribution.argmax())
            else:
                token = int(torch.multinomial(distribution.exp(), 1, generator=generator))
            tokens.append(token)
            log_probs.append(float(distribution[token]))
            if token == self.tokenizer.eos_token_id:
                reason = "stop"
                break
            if stops and any(stop in self.tokenizer.decode(tokens) for stop in stops):
                reason = "stop"
                break
            step_input = torch.tensor([[token]])
        text = self.tokenizer.decode(tokens)
        if self.text_tokens or not body.get("return_tokens_as_token_ids"):
            names = [self.tokenizer.decode([token]) for token in tokens]
        else:
            names = [f"token_id:{token}" for token in tokens]
        logprobs = {"tokens": names, "token_logprobs": log_probs, "top_logprobs": None, "text_offset": None} if body.get("logprobs") is not None else None
        return {
            "id": "cmpl-test",
            "object": "text_completion",
            "created": 0,
            "model": body.get("model"),
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}],
        }


def handler(engine: Engine):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def _answer(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path.rstrip("/") == "/v1/models":
                models = [engine.name, *engine.adapters]
                self._answer(200, {"object": "list", "data": [{"id": name, "object": "model"} for name in models]})
            else:
                self._answer(404, {"error": {"message": "not found"}})

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            try:
                with engine.lock:
                    if self.path == "/v1/completions":
                        self._answer(200, engine.complete(body))
                    elif self.path == "/v1/load_lora_adapter":
                        engine.add_adapter(body["lora_name"], body["lora_path"])
                        self._answer(200, {"status": "ok"})
                    elif self.path == "/v1/unload_lora_adapter":
                        engine.remove_adapter(body["lora_name"])
                        self._answer(200, {"status": "ok"})
                    elif self.path == "/update_weights_from_disk":
                        engine.load(body["model_path"])
                        self._answer(200, {"success": True})
                    else:
                        self._answer(404, {"error": {"message": f"no route {self.path}"}})
            except LookupError as error:
                self._answer(404, {"error": {"message": str(error), "type": "NotFoundError"}})

    return Handler


SCRIPT = Path(__file__).resolve()


def command(model: str = "{model}", port: str = "{port}", *flags: str) -> str:
    """The command line that starts this server (with ``{model}`` and ``{port}`` left for ``sampler.command`` by default)."""
    return " ".join([sys.executable, str(SCRIPT), "--model", str(model), "--port", str(port), *flags])


@contextmanager
def running(arguments: list[str], health: str, log: Path, timeout: float = 120, environment: dict | None = None) -> Iterator[subprocess.Popen]:
    """Start a server process (``arguments``) and wait until ``health`` answers; stop it when the block ends."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as output:
        process = subprocess.Popen(arguments, stdout=output, stderr=subprocess.STDOUT, env=environment or {**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(health, timeout=1) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server {arguments[:3]} did not start: {log.read_text()[-2000:]}")
            time.sleep(0.2)
        yield process
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextmanager
def completions_server(model: Path, log: Path, *flags: str, port: int | None = None) -> Iterator[str]:
    """This server on ``model``, on a free port (or ``port``); its API root."""
    port = port or free_port()
    with running(command(str(model), str(port), *flags).split(), f"http://127.0.0.1:{port}/v1/models", log):
        yield f"http://127.0.0.1:{port}/v1"


def transformers_command() -> list[str]:
    """The ``transformers`` command line tool of this environment."""
    script = Path(sys.executable).with_name("transformers")
    return [str(script)] if script.is_file() else [shutil.which("transformers") or "transformers"]


@contextmanager
def transformers_serve(log: Path) -> Iterator[str]:
    """``transformers serve`` on a free local port, offline; its API root."""
    port = free_port()
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(log.parent / "hf")}
    arguments = [*transformers_command(), "serve", "--host", "127.0.0.1", "--port", str(port)]
    with running(arguments, f"http://127.0.0.1:{port}/health", log, environment=environment):
        yield f"http://127.0.0.1:{port}/v1"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--text-tokens", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    engine = Engine(args.model, args.served_model_name or args.model, args.text_tokens)
    server = ThreadingHTTPServer((args.host, args.port), handler(engine))
    server.serve_forever()


if __name__ == "__main__":
    main()
