"""The text-model interface: chats in, text out, seeded sampling.

A :class:`TextModel` answers a batch of chats (each a list of
``{"role", "content"}`` messages) with one reply each, sampled as a
:class:`Sampling` says. :class:`TextModelConfig` says where a model runs
(``backend``): in this process (:class:`~nip_like.text.models.LocalTextModel`),
behind an OpenAI-compatible server (:class:`~nip_like.text.remote.OpenAIChatModel`),
or as a scenario's scripted player. :func:`~nip_like.text.models.build_text_model`
makes the model of a config.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional, Sequence

from nip_like.allowed import checked
from nip_like.lm.sampling import MIN_TEMPERATURE

#: A chat: messages with a ``role`` (system, user, assistant) and a ``content``.
Chat = list[dict[str, str]]

#: Where a text model runs: in this process, behind a chat-completions server, or a scripted player of
#: the scenario (fixed, never fine-tuned).
BACKENDS = ("local", "openai", "scripted")


@dataclass
class TextModelConfig:
    """A text model: where it runs, what it starts from, how it samples."""

    backend: str = checked("local", choices=BACKENDS)  # local (transformers in this process) | openai (a chat-completions server) | scripted (the scenario's honest player, never trained)
    path: Optional[str] = None  # local folder (save_pretrained, with a chat template) or .gguf file to start from; null builds a tiny model from config
    chat_template: Optional[str] = None  # local: the chat template to read chats with (chatml, llama3, gemma, plain or a Jinja file); null = the folder's own
    architecture: str = "llama"  # transformers model type of a from-config model
    hidden_size: int = checked(64, ge=1)  # width of a from-config model
    num_layers: int = checked(2, ge=1)  # transformer blocks of a from-config model
    num_heads: int = checked(4, ge=1)  # attention heads of a from-config model
    intermediate_size: int = checked(128, ge=1)  # MLP width of a from-config model
    max_new_tokens: int = checked(16, ge=1)  # longest reply, in tokens
    temperature: float = checked(1.0, ge=MIN_TEMPERATURE, also=(0,))  # sampling temperature; 0 = greedy; else >= 0.01, below which the logits overflow
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
