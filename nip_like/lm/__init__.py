"""Language-model agents: a Hugging Face causal LM and its tokenizer as a policy.

* :mod:`nip_like.lm.tokenizer`: word-level tokenizers for a scenario's alphabet;
* :mod:`nip_like.lm.models`: the agent's config and the builders of its model;
* :mod:`nip_like.lm.sampling`: the distribution tokens are sampled from;
* :mod:`nip_like.lm.policy`: sampling, teacher-forced scoring and values;
* :mod:`nip_like.lm.padding`: positions and trimming of padded prompts;
* :mod:`nip_like.lm.decoding`: the sampling loop with the KV cache;
* :mod:`nip_like.lm.teacher_forcing`: one teacher-forced pass (log-probabilities, entropies, value);
* :mod:`nip_like.lm.micro_batches`: scoring passes within a token budget;
* :mod:`nip_like.lm.value`: the value head;
* :mod:`nip_like.lm.agent_folders`: ``save_pretrained`` folders plus the value head.
"""


from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nip_like.lm.agent_folders import load_agent, save_agent
    from nip_like.lm.models import LMAgentConfig, build_lm, build_lm_policy
    from nip_like.lm.policy import LMPolicy
    from nip_like.lm.sampling import SamplingSettings
    from nip_like.lm.tokenizer import build_tokenizer
    from nip_like.lm.value import LMValueHead

#: Where each name of the package lives. They load on first use (PEP 562), so that importing one submodule
#: (``nip_like.lm.sharding``, which every RL trainer imports) does not import transformers and peft for
#: runs without language models.
_HOMES = {
    "load_agent": "agent_folders",
    "save_agent": "agent_folders",
    "LMAgentConfig": "models",
    "build_lm": "models",
    "build_lm_policy": "models",
    "LMPolicy": "policy",
    "SamplingSettings": "sampling",
    "build_tokenizer": "tokenizer",
    "LMValueHead": "value",
}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        value = getattr(importlib.import_module(f"nip_like.lm.{_HOMES[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'nip_like.lm' has no attribute {name!r}")


__all__ = [
    "LMAgentConfig",
    "LMPolicy",
    "LMValueHead",
    "SamplingSettings",
    "build_lm",
    "build_lm_policy",
    "build_tokenizer",
    "load_agent",
    "save_agent",
]
