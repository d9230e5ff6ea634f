"""The configuration of a language-model agent and the builders of its parts.

:func:`build_lm` makes the causal LM (a tiny Llama-family model from a config,
or a local ``save_pretrained`` folder) and its tokenizer;
:func:`build_lm_policy` adds the value head and wraps them in an
:class:`~nip_like.lm.policy.LMPolicy`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from nip_like.allowed import checked
from nip_like.errors import ConfigError
from nip_like.lm.checkpoints import local_model_folder, load_value_head
from nip_like.lm.policy import LMPolicy
from nip_like.lm.value import LMValueHead


@dataclass
class LMAgentConfig:
    """One language-model agent: its model, how it samples, its value head."""

    architecture: str = "llama"  # transformers model type built from a config (AutoConfig.for_model) when no pretrained_path
    pretrained_path: Optional[str] = None  # local save_pretrained folder (model + tokenizer) to start from; null builds from config
    hidden_size: int = checked(64, ge=1)  # width of the transformer (from-config models)
    num_layers: int = checked(2, ge=1)  # transformer blocks (from-config models)
    num_heads: int = checked(4, ge=1)  # attention heads, also key-value heads (from-config models)
    intermediate_size: int = checked(128, ge=1)  # width of the MLP inside each block (from-config models)
    max_new_tokens: int = checked(8, ge=1)  # tokens of a message, eos included
    temperature: float = checked(1.0, gt=0)  # logits are divided by it before sampling; > 0
    top_k: int = checked(0, ge=0)  # sample among the k most likely tokens only; 0 = off
    top_p: float = checked(1.0, gt=0, le=1)  # sample within the top-p probability nucleus only; 1 = off
    value_head: bool = True  # give the agent a linear value head (for PPO's critic)
    shared_body: bool = True  # the value head reads the policy's last hidden state; false: a separate copy of the body


def build_lm(
    config: LMAgentConfig, tokenizer: Optional[PreTrainedTokenizerBase] = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Make an agent's causal LM and tokenizer, float32, on the CPU.

    Parameters
    ----------
    config : LMAgentConfig
        Without ``pretrained_path``: a model of type ``architecture`` from
        ``AutoConfig.for_model`` with the config's sizes (passed as
        ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``,
        ``num_key_value_heads`` where the type has it, ``intermediate_size``:
        Llama-family types read them all, others may map or ignore some),
        randomly initialised, with the tokenizer's vocabulary size. With
        ``pretrained_path``: ``AutoModelForCausalLM.from_pretrained`` and
        ``AutoTokenizer.from_pretrained`` on that local folder.
    tokenizer : PreTrainedTokenizerBase, optional
        Needed without ``pretrained_path`` (see
        :func:`~nip_like.lm.tokenizer.build_tokenizer`). With it, it must
        have the same vocabulary as the folder's tokenizer.

    Returns
    -------
    model : PreTrainedModel
        The causal LM, with the tokenizer's pad, bos and eos ids in its
        config and generation config, and no dropout (:func:`disable_dropout`).
    tokenizer : PreTrainedTokenizerBase

    Raises
    ------
    ConfigError
        (a ``ValueError``) for a ``pretrained_path`` that is not an existing
        folder, an unknown architecture, sizes that do not fit, or a missing
        or mismatched tokenizer.
    """
    if config.pretrained_path is not None:
        folder = local_model_folder(config.pretrained_path)
        model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
        folder_tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        if tokenizer is not None and tokenizer.get_vocab() != folder_tokenizer.get_vocab():
            raise ConfigError(f"the tokenizer given differs from the one in {folder}: leave it out to use the folder's")
        tokenizer = folder_tokenizer
    else:
        if tokenizer is None:
            raise ConfigError("build_lm needs a tokenizer when no pretrained_path is given")
        model = AutoModelForCausalLM.from_config(_model_config(config, tokenizer), dtype=torch.float32)
    for settings in (model.config, model.generation_config):
        if settings is not None:
            settings.pad_token_id = tokenizer.pad_token_id
            settings.bos_token_id = tokenizer.bos_token_id
            settings.eos_token_id = tokenizer.eos_token_id
    disable_dropout(model)
    return model, tokenizer


def disable_dropout(model: nn.Module) -> None:
    """Set every dropout probability of ``model`` to 0, in place (as TRL does).

    With dropout, a forward pass in train mode would not reproduce the
    log-probabilities stored at sampling, and the PPO ratio would not start
    at 1.

    Parameters
    ----------
    model : nn.Module
        A model whose ``nn.Dropout`` modules and ``config.attention_dropout``
        (read directly by Llama-family attention) are set to 0.
    """
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        if hasattr(module, "attention_dropout") and isinstance(module.attention_dropout, float):
            module.attention_dropout = 0.0
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "attention_dropout"):
        config.attention_dropout = 0.0


def build_lm_policy(config: LMAgentConfig, tokenizer: Optional[PreTrainedTokenizerBase] = None) -> LMPolicy:
    """Make an agent's :class:`~nip_like.lm.policy.LMPolicy`, value head included.

    Parameters
    ----------
    config : LMAgentConfig
        The agent. With ``value_head``, a ``pretrained_path`` folder's
        ``value_head.pt`` (written by
        :func:`~nip_like.lm.checkpoints.save_agent`) is loaded if there is
        one; its ``shared_body`` must match the config's.
    tokenizer : PreTrainedTokenizerBase, optional
        As for :func:`build_lm`.

    Returns
    -------
    LMPolicy
        On the CPU; move it with ``.to(device)``.
    """
    model, tokenizer = build_lm(config, tokenizer)
    value_head = None
    if config.value_head:
        if config.pretrained_path is not None:
            value_head = load_value_head(config.pretrained_path, model)
        if value_head is not None and value_head.shared_body != config.shared_body:
            raise ConfigError(
                f"the value head in {config.pretrained_path} has shared_body={value_head.shared_body}, "
                f"the config asks for shared_body={config.shared_body}"
            )
        if value_head is None:
            value_head = LMValueHead.for_model(model, shared_body=config.shared_body)
    return LMPolicy(
        model,
        tokenizer,
        max_new_tokens=config.max_new_tokens,
        temperature=config.temperature,
        top_k=config.top_k,
        top_p=config.top_p,
        value_head=value_head,
    )


def _model_config(config: LMAgentConfig, tokenizer: PreTrainedTokenizerBase):
    """The transformers config of a from-config model."""
    if config.hidden_size % config.num_heads:
        raise ConfigError(f"hidden_size ({config.hidden_size}) must be a multiple of num_heads ({config.num_heads})")
    sizes = dict(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        intermediate_size=config.intermediate_size,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    try:
        model_config = AutoConfig.for_model(config.architecture, **sizes)
    except ValueError as error:
        raise ConfigError(
            f"unknown architecture {config.architecture!r}: give a transformers model type such as llama, mistral or qwen2"
        ) from error
    if hasattr(model_config, "num_key_value_heads"):
        # Several families default to more key-value heads than a tiny model has attention heads.
        model_config.num_key_value_heads = config.num_heads
    if type(model_config) not in AutoModelForCausalLM._model_mapping:
        raise ConfigError(f"architecture {config.architecture!r} has no causal LM in transformers")
    return model_config
