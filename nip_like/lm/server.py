"""Language-model agents that sample their messages from an inference server.

An agent with ``sampler.kind: server`` (``scenario.default_agent.sampler``
or ``scenario.agents.<name>.sampler``) sends each prompt, as token ids, to an
OpenAI-compatible ``/v1/completions`` endpoint (vLLM, SGLang) and gets back
the sampled tokens with their log-probabilities. Token ids come from vLLM's
``return_tokens_as_token_ids`` (tokens named ``token_id:<id>``); a server
that returns token text instead has its reply's text re-tokenized by the
agent's tokenizer, and the share of replies whose tokens then differ from the
server's is logged. The trainer's own model rescores the same tokens, so the
log-probabilities that PPO stores are the trainer's, never the server's.

Per iteration the trainer logs ``sampler/logprob_gap_mean`` and
``sampler/logprob_gap_max`` (the absolute gap between the server's and the
trainer's log-probability of each sampled token), ``sampler/retokenized``
and ``sampler/retokenized_mismatch`` (shares of replies), and
``sampler/cut_tokens`` (tokens the trainer's distribution gives probability
0, after which a message is cut: a token its bans or top-k/top-p exclude).
With ``sampler.max_importance_weight`` each token also gets the truncated
importance weight ``min(pi_trainer / pi_server, c)``, which PPO, GRPO and
REINFORCE multiply into their per-token terms (truncated importance
sampling, for the mismatch between the two engines).

The server gets the agent's weights whenever they changed before it samples
again (``sampler.sync``): ``lora`` loads the LoRA adapter through vLLM's
``/v1/load_lora_adapter`` (the server serves the agent's ``pretrained_path``
with runtime LoRA updating on), ``disk`` saves the merged model and loads it
through SGLang's ``/update_weights_from_disk``, ``restart`` saves it and
restarts a server that the run started itself from ``sampler.command``, and
``none`` never updates the server (the gap then shows the drift).

A server that does not answer stops the run with one
:class:`~nip_like.errors.ModelServerError` line after the request's retries;
the run's last checkpoint is named, and resuming completes the run.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlsplit

import torch

from nip_like import interrupts
from nip_like.allowed import checked
from nip_like.checkpoint import derive_seed
from nip_like.dependency_warnings import dependency_warnings_once
from nip_like.errors import ConfigError, ModelServerError
from nip_like.lm.agent_folders import quiet_progress
from nip_like.lm.completions import (
    BAN,
    CompletionPrompt,
    NoLogProbs,
    complete,
    completion_settings,
    completions_client,
    read_choice,
)
from nip_like.lm.lora import has_lora, merged_model
from nip_like.lm.policy import LMPolicy, sampled_messages
from nip_like.openai_client import check_base_url

#: The ways a server gets an agent's new weights.
SYNC_MODES = ("lora", "disk", "restart", "none")


@dataclass
class SamplerConfig:
    """Where a language-model agent's messages are sampled (``scenario.agents.<name>.sampler``)."""

    kind: str = checked("local", choices=("local", "server"))  # local: the trainer's model samples | server: an OpenAI-compatible completions server does, the trainer rescores
    base_url: Optional[str] = None  # the server's API root, e.g. http://127.0.0.1:8000/v1 (restart: the port the started server listens on)
    model: Optional[str] = None  # the model name of the requests; null = the agent's pretrained_path (restart: the folder the server was started on)
    api_key_env: str = "OPENAI_API_KEY"  # environment variable holding the server's key (local servers need none)
    sync: str = checked("lora", choices=SYNC_MODES)  # how the server gets new weights: lora (vLLM load_lora_adapter) | disk (SGLang update_weights_from_disk) | restart (sampler.command) | none
    command: Optional[str] = None  # restart: the command that starts the server, with {model}, {host} and {port} filled in
    start_timeout: float = checked(600.0, gt=0)  # restart: seconds the started server gets to answer GET /models
    max_importance_weight: Optional[float] = checked(None, ge=1)  # truncated importance weight min(pi_trainer / pi_server, c) on each token's loss term; null = none
    timeout: float = checked(60.0, gt=0)  # seconds a request may wait for its answer; one that gets none is not retried
    max_retries: int = checked(3, ge=0)  # retries of a request that could not reach the server or met a server error
    retry_backoff: float = checked(0.5, ge=0)  # seconds before the first retry, doubled for each next one
    max_concurrency: int = checked(16, ge=1)  # requests in flight at once (one prompt each)


@dataclass
class ServerSample:
    """One reply of the server: its tokens, their log-probabilities there, and how it was read."""

    tokens: list[int]
    log_probs: list[float]  # NaN where the server gave none (an eos the server left out of its tokens)
    finished: bool
    retokenized: bool
    mismatch: bool


def server_agents(agents: dict[str, tuple[str, Any, int]]) -> dict[str, tuple[str, SamplerConfig]]:
    """The agents of :meth:`~nip_like.scenarios.base.TensorGame.lm_agent_configs` that sample from a server: their config path and sampler."""
    found = {}
    for name, (where, agent, _) in agents.items():
        sampler = agent.get("sampler") if hasattr(agent, "get") else getattr(agent, "sampler", None)
        if sampler is not None and sampler.kind == "server":
            found[name] = (where, sampler)
    return found


def check_sampler(where: str, sampler: Any, agent: Any, world_size: int) -> None:
    """Refuse, in one line, a server sampler whose options cannot work (see :class:`SamplerConfig`).

    Parameters
    ----------
    where : str
        The agent's config path (``scenario.agents.verifier``).
    sampler : SamplerConfig
        Its sampler (``kind: server``).
    agent : LMAgentConfig
        The agent.
    world_size : int
        Ranks of the run (torchrun).

    Raises
    ------
    ConfigError
        A wrong combination of options.
    """
    path = f"{where}.sampler"
    if world_size > 1:
        raise ConfigError(f"{path}.kind=server runs with one rank (each rank would push its weights to the server); run without torchrun or set kind=local")
    if not sampler.base_url:
        raise ConfigError(f"{path}.base_url is needed with kind=server: the server's API root, e.g. http://127.0.0.1:8000/v1")
    check_base_url(str(sampler.base_url), f"{path}.base_url")
    lora = agent.lora
    if sampler.sync == "lora":
        if not lora.r:
            raise ConfigError(f"{path}.sync=lora needs LoRA adapters ({where}.lora.r > 0); allowed without them: disk, restart, none")
        if lora.warm_start != "lora":
            raise ConfigError(f"{path}.sync=lora needs {where}.lora.warm_start=lora (the server's base model must stay the agent's pretrained_path); allowed: disk, restart, none")
    if sampler.sync in ("lora", "disk") and not agent.pretrained_path and not sampler.model:
        raise ConfigError(f"{path}.sync={sampler.sync} needs {where}.pretrained_path (the model the server serves) or {path}.model")
    if sampler.sync == "restart":
        if not sampler.command:
            raise ConfigError(f"{path}.sync=restart needs {path}.command, the command that starts the server ({{model}}, {{host}}, {{port}} are filled in)")
        program = shlex.split(str(sampler.command))[0]
        if shutil.which(program) is None:
            raise ConfigError(f"{path}.command: {program!r} is not a program on PATH")


def probe_server(where: str, sampler: Any, agent: Any) -> None:
    """Ask a server sampler's server for its models and for one token with its log-probability (not ``sync: restart``: the run starts that one).

    Raises
    ------
    ModelServerError
        The server does not answer, refuses the completion, or answers
        without log-probabilities, in one line naming ``where``.
    """
    if sampler.sync == "restart":
        return
    path = f"{where}.sampler"
    client = completions_client(sampler)
    try:
        try:
            client.check_server()
        except ModelServerError as error:
            raise ModelServerError(f"{path}: {error}") from None
        # One token with its log-probability: a server that refuses the request or answers without it cannot serve.
        model = str(sampler.model or agent.pretrained_path or "")
        try:
            probe = CompletionPrompt([0], 1, seed=0)
            choice = client.map(lambda prompt, failed: complete(client, model, prompt, completion_settings(1.0, 0, 1.0), (), {}, failed), [probe])[0]
            read_choice(choice, None)
        except ModelServerError as error:
            raise ModelServerError(f"{path}: a completion of one token with its log-probability failed: {error}; {_NEEDS}") from None
        except NoLogProbs:
            raise ModelServerError(f"{path}: the server at {sampler.base_url} returned no per-token log-probabilities; {_NEEDS}") from None
    finally:
        client.close()


#: What a server must do, for the messages of the ones that do not.
_NEEDS = (
    "kind=server needs an OpenAI-compatible /v1/completions that returns them (logprobs), such as vLLM or SGLang "
    "(transformers serve does not)"
)


def check_server_sharing(servers: dict[str, tuple[str, SamplerConfig]]) -> None:
    """Refuse, in one line, two agents on one server when either replaces the server's weights (``sync: disk`` or ``restart``).

    With ``lora`` each agent loads its own adapter and several agents may
    share a server; ``disk`` and ``restart`` replace the served model, which
    would then serve the other agent's weights.

    Parameters
    ----------
    servers : dict
        By agent name: its config path and sampler (:func:`server_agents`).
    """
    by_url: dict[str, list[str]] = {}
    for name, (_, sampler) in servers.items():
        by_url.setdefault(str(sampler.base_url).rstrip("/"), []).append(name)
    for url, names in by_url.items():
        replacing = [name for name in names if servers[name][1].sync in ("disk", "restart")]
        if len(names) > 1 and replacing:
            where, sampler = servers[replacing[0]]
            raise ConfigError(
                f"{where}.sampler.sync={sampler.sync} replaces the weights of the server at {url}, from which agents "
                f"{' and '.join(names)} both sample: give each agent its own server (scenario.agents.<name>.sampler.base_url) "
                f"or use sync=lora (one adapter per agent)"
            )


class InferenceServer:
    """One agent's inference server: samples its messages, gets its new weights (see the module docstring).

    Parameters
    ----------
    name : str
        The agent.
    where : str
        Its config path, for messages.
    sampler : SamplerConfig
        The sampler (``kind: server``).
    pretrained_path : str, optional
        The agent's model folder (the server's base model).
    folder : Path
        Where the weights pushed to the server are saved (one subfolder per version).
    """

    def __init__(self, name: str, where: str, sampler: SamplerConfig, pretrained_path: Optional[str], folder: Path) -> None:
        self.name = name
        self.where = f"{where}.sampler"
        self.sampler = sampler
        self.pretrained_path = pretrained_path
        self.folder = Path(folder)
        self.base_url = str(sampler.base_url)
        self.client = completions_client(sampler)
        self.model_name = str(sampler.model or pretrained_path or "")
        #: Whether the agent's weights changed since the server last got them (True at the start: a warm start or a resume changed them).
        self.stale = sampler.sync != "none"
        self.version = 0
        self._pushed: Optional[Path] = None
        self._adapter: Optional[str] = None
        self._process: Optional[subprocess.Popen] = None
        self.stats = _Stats()

    # -------------------------------------------------------------- sampling
    @torch.no_grad()
    def sample(self, policy: LMPolicy, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, greedy: bool = False) -> dict[str, torch.Tensor]:
        """Sample one message per prompt on the server; score it with ``policy`` (the dict of :meth:`LMPolicy.sample`, plus ``"server_token_log_probs"``)."""
        if self.stale:
            self.push(policy)
        settings = policy.settings
        temperature = 0.0 if greedy else settings.temperature
        bias = {str(token): BAN for token in policy.banned.nonzero().squeeze(-1).tolist()}
        length = policy.max_new_tokens
        # The requests' seeds come from torch's generator, which a checkpoint holds: a resumed run asks for the same.
        seed = derive_seed(int(torch.randint(0, 2**31 - 1, ()).item()), f"sampler:{self.name}")
        prompts = [
            CompletionPrompt(row[mask].tolist(), length, derive_seed(seed, f"row:{index}"))
            for index, (row, mask) in enumerate(zip(prompt_ids.cpu(), prompt_mask.cpu()))
        ]
        replies = self._complete_all(policy, prompts, completion_settings(temperature, settings.top_k, settings.top_p), bias)
        return self._score(policy, prompt_ids, prompt_mask, replies)

    def _complete_all(self, policy: LMPolicy, prompts: list[CompletionPrompt], settings: dict[str, Any], bias: dict[str, int]) -> list[ServerSample]:
        model = self._request_model()
        try:
            choices = self.client.map(
                lambda prompt, failed: complete(self.client, model, prompt, settings, policy.stop_strings, bias, failed),
                prompts,
            )
        except ModelServerError as error:
            raise ModelServerError(f"{self.where}: {error}") from None
        replies = []
        for choice in choices:
            try:
                ids, log_probs, reason, retokenized, mismatch = read_choice(choice, policy.tokenizer)
            except NoLogProbs:
                raise ModelServerError(f"{self.where}: the server at {self.base_url} returned no per-token log-probabilities; {_NEEDS}") from None
            finished = reason == "stop"
            if finished and (not ids or ids[-1] != policy.eos_token_id) and not policy.ends_with_stop(ids):
                # A server that leaves the eos out of its tokens: the message ends with it all the same.
                ids, log_probs = ids + [policy.eos_token_id], log_probs + [float("nan")]
            replies.append(ServerSample(ids, log_probs, finished, retokenized, mismatch))
        return replies

    def _score(self, policy: LMPolicy, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, replies: list[ServerSample]) -> dict[str, torch.Tensor]:
        device, length = prompt_ids.device, policy.max_new_tokens
        rows = len(replies)
        tokens = torch.full((rows, length), policy.pad_token_id, dtype=torch.long)
        token_mask = torch.zeros((rows, length), dtype=torch.bool)
        server = torch.full((rows, length), float("nan"))
        finished = torch.zeros(rows, dtype=torch.bool)
        for row, reply in enumerate(replies):
            count = min(len(reply.tokens), length)
            tokens[row, :count] = torch.tensor(reply.tokens[:count], dtype=torch.long)
            token_mask[row, :count] = True
            server[row, :count] = torch.tensor(reply.log_probs[:count], dtype=torch.float32)
            finished[row] = reply.finished and len(reply.tokens) <= length
        tokens, token_mask, server, finished = (t.to(device) for t in (tokens, token_mask, server, finished))
        tokens = tokens.clamp(max=policy.banned.shape[0] - 1)
        scores = policy.evaluate(prompt_ids, prompt_mask, tokens, token_mask, with_value=False)
        trainer = scores["token_log_probs"].float()
        # A token the trainer's distribution excludes cannot be trained on: the message ends before it.
        impossible = token_mask & ~torch.isfinite(trainer)
        keep = token_mask & (impossible.long().cumsum(-1) == 0)
        cut = int((token_mask & ~keep).sum())
        finished = finished & ~impossible.any(-1)
        tokens = torch.where(keep, tokens, policy.pad_token_id)
        trainer = torch.where(keep, trainer, 0.0)
        entropy = torch.where(keep, scores["entropy"].float(), 0.0)
        server = torch.where(keep, server, float("nan"))
        self.stats.add(trainer, server, keep, replies, cut)
        return {**sampled_messages(tokens, keep, trainer, entropy, finished), "server_token_log_probs": server}

    def importance_weights(self, sample: dict[str, torch.Tensor]) -> torch.Tensor:
        """``(B, T)`` truncated importance weights ``min(exp(trainer - server), c)`` of a :meth:`sample` (1 where the server gave no log-prob)."""
        cap = self.sampler.max_importance_weight
        gap = sample["token_log_probs"] - sample["server_token_log_probs"]
        known = sample["token_mask"] & torch.isfinite(gap)
        weight = torch.where(known, gap, torch.zeros_like(gap)).exp()
        if cap is not None:
            self.stats.truncated += int((known & (weight > cap)).sum())
            weight = weight.clamp(max=float(cap))
        return weight

    # -------------------------------------------------------------- weights
    def push(self, policy: LMPolicy) -> None:
        """Give the server the agent's current weights (``sampler.sync``); the old pushed files are removed."""
        started = time.perf_counter()
        mode = self.sampler.sync
        self.version += 1
        target = self.folder / self.name / f"v{self.version}"
        if mode == "lora":
            _save(policy.model, target, policy.tokenizer, adapter_only=True)
            name = f"{self.name}-v{self.version}"
            self._post("load_lora_adapter", {"lora_name": name, "lora_path": str(target)})
            if self._adapter is not None:
                self._post("unload_lora_adapter", {"lora_name": self._adapter}, required=False)
            self._adapter = name
        elif mode == "disk":
            _save(policy.model, target, policy.tokenizer)
            self._post("update_weights_from_disk", {"model_path": str(target)}, root=True)
        elif mode == "restart":
            _save(policy.model, target, policy.tokenizer)
            self.stop()
            self._start(target)
        if self._pushed is not None:
            shutil.rmtree(self._pushed, ignore_errors=True)
        self._pushed = target
        self.stale = False
        self.stats.sync_seconds += time.perf_counter() - started

    def _request_model(self) -> str:
        if self._adapter is not None:
            return self._adapter
        if self.sampler.sync == "restart" and not self.sampler.model and self._pushed is not None:
            return str(self._pushed)
        return self.model_name

    def _post(self, endpoint: str, body: dict[str, Any], root: bool = False, required: bool = True) -> None:
        import httpx

        base = self.base_url.rstrip("/")
        if root:
            parts = urlsplit(base)
            base = f"{parts.scheme}://{parts.netloc}"
        url = f"{base}/{endpoint}"
        try:  # in the client's daemon threads: a stop request need not wait for a silent server
            response = self.client.map(
                lambda _, __: httpx.post(url, json=body, timeout=float(self.sampler.timeout)), [None], f"an answer to POST {url}"
            )[0]
        except httpx.HTTPError as error:
            if required:
                raise ModelServerError(f"{self.where}: POST {url} failed: {type(error).__name__}: {error}") from None
            return
        if required and response.status_code >= 400:
            raise ModelServerError(
                f"{self.where}.sync={self.sampler.sync}: POST {url} answered HTTP {response.status_code}: "
                f"{' '.join(response.text.split())[:300]}"
            )

    def _start(self, model: Path) -> None:
        parts = urlsplit(self.base_url)
        command = str(self.sampler.command).format(model=model, host=parts.hostname, port=parts.port or 80)
        log = self.folder / f"{self.name}-server.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a") as output:
            self._process = subprocess.Popen(
                shlex.split(command), stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + float(self.sampler.start_timeout)
        while True:
            if self._process.poll() is not None:
                raise ModelServerError(f"{self.where}.command exited with status {self._process.returncode} before it answered; its output is in {log}")
            try:
                self.client.client.models.list()
                return
            except Exception:  # noqa: BLE001 - not up yet
                interrupts.raise_if_stop_requested(f"{self.where}.command to start")
                if time.monotonic() > deadline:
                    self.stop()
                    raise ModelServerError(f"{self.where}.command did not answer GET /models within {self.sampler.start_timeout:g} s; its output is in {log}") from None
                time.sleep(0.2)

    def stop(self) -> None:
        """Stop the server the run started (``sync: restart``); nothing otherwise."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        except ProcessLookupError:
            pass

    def close(self) -> None:
        """Stop a started server and close the client."""
        self.stop()
        self.client.close()


def _save(model, folder: Path, tokenizer, adapter_only: bool = False) -> None:
    """Write the weights the server loads: the LoRA adapter alone, or the whole model (adapters merged) with its tokenizer."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    with quiet_progress(), dependency_warnings_once():
        if adapter_only:
            model.save_pretrained(folder)
            return
        standalone = merged_model(model) if has_lora(model) else model
        standalone.save_pretrained(folder)
        tokenizer.save_pretrained(folder)


class _Stats:
    """What the samples of one iteration looked like (see the module docstring's metrics)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.gap_sum = 0.0
        self.gap_max = 0.0
        self.gap_count = 0
        self.replies = 0
        self.retokenized = 0
        self.mismatch = 0
        self.cut = 0
        self.truncated = 0
        self.tokens = 0
        self.sync_seconds = 0.0

    def add(self, trainer: torch.Tensor, server: torch.Tensor, mask: torch.Tensor, replies: list[ServerSample], cut: int) -> None:
        gap = (server - trainer).abs()
        known = mask & torch.isfinite(gap)
        if bool(known.any()):
            self.gap_sum += float(gap[known].sum())
            self.gap_max = max(self.gap_max, float(gap[known].max()))
            self.gap_count += int(known.sum())
        self.tokens += int(mask.sum())
        self.replies += len(replies)
        self.retokenized += sum(reply.retokenized for reply in replies)
        self.mismatch += sum(reply.mismatch for reply in replies)
        self.cut += cut

    def pop(self, prefix: str) -> dict[str, float]:
        if not self.replies and not self.sync_seconds:
            return {}
        metrics = {f"timers/sampler_sync/{prefix}": self.sync_seconds}
        if self.replies:
            metrics.update(
                {
                    f"sampler/logprob_gap_mean/{prefix}": self.gap_sum / max(self.gap_count, 1),
                    f"sampler/logprob_gap_max/{prefix}": self.gap_max,
                    f"sampler/retokenized/{prefix}": self.retokenized / self.replies,
                    f"sampler/retokenized_mismatch/{prefix}": self.mismatch / self.replies,
                    f"sampler/cut_tokens/{prefix}": float(self.cut),
                    f"sampler/truncated_weights/{prefix}": self.truncated / max(self.tokens, 1),
                }
            )
        self.reset()
        return metrics
