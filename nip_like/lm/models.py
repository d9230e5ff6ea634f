"""The configuration of a language-model agent and the builders of its parts.

:func:`build_lm` makes the causal LM (a tiny Llama-family model from a config,
or a local ``save_pretrained`` folder) and its tokenizer;
:func:`build_lm_policy` adds the value head and wraps them in an
:class:`~nip_like.lm.policy.LMPolicy`.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from nip_like.allowed import checked
from nip_like.checkpoint import check_manifest
from nip_like.errors import ConfigError
from nip_like.lm.chat_templates import apply_chat_template, resolve_chat_template
from nip_like.lm.served_config import ServedConfig
from nip_like.lm.agent_folders import local_model_folder, load_value_head, quiet_progress
from nip_like.lm.gguf import converted_folder, is_gguf
from nip_like.lm.lora import LoraOptions, add_lora, lora_enabled
from nip_like.lm.policy import LMPolicy
from nip_like.lm.sampling import MIN_TEMPERATURE
from nip_like.lm.server import SamplerConfig
from nip_like.lm.sampling_copy import SAMPLING_DTYPES
from nip_like.lm.static_decoding import DECODING_MODES
from nip_like.lm.value import LMValueHead

if TYPE_CHECKING:  # transformers loads on first use: runs without language models never import it
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass
class LMAgentConfig:
    """One language-model agent: its model, how it samples, its value head."""

    architecture: str = "llama"  # transformers model type built from a config (AutoConfig.for_model) when no pretrained_path
    pretrained_path: Optional[str] = None  # local save_pretrained folder (model + tokenizer) or .gguf file (dequantized once into a cached folder) to start from; null builds from config
    chat_template: Optional[str] = None  # the chat template the agent's tokenizer renders chats with: chatml, llama3, gemma, plain or a Jinja file's path; null = the model folder's own; its turn end ends the agent's messages
    hidden_size: int = checked(64, ge=1)  # width of the transformer (from-config models)
    num_layers: int = checked(2, ge=1)  # transformer blocks (from-config models)
    num_heads: int = checked(4, ge=1)  # attention heads, also key-value heads (from-config models)
    intermediate_size: int = checked(128, ge=1)  # width of the MLP inside each block (from-config models)
    vocab_size: int = checked(2000, ge=300)  # BPE vocabulary of a from-config chat model (chat view without pretrained_path)
    max_new_tokens: int = checked(8, ge=1)  # tokens of a message, eos included
    temperature: float = checked(1.0, ge=MIN_TEMPERATURE)  # logits are divided by it before sampling; >= 0.01, below which they overflow
    top_k: int = checked(0, ge=0)  # sample among the k most likely tokens only; 0 = off
    top_p: float = checked(1.0, gt=0, le=1)  # sample within the top-p probability nucleus only; 1 = off
    value_head: Optional[bool] = None  # give the agent a linear value head (for PPO's critic); null = yes, unless the agent is frozen
    shared_body: bool = True  # the value head reads the policy's last hidden state; false: a separate copy of the body
    stop_strings: list[str] = field(default_factory=list)  # a message also ends once its text contains one of these
    lora: LoraOptions = field(default_factory=LoraOptions)  # LoRA adapters through peft (r, alpha, dropout, target_modules); r=0 = full fine-tuning
    frozen_from: Optional[str] = None  # play with the weights of a finished run's agent of this name (its run folder) or of a model folder (nip_like.export's, or any save_pretrained folder), frozen for the whole run; instead of pretrained_path, without lora
    frozen_checkpoint: str = checked("last", choices=("last", "best"))  # the checkpoint of the frozen_from run folder to read the agent from
    share_policy_with: Optional[str] = None  # another agent whose model this one plays with: one set of weights (full or LoRA) trained on both roles' tokens, in the other's optimiser group, told apart by the prompts; its own value head and sampling settings; the model fields must equal the other's
    share_base_with: Optional[str] = None  # another agent whose frozen base model this one shares (held once in memory), each with its own LoRA adapters and value head; both need lora.r >= 1 and the same base; null = a model of its own
    gradient_checkpointing: bool = False  # recompute activations in the backward pass instead of keeping them
    max_tokens_per_micro_batch: Optional[int] = checked(None, ge=0)  # token budget of one scoring pass with gradients; null = automatic (from the device's free memory, measured when the trainer is built); 0 = none (the whole minibatch at once)
    score_chunk_tokens: Optional[int] = checked(None, ge=0)  # score a message's tokens this many positions at a time, recomputing their logits in the backward pass; null = automatic (with gradients, chunks of at most 256 MiB of logits where the model allows it and is not sharded); 0 = all logits at once
    dtype: str = checked("float32", choices=("float32", "bfloat16"))  # dtype of the model's parameters (bfloat16 halves their memory)
    served: Optional[ServedConfig] = None  # a frozen agent (frozen_from) of the chat view played by an OpenAI-compatible chat server (base_url, model, retries, timeout): its chat is sent, the answer is its message; null = played by its local model
    sampler: SamplerConfig = field(default_factory=SamplerConfig)  # where messages are sampled: kind local (this model) or server (an OpenAI-compatible completions server; see nip_like.lm.server)
    decoding: str = checked("auto", choices=DECODING_MODES)  # how local sampling decodes: auto = compiled on CUDA, eager elsewhere; eager (growing KV cache), static (preallocated KV cache, fixed shapes), compiled (static, the step through torch.compile mode=reduce-overhead: CUDA graphs); a fallback is logged once
    sampling_dtype: str = checked("model", choices=SAMPLING_DTYPES)  # weights local sampling reads: model = the model's own; bfloat16 = a bf16 copy refreshed after each update (half the bytes a token reads; stored log-probs are the bf16 model's); scoring unchanged


#: Files that hold a model's weights in a save_pretrained folder (one of them, or a sharded index).
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
#: Files that hold a tokenizer (one of them).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def source_folder(path: str | Path, field_name: str = "pretrained_path") -> Path:
    """The model folder ``path`` names: the folder itself, or for a ``.gguf`` file its converted folder.

    A GGUF file is checked and, the first time, dequantized into a cached
    folder (:func:`~nip_like.lm.gguf.converted_folder`); a folder is checked
    to exist (:func:`~nip_like.lm.agent_folders.local_model_folder`).
    """
    if is_gguf(path):
        return converted_folder(path, field_name)
    return local_model_folder(path)


def check_model_folder(path: str | Path, field_name: str = "pretrained_path") -> Path:
    """``path`` if it looks like a ``save_pretrained`` folder of a causal LM, else a one-line :class:`ConfigError`.

    Checks that the folder exists, has a ``config.json`` of a model type
    transformers knows, weights and a tokenizer. Corrupt weights are found
    when they are loaded (:func:`build_lm`). A ``.gguf`` file stands for the
    folder it converts to (:func:`source_folder`), which is returned.

    Parameters
    ----------
    path : str or Path
        The folder.
    field_name : str
        The config field that named it, for the message.
    """
    folder = source_folder(path, field_name)
    if not (folder / "config.json").is_file():
        raise ConfigError(f"{field_name}: {folder} has no config.json, so it is not a save_pretrained model folder")
    try:
        json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except ValueError as error:  # json.JSONDecodeError, UnicodeDecodeError: say where, which transformers does not
        where = f"line {error.lineno} column {error.colno}: {error.msg}" if isinstance(error, json.JSONDecodeError) else "it is not UTF-8"
        raise ConfigError(f"{field_name}: {folder}/config.json is not JSON ({where})") from None
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except (ValueError, OSError, KeyError) as error:
        raise ConfigError(f"{field_name}: {folder}/config.json cannot be read: {_first_line(error)}") from error
    check_causal(config, f"{field_name}: {folder}")
    if not any((folder / name).is_file() for name in WEIGHT_FILES):
        raise ConfigError(f"{field_name}: {folder} has a config.json but no weights (one of {', '.join(WEIGHT_FILES)})")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(f"{field_name}: {folder} has no tokenizer (one of {', '.join(TOKENIZER_FILES)})")
    return folder


def check_causal(config, where: str) -> None:
    """Refuse, in one line, a model config that is not of a causal (decoder-only) language model.

    The ``architectures`` that ``save_pretrained`` records must name a class
    transformers maps to causal LM (``Qwen2ForCausalLM``, ``LlamaForCausalLM``,
    ``GPT2LMHeadModel``, ...); without them, the model type must have one.
    An encoder (``BertModel``, ``BertForMaskedLM``) or an encoder-decoder
    (``T5ForConditionalGeneration``) is refused.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    architectures = list(getattr(config, "architectures", None) or [])
    if getattr(config, "is_encoder_decoder", False) or (
        architectures and not causal.intersection(architectures)
    ) or (not architectures and config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        named = ", ".join(architectures) or f"model type {config.model_type}"
        raise ConfigError(
            f"{where} holds {named}, not a causal language model: agents need a decoder-only model such as "
            f"*ForCausalLM (Qwen2, Llama, GPT-2, ...)"
        )


def load_tokenizer(
    path: str | Path, field_name: str = "pretrained_path", chat_template: Optional[str] = None
) -> PreTrainedTokenizerBase:
    """The tokenizer of a model folder (checked by :func:`check_model_folder`), padding on the left.

    Parameters
    ----------
    path : str or Path
        The model folder (or ``.gguf`` file).
    field_name : str
        The config field that named it, for the messages.
    chat_template : str, optional
        A chat template to give it (an agent's ``chat_template``:
        :func:`~nip_like.lm.chat_templates.resolve_chat_template`); where the
        template's turn end is one token, that token becomes the eos.
    """
    from transformers import AutoTokenizer

    folder = check_model_folder(path, field_name)
    stamp = tuple((name, (folder / name).stat().st_size, (folder / name).stat().st_mtime_ns) for name in TOKENIZER_FILES if (folder / name).is_file())
    key = (str(folder.resolve()), stamp)
    if key not in _tokenizers:
        try:
            loaded = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        except Exception as error:  # noqa: BLE001 - any failure is one line for the user
            raise ConfigError(f"{field_name}: the tokenizer in {folder} cannot be loaded: {_first_line(error)}") from error
        if len(_tokenizers) >= 16:
            _tokenizers.clear()
        _tokenizers[key] = loaded
    tokenizer = clone_tokenizer(_tokenizers[key])
    tokenizer.padding_side = "left"
    if chat_template:
        apply_chat_template(tokenizer, resolve_chat_template(chat_template, _sibling(field_name, "chat_template")))
    return tokenizer


#: Tokenizers loaded in this process, by folder and the sizes and times of its tokenizer files (see :func:`clone_tokenizer`).
_tokenizers: dict[tuple, PreTrainedTokenizerBase] = {}


def clone_tokenizer(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """A copy of ``tokenizer`` whose settings (special tokens, template, padding side) change on their own.

    Loading a tokenizer of a 262,144-token vocabulary takes seconds, and a
    run asks for the same one many times (each agent's chat view, model and
    checks); a deep copy costs as much. The copy shares the fast tokenizer's
    Rust backend (its vocabulary and merges, which nothing here changes) and
    copies every Python container; a slow tokenizer is deep-copied.
    """
    from tokenizers import Tokenizer

    if not isinstance(getattr(tokenizer, "_tokenizer", None), Tokenizer):
        return copy.deepcopy(tokenizer)
    clone = copy.copy(tokenizer)
    clone.__dict__.update({name: copy.copy(value) for name, value in vars(tokenizer).items() if isinstance(value, (dict, list, set))})
    return clone


def template_stop_strings(path: str | Path, chat_template: Optional[str], field_name: str = "pretrained_path") -> list[str]:
    """The stop strings an agent needs for its ``chat_template`` on the tokenizer of ``path``.

    Empty without a template, or when the template's turn end is one token
    of the tokenizer (it is then the eos: :func:`~nip_like.lm.chat_templates.apply_chat_template`).
    """
    if not chat_template:
        return []
    template = resolve_chat_template(chat_template, _sibling(field_name, "chat_template"))
    if template.turn_end is None:
        return []
    tokenizer = load_tokenizer(path, field_name)
    return apply_chat_template(tokenizer, template)


def _sibling(field_name: str, name: str) -> str:
    """The config path of field ``name`` beside ``field_name`` (``scenario.agents.x.chat_template`` beside its ``pretrained_path``)."""
    return f"{field_name.rpartition('.')[0]}.{name}" if "." in field_name else name


def model_context(path: str | Path) -> Optional[int]:
    """The context length of the model in folder ``path`` (``max_position_embeddings``), None if it names none."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(check_model_folder(path), local_files_only=True).get_text_config()
    context = getattr(config, "max_position_embeddings", None)
    return int(context) if context else None


def architecture_context(architecture: str, field_name: str = "architecture") -> Optional[int]:
    """The default context length of a from-config model of ``architecture``; a one-line error for an unknown one."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.for_model(architecture)
    except ValueError as error:
        raise ConfigError(
            f"{field_name}: unknown architecture {architecture!r}; give a transformers model type such as llama, qwen2 or gpt2"
        ) from error
    context = getattr(config.get_text_config(), "max_position_embeddings", None)
    return int(context) if context else None


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def build_lm(
    config: LMAgentConfig, tokenizer: Optional[PreTrainedTokenizerBase] = None, base: Optional[PreTrainedModel] = None
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
    base : PreTrainedModel, optional
        A base model from :func:`build_base` that this agent shares with
        others (``share_base_with``): the agent's model is a module tree over
        the same weight tensors (:func:`sharing_copy`),
        nothing is loaded, and ``tokenizer`` must be given.

    Returns
    -------
    model : PreTrainedModel
        The causal LM, with the tokenizer's pad, bos and eos ids in its
        config and generation config, no dropout (:func:`disable_dropout`),
        gradient checkpointing and LoRA adapters as the config asks.
    tokenizer : PreTrainedTokenizerBase

    Raises
    ------
    ConfigError
        (a ``ValueError``) for a ``pretrained_path`` that is not an existing
        folder, an unknown architecture, sizes that do not fit, or a missing
        or mismatched tokenizer.
    """
    if base is None:
        model, tokenizer = build_base(config, tokenizer)
    else:
        if tokenizer is None:
            raise ConfigError("build_lm needs the base's tokenizer to build on a shared base")
        model = sharing_copy(base)
    if agent_option(config, "gradient_checkpointing", False):
        if hasattr(model, "activation_checkpointing_enable"):  # transformers 5.2x's name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = agent_option(config, "lora", None)
    if lora_enabled(lora) and agent_option(lora, "warm_start", "lora") == "lora":
        model = add_lora(model, lora)
    return model, tokenizer


def sharing_copy(model: nn.Module) -> nn.Module:
    """A new module tree of ``model`` whose parameters and buffers are ``model``'s own tensors (no weight is copied).

    Adding LoRA adapters or gradient checkpointing to the copy changes the
    copy's modules only; the weights stay one set of tensors in memory.
    """
    memo: dict[int, Any] = {id(tensor): tensor for tensor in model.parameters()}
    memo.update({id(tensor): tensor for tensor in model.buffers()})
    return copy.deepcopy(model, memo)


def build_base(
    config: LMAgentConfig, tokenizer: Optional[PreTrainedTokenizerBase] = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load (or build from config) an agent's causal LM as it is before gradient checkpointing and LoRA.

    The part of :func:`build_lm` that agents sharing a base do once; see
    :func:`build_lm` for the parameters and errors.
    """
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, agent_option(config, "dtype", "float32"))
    if config.pretrained_path is not None:
        folder = check_model_folder(config.pretrained_path)
        check_manifest(folder, "model folder")  # a folder nip_like wrote is compared with its checksums.json first
        folder_tokenizer = load_tokenizer(folder, chat_template=agent_option(config, "chat_template", None))
        if tokenizer is not None and tokenizer.get_vocab() != folder_tokenizer.get_vocab():
            raise ConfigError(f"the tokenizer given differs from the one in {folder}: leave it out to use the folder's")
        tokenizer = folder_tokenizer
        try:
            with quiet_progress():
                model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=dtype)
        except Exception as error:  # noqa: BLE001 - truncated or corrupt weights, an unknown class: one line
            raise ConfigError(f"pretrained_path: the model in {folder} cannot be loaded: {_first_line(error)}") from error
        vocab_size = model.config.get_text_config().vocab_size
        if len(tokenizer) > vocab_size:
            raise ConfigError(
                f"pretrained_path: the tokenizer in {folder} has {len(tokenizer)} tokens but the model only {vocab_size}: "
                f"they do not belong together"
            )
    else:
        if tokenizer is None:
            raise ConfigError("build_lm needs a tokenizer when no pretrained_path is given")
        model = AutoModelForCausalLM.from_config(_model_config(config, tokenizer), dtype=dtype)
    for settings in (model.config, model.generation_config):
        if settings is not None:
            if tokenizer.pad_token_id is not None:
                settings.pad_token_id = tokenizer.pad_token_id
            settings.bos_token_id = tokenizer.bos_token_id
            settings.eos_token_id = tokenizer.eos_token_id
    if tokenizer.pad_token_id is None:
        # Llama-style tokenizers without a pad token: pad with eos (masks never come from pad ids).
        tokenizer.pad_token = tokenizer.eos_token
    disable_dropout(model)
    return model, tokenizer


def agent_option(config: Any, name: str, default: Any = None) -> Any:
    """A field of an agent config (a dataclass, a DictConfig or a mapping) that older configs (or other schemas) may lack."""
    return getattr(config, name, default) if not hasattr(config, "get") else config.get(name, default)


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


def build_lm_policy(
    config: LMAgentConfig,
    tokenizer: Optional[PreTrainedTokenizerBase] = None,
    base: Optional[PreTrainedModel] = None,
    model: Optional[PreTrainedModel] = None,
) -> LMPolicy:
    """Make an agent's :class:`~nip_like.lm.policy.LMPolicy`, value head included.

    Parameters
    ----------
    config : LMAgentConfig
        The agent. With ``frozen_from`` (its ``pretrained_path`` then set to
        the folder it resolves to, :func:`~nip_like.lm.frozen.resolve`), every
        parameter is frozen. With a value head (``value_head``, or its
        default: yes unless frozen), a ``pretrained_path`` folder's
        ``value_head.pt`` (written by
        :func:`~nip_like.lm.agent_folders.save_agent`) is loaded if there is
        one; its ``shared_body`` must match the config's.
    tokenizer : PreTrainedTokenizerBase, optional
        As for :func:`build_lm`.
    base : PreTrainedModel, optional
        A base shared with other agents, as for :func:`build_lm`.
    model : PreTrainedModel, optional
        Another agent's model to play with (``share_policy_with``): nothing
        is built or loaded but the value head, and ``tokenizer`` must be
        given.

    Returns
    -------
    LMPolicy
        On the CPU; move it with ``.to(device)``.
    """
    if model is None:
        model, tokenizer = build_lm(config, tokenizer, base)
    elif tokenizer is None:
        raise ConfigError("build_lm_policy needs the tokenizer of the model it is given")
    lora = agent_option(config, "lora", None)
    frozen = agent_option(config, "frozen_from", None) is not None
    wanted = agent_option(config, "value_head", None)
    value_head = None
    if wanted or (wanted is None and not frozen):
        if config.pretrained_path is not None:
            value_head = load_value_head(config.pretrained_path, model)
        if value_head is not None and value_head.shared_body != config.shared_body:
            raise ConfigError(
                f"the value head in {config.pretrained_path} has shared_body={value_head.shared_body}, "
                f"the config asks for shared_body={config.shared_body}"
            )
        if value_head is None:
            value_head = LMValueHead.for_model(model, shared_body=config.shared_body)
    policy = LMPolicy(
        model,
        tokenizer,
        max_new_tokens=config.max_new_tokens,
        temperature=config.temperature,
        top_k=config.top_k,
        top_p=config.top_p,
        value_head=value_head,
        stop_strings=tuple(agent_option(config, "stop_strings", ()) or ()),
        max_tokens_per_micro_batch=agent_option(config, "max_tokens_per_micro_batch", None) or None,  # automatic: set by the trainer
        score_chunk_tokens=agent_option(config, "score_chunk_tokens", None),
        deferred_lora=lora if lora_enabled(lora) and agent_option(lora, "warm_start", "lora") == "full" else None,
        decoding=agent_option(config, "decoding", "auto"),
        sampling_dtype=agent_option(config, "sampling_dtype", "model"),
    )
    if frozen:  # a co-player from a finished run: nothing of it trains
        policy.requires_grad_(False)
    return policy


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
    from transformers import AutoConfig, AutoModelForCausalLM

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
