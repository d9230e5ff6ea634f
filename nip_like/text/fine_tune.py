"""Fine-tuning a local text model on a dataset file: SFT and DPO, a plain PyTorch loop.

The dataset files use TRL's conversational formats, one JSON object per line:

* SFT: ``{"messages": [..., {"role": "assistant", "content": "..."}]}``;
  the loss is on the last (assistant) message's tokens and its end token only,
  so a model learns the agent's own messages, never the prompts;
* DPO: ``{"prompt": [...], "chosen": [{"role": "assistant", ...}],
  "rejected": [...]}``; the loss is the project's
  :func:`~nip_like.objectives.dpo.preference_loss` on the summed log-probs of
  the chosen and rejected replies (TRL's convention) against the starting
  model as the reference (IPO: log-probs per token, as TRL defines it), and the logged metrics have TRL's names
  (``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``,
  ``rewards/margins``, ``logps/chosen``, ``logps/rejected``); ``rpo_alpha``
  adds the chosen replies' token NLL, as TRL's option of that name does.

:func:`fine_tune` runs a :class:`FineTuneSpec`; the local job backend
(:mod:`nip_like.text.jobs`) calls it in a worker process.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from nip_like import start_up
from nip_like.errors import ConfigError
from nip_like.lm.agent_folders import quiet_progress, save_agent
from nip_like.lm.decoding import forward_parameters
from nip_like.lm.models import disable_dropout
from nip_like.lm.padding import position_ids
from nip_like.preference import LOSS_TYPES, preference_loss
from nip_like.optimizers import make_optimizer
from nip_like.text.models import chat_prompts

METHODS = ("sft", "dpo")


@dataclass
class FineTuneSpec:
    """One fine-tune job: what to train, on what, into where, and how."""

    job_id: str
    method: str  # sft | dpo
    base_model: str  # local folder of the starting model (save_pretrained, with a chat template)
    dataset: str  # JSONL file in TRL's conversational format (see the module docstring)
    output: str  # folder the fine-tuned model is saved to
    epochs: int = 1
    lr: float = 1e-4
    batch_size: int = 32
    max_grad_norm: Optional[float] = 1.0
    seed: int = 0
    beta: float = 0.1  # dpo: inverse temperature (sigmoid) or regularisation (ipo)
    loss_type: str = "sigmoid"  # dpo: sigmoid (DPO) | ipo | hinge
    rpo_alpha: Optional[float] = None  # dpo: weight of the chosen replies' mean token NLL added to the loss (TRL's rpo_alpha)
    device: str = "cpu"
    num_threads: Optional[int] = None  # torch CPU threads of the worker; null leaves torch's default

    def check(self) -> None:
        """One-line :class:`ConfigError` for a value out of range."""
        if self.method not in METHODS:
            raise ConfigError(f"fine-tune method {self.method!r} is unknown; allowed: {', '.join(METHODS)}")
        if self.loss_type not in LOSS_TYPES:
            raise ConfigError(f"fine-tune loss_type {self.loss_type!r} is unknown; allowed: {', '.join(LOSS_TYPES)}")
        if self.rpo_alpha is not None and self.rpo_alpha < 0:
            raise ConfigError(f"fine-tune job {self.job_id}: rpo_alpha must be >= 0 or null, got {self.rpo_alpha}")
        if self.epochs < 1 or self.batch_size < 1 or not self.lr > 0:
            raise ConfigError(f"fine-tune job {self.job_id}: epochs and batch_size must be >= 1 and lr > 0")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "FineTuneSpec":
        return cls(**json.loads(text))


def read_dataset(path: Path, method: str) -> list[dict]:
    """The dataset's records, checked against the method's format (one line that names the first bad line)."""
    records = []
    needed = ("messages",) if method == "sft" else ("prompt", "chosen", "rejected")
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ConfigError(f"{path}:{number}: not JSON ({error.msg})") from None
        missing = [key for key in needed if key not in record]
        if missing:
            raise ConfigError(f"{path}:{number}: a {method} record needs {', '.join(needed)}; missing {', '.join(missing)}")
        records.append(record)
    if not records:
        raise ConfigError(f"{path}: the dataset is empty")
    return records


def _pairs(tokenizer, records: list[dict], method: str) -> list[tuple[list[int], list[int], list[int] | None]]:
    """(prompt ids, chosen reply ids, rejected reply ids or None) per record; replies end with the end token."""
    eos = [tokenizer.eos_token_id]
    if method == "sft":
        prompts = chat_prompts(tokenizer, [record["messages"][:-1] for record in records])
        replies = [record["messages"][-1]["content"] for record in records]
        rejected = [None] * len(records)
    else:
        prompts = chat_prompts(tokenizer, [record["prompt"] for record in records])
        replies = [record["chosen"][-1]["content"] for record in records]
        rejected = [record["rejected"][-1]["content"] for record in records]

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    return [
        (encode(prompt), encode(reply) + eos, None if other is None else encode(other) + eos)
        for prompt, reply, other in zip(prompts, replies, rejected)
    ]


def reply_log_probs(
    model, tokenizer, prompts: list[list[int]], replies: list[list[int]], device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B,)`` summed log-probabilities of each reply after its prompt, and ``(B,)`` reply lengths.

    Prompts are padded on the left and replies on the right (positions count real tokens only, as in
    :func:`nip_like.lm.padding.position_ids`), so every reply starts at the same column and the pass computes only
    the logits that predict reply tokens (``logits_to_keep``, where the model takes it). At Gemma 3's 262,144-token
    vocabulary the prompts' logits were most of a job's forward and backward time, and a gigabyte a batch.
    """
    prompt_width = max(len(prompt) for prompt in prompts)
    reply_width = max(len(reply) for reply in replies)
    ids = torch.full((len(prompts), prompt_width + reply_width), tokenizer.pad_token_id, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for row, (prompt, reply) in enumerate(zip(prompts, replies)):
        start, end = prompt_width - len(prompt), prompt_width + len(reply)
        ids[row, start:end] = torch.tensor(prompt + reply)
        attention[row, start:end] = 1
    ids, attention = ids.to(device), attention.to(device)
    extra = {"logits_to_keep": reply_width + 1} if "logits_to_keep" in forward_parameters(model) else {}
    output = model(input_ids=ids, attention_mask=attention, position_ids=position_ids(attention), use_cache=False, **extra)
    # The logits at column i predict token i + 1: the replies' tokens are predicted from column prompt_width - 1 on.
    logits = output.logits[:, -(reply_width + 1) : -1].float()
    log_probs = torch.gather(F.log_softmax(logits, dim=-1), -1, ids[:, prompt_width:].unsqueeze(-1)).squeeze(-1)
    mask = attention[:, prompt_width:].bool()
    return (log_probs * mask).sum(-1), mask.sum(-1)


def _scores(spec: FineTuneSpec, summed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """A reply's score for the preference loss: its summed log-prob, per token for IPO (TRL's convention)."""
    return summed / counts.clamp(min=1) if spec.loss_type == "ipo" else summed


def fine_tune(spec: FineTuneSpec, log: Callable[[dict], None] = lambda metrics: None) -> Path:
    """Run the job of ``spec`` and save the model (and tokenizer) to ``spec.output``.

    Parameters
    ----------
    spec : FineTuneSpec
        The job.
    log : callable
        Called with each optimiser step's metrics (``step``, ``epoch``,
        ``loss`` and the method's own, TRL's names for DPO).

    Returns
    -------
    Path
        The saved model's folder.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer  # loaded here: importing this module stays light

    spec.check()
    if spec.num_threads:
        torch.set_num_threads(spec.num_threads)
    random.seed(spec.seed)
    torch.manual_seed(spec.seed)
    device = torch.device(spec.device)
    tokenizer = AutoTokenizer.from_pretrained(spec.base_model, local_files_only=True)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    with quiet_progress():
        model = AutoModelForCausalLM.from_pretrained(spec.base_model, local_files_only=True, dtype=torch.float32)
    start_up.resume_after_start_up()  # loaded: a job that paused the collector for its start-up resumes it
    disable_dropout(model)
    model.to(device)
    data = _pairs(tokenizer, read_dataset(Path(spec.dataset), spec.method), spec.method)
    reference = None
    if spec.method == "dpo":
        model.eval()
        with torch.no_grad():
            reference = []
            for start in range(0, len(data), spec.batch_size):
                chunk = data[start : start + spec.batch_size]
                prompts = [item[0] for item in chunk]
                chosen = _scores(spec, *reply_log_probs(model, tokenizer, prompts, [item[1] for item in chunk], device))
                rejected = _scores(spec, *reply_log_probs(model, tokenizer, prompts, [item[2] for item in chunk], device))
                reference += list(zip(chosen.tolist(), rejected.tolist()))
    model.train()
    optimizer = make_optimizer("adamw", model.parameters(), spec.lr, weight_decay=0.0, fast=False)
    order = list(range(len(data)))
    generator = random.Random(spec.seed)
    step = 0
    for epoch in range(spec.epochs):
        generator.shuffle(order)
        for start in range(0, len(order), spec.batch_size):
            batch = order[start : start + spec.batch_size]
            prompts = [data[index][0] for index in batch]
            if spec.method == "sft":
                summed, counts = reply_log_probs(model, tokenizer, prompts, [data[index][1] for index in batch], device)
                loss = -summed.sum() / counts.sum()
                metrics = {"loss": loss.item(), "num_tokens": int(counts.sum())}
            else:
                # Chosen and rejected replies in one forward pass.
                replies = [data[index][1] for index in batch] + [data[index][2] for index in batch]
                summed, counts = reply_log_probs(model, tokenizer, prompts + prompts, replies, device)
                both = _scores(spec, summed, counts)
                chosen, rejected = both[: len(batch)], both[len(batch) :]
                ref = torch.tensor([reference[index] for index in batch], device=device)
                logits = (chosen - rejected) - (ref[:, 0] - ref[:, 1])
                loss = preference_loss(logits, spec.beta, spec.loss_type).mean()
                if spec.rpo_alpha:
                    # RPO: the chosen replies' likelihood is kept up, so that DPO cannot push both down.
                    nll = -summed[: len(batch)].sum() / counts[: len(batch)].sum()
                    loss = loss + spec.rpo_alpha * nll
                reward_chosen = spec.beta * (chosen - ref[:, 0]).detach()
                reward_rejected = spec.beta * (rejected - ref[:, 1]).detach()
                metrics = {
                    "loss": loss.item(),
                    "rewards/chosen": reward_chosen.mean().item(),
                    "rewards/rejected": reward_rejected.mean().item(),
                    "rewards/accuracies": (reward_chosen > reward_rejected).float().mean().item(),
                    "rewards/margins": (reward_chosen - reward_rejected).mean().item(),
                    "logps/chosen": chosen.detach().mean().item(),
                    "logps/rejected": rejected.detach().mean().item(),
                }
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if spec.max_grad_norm is not None:
                metrics["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), spec.max_grad_norm))
            optimizer.step()
            step += 1
            log({"step": step, "epoch": epoch, **metrics})
    model.eval()
    return save_agent(Path(spec.output), model, tokenizer)
