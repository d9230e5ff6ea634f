"""Agents that share one frozen base model, each with LoRA adapters and a value head of its own.

An agent whose config names another in ``share_base_with`` is built on that
agent's base: the base is loaded once, and each agent of the group gets its
own module tree over the *same* weight tensors (:func:`sharing_copy`), to
which its own adapters (and gradient checkpointing, if it asks) are added.
The base weights are held once in memory; everything an agent runs (sampling,
scoring in micro-batches, recomputation in the backward pass, its reference
with adapters switched off) goes through its own tree, so no state says
"which adapter is active", and a joint update whose backward pass runs
through several agents' forwards is the one two separate copies give.

A shared base must stay frozen, so every agent of a group trains LoRA
adapters from the start (``lora.r >= 1``, ``lora.warm_start: lora``), and the
agents name the same model folder (or, built from config, the same
architecture and sizes) in the same dtype. :func:`check_shared_bases`
refuses anything else in one line before any work.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from torch import nn

from nip_like.errors import ConfigError

#: The fields that make a from-config base (with the same architecture, the same weights are drawn once).
SIZE_FIELDS = ("architecture", "hidden_size", "num_layers", "num_heads", "intermediate_size", "vocab_size")


def _get(config: Any, name: str, default: Any = None) -> Any:
    return config.get(name, default) if hasattr(config, "get") else getattr(config, name, default)


def sharing_copy(model: nn.Module) -> nn.Module:
    """A new module tree of ``model`` whose parameters and buffers are ``model``'s own tensors (no weight is copied).

    Adding LoRA adapters or gradient checkpointing to the copy changes the
    copy's modules only; the weights stay one set of tensors in memory.
    """
    memo: dict[int, Any] = {id(tensor): tensor for tensor in model.parameters()}
    memo.update({id(tensor): tensor for tensor in model.buffers()})
    return copy.deepcopy(model, memo)


def base_owners(configs: Mapping[str, Any]) -> dict[str, str]:
    """Each agent's name -> the agent whose base it is built on (itself when it shares none)."""
    return {name: _get(config, "share_base_with") or name for name, config in configs.items()}


def sharing_groups(configs: Mapping[str, Any]) -> dict[str, list[str]]:
    """The owner of each shared base -> every agent on it, owner first (agents that share nothing are left out)."""
    groups: dict[str, list[str]] = {}
    for name, owner in base_owners(configs).items():
        if owner != name:
            groups.setdefault(owner, [owner])
            groups[owner].append(name)
    return groups


def check_shared_bases(agents: Mapping[str, tuple[str, Any]]) -> None:
    """Refuse, in one line, ``share_base_with`` settings that cannot share one frozen base.

    Parameters
    ----------
    agents : mapping of str to (str, LMAgentConfig)
        Each agent of the game -> the config path its settings come from and
        its config.

    Raises
    ------
    ConfigError
        For a name that is not another agent of the game, a chain (the agent
        named shares another's base itself), an agent of a group without
        LoRA adapters from the start, or bases that differ in folder, sizes
        or dtype.
    """
    configs = {name: config for name, (_, config) in agents.items()}
    for name, (where, config) in agents.items():
        owner = _get(config, "share_base_with")
        if not owner:
            continue
        field_name = f"{where}.share_base_with={owner}"
        if owner == name:
            raise ConfigError(f"{field_name}: an agent cannot share its own base; name another agent of the game: {sorted(set(agents) - {name})}")
        if owner not in agents:
            raise ConfigError(f"{field_name} is not an agent of this game; allowed: {sorted(set(agents) - {name})}")
        owner_where, owner_config = agents[owner]
        if _get(owner_config, "share_base_with"):
            raise ConfigError(
                f"{field_name}: {owner} shares the base of {_get(owner_config, 'share_base_with')} itself; "
                f"name {_get(owner_config, 'share_base_with')} instead"
            )
        for agent, agent_where, agent_config in ((name, where, config), (owner, owner_where, owner_config)):
            lora = _get(agent_config, "lora")
            if int(_get(lora, "r", 0) or 0) < 1:
                raise ConfigError(
                    f"{field_name}: a shared base stays frozen, so agent {agent} needs LoRA adapters: set {agent_where}.lora.r >= 1"
                )
            if _get(lora, "warm_start", "lora") != "lora":
                raise ConfigError(
                    f"{field_name}: {agent_where}.lora.warm_start=full fits every weight of the base, which the agents share: "
                    f"set it to lora"
                )
        difference = _base_difference(configs[name], configs[owner])
        if difference:
            raise ConfigError(
                f"{field_name}: the agents' bases differ ({difference}); sharing needs the same pretrained_path "
                f"(or the same from-config sizes) and dtype"
            )


def _base_difference(config: Any, other: Any) -> Optional[str]:
    """What tells the two agents' bases (and so their tokenizers) apart, None if they are the same."""
    path, other_path = _get(config, "pretrained_path"), _get(other, "pretrained_path")
    if (path is None) != (other_path is None):
        return f"pretrained_path {path} against {other_path}"
    if path is not None and Path(path).expanduser().resolve() != Path(other_path).expanduser().resolve():
        return f"pretrained_path {path} against {other_path}"
    if path is None:
        for field_name in SIZE_FIELDS:
            if _get(config, field_name) != _get(other, field_name):
                return f"{field_name} {_get(config, field_name)} against {_get(other, field_name)}"
    if _get(config, "dtype", "float32") != _get(other, "dtype", "float32"):
        return f"dtype {_get(config, 'dtype', 'float32')} against {_get(other, 'dtype', 'float32')}"
    return None


def build_policies(
    configs: Mapping[str, Any],
    tokenizers: Mapping[str, Any],
    build_policy: Optional[Callable[..., Any]] = None,
) -> dict[str, Any]:
    """Each agent's :class:`~nip_like.lm.policy.LMPolicy`, in the order of ``configs``, agents of a group on one base.

    Parameters
    ----------
    configs : mapping of str to LMAgentConfig
        The agents (checked by :func:`check_shared_bases`).
    tokenizers : mapping of str to PreTrainedTokenizerBase or None
        The tokenizer to give each agent's builder (None: its folder's).
    build_policy : callable, optional
        ``build_policy(config, tokenizer, base)``; default
        :func:`~nip_like.lm.models.build_lm_policy`.

    Returns
    -------
    dict of str to LMPolicy
        A policy built on a shared base has ``base_owner`` set to the agent
        whose config the base was loaded from.
    """
    from nip_like.lm.models import build_base, build_lm_policy

    build_policy = build_policy or build_lm_policy
    owners = base_owners(configs)
    shared = set(sharing_groups(configs))
    bases: dict[str, tuple[Any, Any]] = {}
    policies = {}
    for name, config in configs.items():
        owner = owners[name]
        if owner not in shared:
            policies[name] = build_policy(config, tokenizers.get(name))
            continue
        if owner not in bases:
            bases[owner] = build_base(configs[owner], tokenizers.get(owner))
        base, tokenizer = bases[owner]
        policy = build_policy(config, copy.deepcopy(tokenizer), base)
        policy.base_owner = owner
        policies[name] = policy
    return policies
