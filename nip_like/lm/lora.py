"""LoRA adapters for language-model agents, through ``peft``.

An agent with ``lora`` set trains low-rank adapters on chosen linear layers
and nothing else of its model (its value head, if any, trains too). Its
reference policy, for KL penalties and DPO, is the same model with the
adapters switched off (``disable_adapter``), so no second copy of the weights
is held. Its Hugging Face folder is the adapter folder (``adapter_config.json``
and ``adapter_model.safetensors``), loaded with ``PeftModel.from_pretrained``
over the base model; ``python -m nip_like.export`` merges it into a standalone
folder.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

from torch import nn

from nip_like.allowed import checked
from nip_like.dependency_warnings import dependency_warnings_once
from nip_like.errors import ConfigError


@dataclass
class LoraOptions:
    """LoRA adapters of one agent (``scenario.default_agent.lora`` or ``scenario.agents.<name>.lora``)."""

    r: int = checked(0, ge=0)  # rank of each adapter; 0 = no adapters (full fine-tuning of every weight)
    alpha: float = checked(16.0, gt=0)  # scale: the update is alpha / r times the low-rank product
    dropout: float = checked(0.0, ge=0, lt=1)  # dropout on the adapters' input (non-zero: PPO ratios start away from 1)
    target_modules: Optional[list[str]] = None  # names (or name suffixes) of the linear layers to adapt; null = peft's default for the architecture, ["all-linear"] = every linear layer but the output
    warm_start: str = checked("lora", choices=("lora", "full"))  # lora: the warm start trains the adapters only | full: it fits every weight, adapters come after it (the KL reference is then the warm-started model)


def add_lora(model: nn.Module, options) -> nn.Module:
    """Wrap ``model`` in a ``peft`` LoRA model: only the adapters require gradients.

    Parameters
    ----------
    model : PreTrainedModel
        A causal LM.
    options : LoraOptions or a mapping with its fields
        The adapters.

    Returns
    -------
    peft.PeftModel

    Raises
    ------
    ConfigError
        If the target modules match no layer of the model, or the
        architecture has no default targets and none are given.
    """
    from peft import LoraConfig, get_peft_model
    from transformers.pytorch_utils import Conv1D

    get = options.get if hasattr(options, "get") else lambda name, default=None: getattr(options, name, default)
    if int(get("r", 0)) < 1:
        raise ConfigError(f"lora.r must be at least 1 to add adapters, got {get('r', 0)}")
    targets = get("target_modules", None)
    targets = list(targets) if targets is not None else None
    if targets == ["all-linear"]:
        targets = "all-linear"
    config = LoraConfig(
        r=int(get("r", 8)),
        lora_alpha=float(get("alpha", 16.0)),
        lora_dropout=float(get("dropout", 0.0)),
        target_modules=targets,
        # GPT-2's projections are transformers' Conv1D, whose weight is stored (in, out): peft needs to be told.
        fan_in_fan_out=any(isinstance(module, Conv1D) for module in model.modules()),
        task_type="CAUSAL_LM",
    )
    try:
        with dependency_warnings_once():
            return get_peft_model(model, config)
    except ValueError as error:
        layers = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, nn.Linear)})
        raise ConfigError(
            f"lora.target_modules={targets} does not fit the {model.config.model_type} model: "
            f"{str(error).splitlines()[0]} (its linear layers: {', '.join(layers)})"
        ) from error


def lora_enabled(options) -> bool:
    """Whether an agent's ``lora`` options ask for adapters (``r`` at least 1)."""
    if options is None:
        return False
    return int(options.get("r", 0) if hasattr(options, "get") else getattr(options, "r", 0)) > 0


def has_lora(model: nn.Module) -> bool:
    """Whether ``model`` is a ``peft`` model with adapters."""
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


@contextmanager
def adapters_disabled(models: Iterable[nn.Module]) -> Iterator[None]:
    """Run the block with the adapters of every LoRA model in ``models`` switched off (others unchanged)."""
    with ExitStack() as stack:
        for model in models:
            if has_lora(model):
                stack.enter_context(model.disable_adapter())
        yield


def merged_model(model: nn.Module) -> nn.Module:
    """A standalone model: a LoRA model's adapters merged into a copy of its weights (others returned as they are)."""
    import copy

    if not has_lora(model):
        return model
    return copy.deepcopy(model).merge_and_unload()
