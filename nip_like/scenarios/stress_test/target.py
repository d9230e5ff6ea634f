"""The target of a stress test, and the chats and texts it reads.

The target is frozen and belongs to the scenario's system, not to the
protocol's agents: it answers each auditor utterance, and its model gives
the likelihood term of the reward. It plays either

* from a local chat-model folder (``scenario.target.pretrained_path``, or
  ``frozen_from``: a run folder or an agent folder, read as a frozen
  co-player's, :func:`~nip_like.lm.frozen.resolve`; by default the auditor's
  own starting model), in this process
  (:class:`~nip_like.text.models.LocalTextModel`), or
* on an OpenAI-compatible chat server (``scenario.target.served``, a
  :class:`~nip_like.lm.served_config.ServedConfig`); a local folder given beside it
  then only scores the likelihood term, or
* with the auditor's own model, its LoRA adapters switched off
  (``scenario.target.auditor_base``, :class:`AuditorBase`): the base the
  auditor's adapters sit on, held once in memory.

What the target reads (:func:`target_chat`): its system message (if any),
then one user message per auditor utterance and one assistant message per
earlier response of its own; the first user message is the prompt and the
first utterance on the next line. The likelihood term reads the same
conversation as plain text (:func:`conversation_text`).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

import torch

from nip_like.allowed import checked
from nip_like.errors import ConfigError, ModelServerError
from nip_like.lm.served_config import ServedConfig, is_served
from nip_like.text.served import served_player
from nip_like.lm.lora import adapters_disabled, has_lora
from nip_like.lm.sampling import MIN_TEMPERATURE
from nip_like.scenarios.stress_test.reward import utterance_likelihood
from nip_like.text.interface import Chat, Sampling
from nip_like.text.models import LocalTextModel


@dataclass
class TargetConfig:
    """The frozen target (``scenario.target``; see :mod:`nip_like.scenarios.stress_test.target`)."""

    pretrained_path: Optional[str] = None  # local chat-model folder the target plays from; null (and no frozen_from): the auditor's starting model. With served: scores the likelihood term only
    frozen_from: Optional[str] = None  # instead of pretrained_path: a finished run's folder (its agent frozen_agent) or an agent/model folder, read as a frozen co-player's
    frozen_agent: str = "auditor"  # frozen_from a run folder: the agent whose saved model the target plays
    frozen_checkpoint: str = checked("last", choices=("last", "best"))  # frozen_from a run folder: its last or best checkpoint
    system_prompt: Optional[str] = None  # the target's system message; null: none
    max_new_tokens: int = checked(32, ge=1)  # longest response, in the target's tokens
    temperature: float = checked(1.0, ge=MIN_TEMPERATURE, also=(0,))  # sampling temperature of the responses; 0 = greedy
    top_p: float = checked(1.0, gt=0, le=1)  # nucleus sampling of the responses; 1 = off
    served: ServedConfig = field(default_factory=ServedConfig)  # play the target on an OpenAI-compatible chat server (base_url, model, retries, timeout); base_url null = locally
    auditor_base: bool = False  # play the target (and score the likelihood) with the auditor's own model, its LoRA adapters switched off: one base in memory; needs the auditor on LoRA (lora.r >= 1), without pretrained_path, frozen_from or served


def target_chat(system_prompt: str, prompt: str, utterances: Sequence[str], responses: Sequence[str]) -> Chat:
    """The chat the target answers: ``utterances`` so far (the last one unanswered) and its earlier ``responses``."""
    chat: Chat = [{"role": "system", "content": system_prompt}] if system_prompt else []
    for turn, utterance in enumerate(utterances):
        chat.append({"role": "user", "content": f"{prompt}\n{utterance}" if turn == 0 else utterance})
        if turn < len(responses):
            chat.append({"role": "assistant", "content": responses[turn]})
    return chat


def conversation_text(prompt: str, utterances: Sequence[str], responses: Sequence[str]) -> str:
    """The conversation as plain text: the prompt, then each utterance and response on a line of its own, in turn."""
    lines = [prompt]
    for turn, utterance in enumerate(utterances):
        lines.append(utterance)
        if turn < len(responses):
            lines.append(responses[turn])
    return "\n".join(lines)


class AuditorBase(LocalTextModel):
    """The auditor's own model with its LoRA adapters switched off, as the target's text model (``auditor_base``).

    No weight is loaded or copied: each reply and likelihood runs the
    auditor's model (read from its policy at each call, so adapters added
    after a warm start count) under ``peft``'s ``disable_adapter()``, in eval
    mode (the model's mode is given back after), with the auditor's
    tokenizer. It plays what a separate copy of the base would.

    Parameters
    ----------
    policy : LMPolicy
        The auditor's policy, whose ``model`` has LoRA adapters.
    batch_size : int
        Chats per ``generate`` call.
    """

    def __init__(self, policy: Any, batch_size: int = 256) -> None:  # LocalTextModel's __init__ would load a folder
        self.policy = policy
        self.folder = None
        self.tokenizer = policy.tokenizer
        self.batch_size = int(batch_size)
        banned = {self.tokenizer.pad_token_id, self.tokenizer.bos_token_id, self.tokenizer.unk_token_id}
        self.banned = sorted(token for token in banned if token is not None and token != self.tokenizer.eos_token_id)

    @property
    def model(self) -> Any:
        """The auditor's model (adapters included; :meth:`as_base` switches them off)."""
        return self.policy.model

    @property
    def device(self) -> torch.device:
        """Where the auditor's model is."""
        return next(self.model.parameters()).device

    @contextmanager
    def as_base(self) -> Iterator[None]:
        """Run the block with the auditor's adapters off and its model in eval mode (its mode given back after)."""
        model = self.model
        if not has_lora(model):
            raise ConfigError("scenario.target.auditor_base: the auditor's model has no LoRA adapters to switch off: set its lora.r >= 1")
        training = model.training
        model.eval()
        try:
            with adapters_disabled([model]):
                yield
        finally:
            model.train(training)

    def reply(self, chats: Sequence[Chat], sampling: Sampling, seed: int) -> list[str]:
        with self.as_base():
            return super().reply(chats, sampling, seed)

    def close(self) -> None:
        self.policy = None


class Target:
    """The target's replies and its likelihood of utterances (see the module docstring).

    Parameters
    ----------
    config : TargetConfig
        The target's entry.
    folder : str, optional
        The local model folder it plays from, or (served) scores the
        likelihood with; None for a served target without one.
    where : str
        The entry's config path, for messages.
    device : torch.device or str
        Where a local model runs.
    local : LocalTextModel, optional
        The local model itself, instead of ``folder`` (an :class:`AuditorBase`).
    """

    def __init__(
        self, config: Any, folder: Optional[str], where: str = "scenario.target", device: Any = "cpu", local: Optional[LocalTextModel] = None
    ) -> None:
        self.sampling = Sampling(int(config.max_new_tokens), float(config.temperature), float(config.top_p))
        if local is None and folder is not None:
            local = LocalTextModel(folder, device, batch_size=256)
        self.local = local
        self.where = where
        self.served = is_served(config.served)
        self.player = served_player(config.served, f"{where}.served") if self.served else self.local

    @property
    def has_likelihood(self) -> bool:
        """Whether a local model scores the likelihood term."""
        return self.local is not None

    def reply(self, chats: Sequence[Chat], seed: int) -> list[str]:
        """One response per chat, sampled with the target's settings and ``seed``; a server that fails names the target."""
        try:
            return self.player.reply(list(chats), self.sampling, seed)
        except ModelServerError as error:
            raise ModelServerError(f"{self.where}.served: {error}") from None

    def likelihood(self, contexts: Sequence[str], utterances: Sequence[str]) -> torch.Tensor:
        """``(B,)`` mean per-token log-probability of each utterance after its context (:func:`~nip_like.scenarios.stress_test.reward.utterance_likelihood`)."""
        model = self.local.model
        context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        with self.local.as_base() if isinstance(self.local, AuditorBase) else nullcontext():
            return utterance_likelihood(model, self.local.tokenizer, contexts, utterances, int(context) if context else None)
