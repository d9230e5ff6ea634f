"""Text models behind one interface: chat messages in, text out, seeded sampling.

A :class:`TextModel` answers a batch of chats (each a list of
``{"role", "content"}`` messages) with one reply each.
:class:`LocalTextModel` is a transformers causal LM in this process, loaded
from a local ``save_pretrained`` folder with its own tokenizer and chat
template (the tiny models the text trainers build, or any chat model the user
has on disk); :class:`~nip_like.text.remote.OpenAIChatModel` is any server
that speaks the OpenAI chat-completions protocol (vLLM, TGI,
``transformers serve``, a hosted API); a scenario's scripted players are text
models too (``backend: scripted``). :func:`build_text_model` makes the model of
a :class:`TextModelConfig`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from nip_like.allowed import checked
from nip_like.errors import ConfigError
from nip_like.lm.checkpoints import local_model_folder, quiet_progress
from nip_like.lm.models import LMAgentConfig, build_lm, disable_dropout

#: A chat: messages with a ``role`` (system, user, assistant) and a ``content``.
Chat = list[dict[str, str]]

#: Where a text model runs: in this process, behind a chat-completions server, or a scripted player of
#: the scenario (fixed, never fine-tuned).
BACKENDS = ("local", "openai", "scripted")


@dataclass
class TextModelConfig:
    """A text model: where it runs, what it starts from, how it samples."""

    backend: str = checked("local", choices=BACKENDS)  # local (transformers in this process) | openai (a chat-completions server) | scripted (the scenario's honest player, never trained)
    path: Optional[str] = None  # local folder (save_pretrained, with a chat template) to start from; null builds a tiny model from config
    architecture: str = "llama"  # transformers model type of a from-config model
    hidden_size: int = checked(64, ge=1)  # width of a from-config model
    num_layers: int = checked(2, ge=1)  # transformer blocks of a from-config model
    num_heads: int = checked(4, ge=1)  # attention heads of a from-config model
    intermediate_size: int = checked(128, ge=1)  # MLP width of a from-config model
    max_new_tokens: int = checked(16, ge=1)  # longest reply, in tokens
    temperature: float = checked(1.0, ge=0)  # sampling temperature; 0 = greedy
    top_p: float = checked(1.0, gt=0, le=1)  # nucleus sampling; 1 = off
    batch_size: int = checked(256, ge=1)  # chats per generate call (local backend)
    base_url: Optional[str] = None  # openai: the server's API root (http://host:port/v1); null reads OPENAI_BASE_URL
    model: Optional[str] = None  # openai: the served model's name; null sends the current model's folder (transformers serve loads it)
    api_key_env: str = "OPENAI_API_KEY"  # openai: environment variable holding the key (a local server needs none)
    max_concurrency: int = checked(8, ge=1)  # openai: requests in flight at once
    max_retries: int = checked(3, ge=0)  # openai: retries of a request (and of the preflight's GET /models) that failed to connect, timed out, met a 429/5xx or got malformed JSON; then one error line
    retry_backoff: float = checked(0.5, gt=0)  # openai: seconds before the first retry, doubled each time
    timeout: float = checked(60.0, gt=0)  # openai: seconds a request may wait for the server before it counts as failed


@dataclass(frozen=True)
class Sampling:
    """How replies are sampled: temperature (0 = greedy), nucleus, length."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0

    @classmethod
    def from_config(cls, config: TextModelConfig, greedy: bool = False) -> "Sampling":
        """The config's settings; ``greedy`` sets the temperature to 0."""
        temperature = 0.0 if greedy else float(config.temperature)
        return cls(int(config.max_new_tokens), temperature, float(config.top_p))


class TextModel(ABC):
    """Answers chats with text."""

    @abstractmethod
    def reply(self, chats: Sequence[Chat], sampling: Sampling, seed: int) -> list[str]:
        """One reply per chat, sampled with ``sampling``; the same seed gives the same replies.

        Parameters
        ----------
        chats : sequence of Chat
            The conversations, each ending where the model must answer.
        sampling : Sampling
            Temperature, nucleus and reply length.
        seed : int
            Seed of the sampling.
        """

    def close(self) -> None:
        """Release what the model holds (connections, memory)."""


def chat_prompts(tokenizer, chats: Sequence[Chat]) -> list[str]:
    """Each chat rendered with the tokenizer's chat template, asking for the assistant's reply."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("the model's tokenizer has no chat_template: text models need one to read chats")
    return [tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) for chat in chats]


class LocalTextModel(TextModel):
    """A transformers causal LM in this process (see the module docstring).

    Parameters
    ----------
    folder : str or Path
        A local ``save_pretrained`` folder with the model and a tokenizer that
        has a chat template. Nothing is downloaded.
    device : torch.device or str
        Where the model runs.
    batch_size : int
        Chats per ``generate`` call.
    """

    def __init__(self, folder: str | Path, device: torch.device | str = "cpu", batch_size: int = 256) -> None:
        self.folder = local_model_folder(folder)
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(self.folder, local_files_only=True)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        with quiet_progress():
            self.model = AutoModelForCausalLM.from_pretrained(self.folder, local_files_only=True, dtype=torch.float32)
        disable_dropout(self.model)
        self.model.to(self.device).eval()
        self.batch_size = int(batch_size)
        # Tokens a reply may never hold: padding, a new sequence, an unknown character.
        banned = {self.tokenizer.pad_token_id, self.tokenizer.bos_token_id, self.tokenizer.unk_token_id}
        self.banned = sorted(token for token in banned if token is not None and token != self.tokenizer.eos_token_id)

    @torch.no_grad()
    def reply(self, chats: Sequence[Chat], sampling: Sampling, seed: int) -> list[str]:
        prompts = chat_prompts(self.tokenizer, chats)
        replies: list[str] = []
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            for start in range(0, len(prompts), self.batch_size):
                replies += self._generate(prompts[start : start + self.batch_size], sampling)
        return replies

    def _generate(self, prompts: list[str], sampling: Sampling) -> list[str]:
        encoded = self.tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(self.device)
        options = dict(max_new_tokens=sampling.max_new_tokens, min_new_tokens=0)
        if sampling.temperature > 0:
            options.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)
        else:
            options.update(do_sample=False)
        output = self.model.generate(
            **encoded,
            **options,
            pad_token_id=self.tokenizer.pad_token_id,
            eos_token_id=self.tokenizer.eos_token_id,
            suppress_tokens=self.banned or None,
        )
        new_tokens = output[:, encoded["input_ids"].shape[1] :]
        return [self.tokenizer.decode(row, skip_special_tokens=True) for row in cut_at_eos(new_tokens, self.tokenizer.eos_token_id)]

    def close(self) -> None:
        self.model = None


def cut_at_eos(tokens: torch.Tensor, eos_token_id: int) -> list[list[int]]:
    """Each row's tokens before its first ``eos_token_id`` (all of them if none)."""
    rows = []
    for row in tokens.tolist():
        rows.append(row[: row.index(eos_token_id)] if eos_token_id in row else row)
    return rows


def create_model_folder(config: TextModelConfig, folder: Path, tokenizer) -> Path:
    """Build a from-config model with ``tokenizer`` (random weights) and save both to ``folder``.

    The folder then reads like any chat model on disk:
    ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained``.
    """
    sizes = LMAgentConfig(
        architecture=config.architecture,
        hidden_size=config.hidden_size,
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        intermediate_size=config.intermediate_size,
    )
    model, tokenizer = build_lm(sizes, tokenizer)
    folder.mkdir(parents=True, exist_ok=True)
    with quiet_progress():  # an error later in the run stays one line on stderr
        model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def build_text_model(config: TextModelConfig, folder: str | Path, device: torch.device | str = "cpu") -> TextModel:
    """The text model of ``config`` whose current weights are in ``folder``.

    For the ``openai`` backend, ``folder`` is the model name sent to the
    server unless ``config.model`` names one.
    """
    if config.backend == "local":
        return LocalTextModel(folder, device, batch_size=int(config.batch_size))
    if config.backend == "openai":
        from nip_like.text.remote import OpenAIChatModel

        return OpenAIChatModel.from_config(config, default_model=str(folder))
    if config.backend == "scripted":
        raise ConfigError("a scripted player is made by its scenario (scenario.scripted_model), not from a folder")
    raise ConfigError(f"unknown text model backend {config.backend!r}; allowed: {', '.join(BACKENDS)}")
