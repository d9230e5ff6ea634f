"""Text models behind one interface (:mod:`nip_like.text.interface`): chat messages in, text out.

A :class:`~nip_like.text.interface.TextModel` answers a batch of chats (each a list of
``{"role", "content"}`` messages) with one reply each.
:class:`LocalTextModel` is a transformers causal LM in this process, loaded
from a local ``save_pretrained`` folder with its own tokenizer and chat
template (the tiny models the text trainers build, or any chat model the user
has on disk); :class:`~nip_like.text.remote.OpenAIChatModel` is any server
that speaks the OpenAI chat-completions protocol (vLLM, TGI,
``transformers serve``, a hosted API); a scenario's scripted players are text
models too (``backend: scripted``). :func:`build_text_model` makes the model of
a :class:`~nip_like.text.interface.TextModelConfig`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from nip_like import interrupts

from nip_like.errors import ConfigError
from nip_like.lm.agent_folders import local_model_folder, quiet_progress
from nip_like.lm.models import LMAgentConfig, build_lm, disable_dropout
from nip_like.text.interface import BACKENDS, Chat, Sampling, TextModel, TextModelConfig
from nip_like.text.remote import OpenAIChatModel


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
        from transformers import AutoModelForCausalLM, AutoTokenizer  # loaded here: importing this module stays light

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
        # No token_type_ids: a causal LM's forward takes none, and transformers 4.x's generate refuses unused inputs.
        encoded = self.tokenizer(
            prompts, return_tensors="pt", padding=True, add_special_tokens=False, return_token_type_ids=False
        ).to(self.device)
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
            stopping_criteria=stop_on_signal(),
        )
        new_tokens = output[:, encoded["input_ids"].shape[1] :]
        return [self.tokenizer.decode(row, skip_special_tokens=True) for row in cut_at_eos(new_tokens, self.tokenizer.eos_token_id)]

    def close(self) -> None:
        self.model = None


def stop_on_signal():
    """``generate``'s stopping criteria that end a call at a stop request (:class:`~nip_like.interrupts.StopNow`).

    A long reply then does not hold a signal up. (The class is made on first
    use, so that importing this module does not import transformers.)
    """
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StopOnSignal(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
            interrupts.raise_if_stop_requested("the text model's replies")
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return StoppingCriteriaList([StopOnSignal()])


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
        return OpenAIChatModel.from_config(config, default_model=str(folder))
    if config.backend == "scripted":
        raise ConfigError("a scripted player is made by its scenario (scenario.scripted_model), not from a folder")
    raise ConfigError(f"unknown text model backend {config.backend!r}; allowed: {', '.join(BACKENDS)}")
