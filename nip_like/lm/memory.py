"""A lower bound on the memory of LM agents, checked before a run starts.

:func:`check_lm_memory` refuses, in one line, sizes that clearly cannot fit:
the weights of every agent's model, plus the larger of

* sampling: the KV cache of a batch (``max(trainer.num_envs,
  trainer.test_batch_episodes)`` sequences of ``max_new_tokens`` tokens, the
  prompt not counted) and the logits of its last position;
* scoring with gradients: the float32 logits of one micro-batch
  (``max_tokens_per_micro_batch`` tokens, else ``trainer.minibatch_size``
  sequences of ``max_new_tokens`` tokens), kept three times (logits,
  log-softmax, their gradient);

against the memory available on the run's device: free memory on CUDA
(``torch.cuda.mem_get_info``), ``MemAvailable`` of ``/proc/meminfo`` on the
CPU. Prompts, activations and optimiser states are left out, so what is
refused would fail anyway; what passes may still not fit.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

import torch

from nip_like.errors import ConfigError

GIB = 1024**3
#: Bytes of one element of each parameter dtype an agent may use.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a causal LM that its memory depends on."""

    num_layers: int
    hidden_size: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # 0 when unknown (the token view's alphabet): no logits counted

    @property
    def parameters(self) -> int:
        """Parameters of a Llama-like model of this shape (embeddings tied), a lower bound for others."""
        attention = 2 * self.hidden_size * self.hidden_size + 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        mlp = 2 * self.hidden_size * self.intermediate_size
        return self.vocab_size * self.hidden_size + self.num_layers * (attention + mlp)

    def kv_cache_bytes(self, sequences: int, tokens: int, element_bytes: int) -> int:
        """Bytes of the keys and values of ``sequences`` sequences of ``tokens`` tokens."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * sequences * tokens * element_bytes


def shape_of_folder(path: str | Path) -> ModelShape:
    """The shape read from a model folder's ``config.json`` (Llama, Qwen2, GPT-2 names)."""
    config = json.loads((Path(path).expanduser() / "config.json").read_text())
    config = config.get("text_config", config)
    hidden = int(config.get("hidden_size") or config.get("n_embd"))
    heads = int(config.get("num_attention_heads") or config.get("n_head"))
    return ModelShape(
        num_layers=int(config.get("num_hidden_layers") or config.get("n_layer")),
        hidden_size=hidden,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        intermediate_size=int(config.get("intermediate_size") or config.get("n_inner") or 4 * hidden),
        vocab_size=int(config.get("vocab_size") or 0),
    )


def shape_of_agent(agent, vocab_size: int = 0) -> ModelShape:
    """The shape of an :class:`~nip_like.lm.models.LMAgentConfig`'s model: its folder's, else its from-config sizes."""
    if agent.pretrained_path is not None:
        return shape_of_folder(agent.pretrained_path)
    heads = int(agent.num_heads)
    return ModelShape(
        num_layers=int(agent.num_layers),
        hidden_size=int(agent.hidden_size),
        num_kv_heads=heads,
        head_dim=int(agent.hidden_size) // heads,
        intermediate_size=int(agent.intermediate_size),
        vocab_size=int(vocab_size),
    )


def available_memory(device: torch.device | str) -> Optional[tuple[int, str]]:
    """Bytes free for the run on ``device`` and where the figure comes from; None when it cannot be told."""
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return None
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), f"free on {device}"
    if device.type == "cpu":
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "MemAvailable of the CPU"
        except OSError:
            return None
    return None


def check_lm_memory(
    agents: Mapping[str, tuple[str, object, int]],
    sampling_batch: int,
    minibatch_size: int,
    device: torch.device | str,
    batch_fields: str = "trainer.num_envs / trainer.test_batch_episodes",
) -> None:
    """Refuse, in one line, LM agents whose memory clearly cannot fit (see the module docstring).

    Parameters
    ----------
    agents : mapping of str to (str, LMAgentConfig, int)
        Each agent's name -> (the config path its settings come from, its
        config, the vocabulary of its model if built from config; 0: unknown,
        no logits counted).
    sampling_batch : int
        Sequences sampled at once.
    minibatch_size : int
        Sequences of one scoring pass when an agent has no token budget.
    device : torch.device or str
        The run's device.
    batch_fields : str
        The options that set ``sampling_batch``, for the message.

    Raises
    ------
    ConfigError
        Naming the agent's ``max_new_tokens``, the batch, the estimate and the memory available.
    """
    available = available_memory(device)
    if available is None:
        return
    free, source = available
    shapes = {name: shape_of_agent(agent, vocab_size) for name, (_, agent, vocab_size) in agents.items()}
    weights = sum(shapes[name].parameters * DTYPE_BYTES.get(str(agent.dtype), 4) for name, (_, agent, _) in agents.items())
    for name, (where, agent, _) in agents.items():
        shape, tokens = shapes[name], int(agent.max_new_tokens)
        kv_cache = shape.kv_cache_bytes(sampling_batch, tokens, DTYPE_BYTES.get(str(agent.dtype), 4))
        sampling = kv_cache + sampling_batch * shape.vocab_size * 4
        budget = agent.max_tokens_per_micro_batch
        scoring = 3 * 4 * shape.vocab_size * (int(budget) if budget is not None else minibatch_size * tokens)
        needed = weights + max(sampling, scoring)
        if needed <= free:
            continue
        if sampling >= scoring:
            part = f"KV cache {kv_cache / GIB:.1f} GiB of {sampling_batch} sequences of {tokens} tokens"
            advice = f"{where}.max_new_tokens ({tokens}) or {batch_fields}"
        else:
            part = f"logits of a scoring pass {scoring / GIB:.1f} GiB"
            advice = (
                f"{where}.max_tokens_per_micro_batch ({budget})" if budget is not None
                else f"trainer.minibatch_size ({minibatch_size}), or set {where}.max_tokens_per_micro_batch"
            )
        if weights > max(sampling, scoring):
            advice = f"the models' sizes ({where}.pretrained_path, hidden_size, num_layers, vocab_size)"
        raise ConfigError(
            f"{where}: agent {name} cannot fit in memory: it needs at least {needed / GIB:.1f} GiB (weights of the agents "
            f"{weights / GIB:.1f} GiB, {part}), but {free / GIB:.1f} GiB is available ({source}); lower {advice}"
        )
