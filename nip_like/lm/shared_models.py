"""Agents that share a model: one frozen base with an adapter per agent, or one policy for several roles.

Two settings of an agent's config, each naming another agent of the game:

``share_base_with``
    The agent is built on that agent's base: the base is loaded once, and
    each agent of the group gets its own module tree over the *same* weight
    tensors (:func:`~nip_like.lm.models.sharing_copy`), to which its own adapters (and gradient
    checkpointing, if it asks) are added. The base weights are held once in
    memory; everything an agent runs (sampling, scoring in micro-batches,
    recomputation in the backward pass, its reference with adapters switched
    off) goes through its own tree, so no state says "which adapter is
    active", and a joint update whose backward pass runs through several
    agents' forwards is the one two separate copies give. A shared base stays
    frozen while the agents train, so every agent of a group trains LoRA
    adapters (``lora.r >= 1``), and the agents name the same model folder
    (or, built from config, the same architecture and sizes) in the same
    dtype. With ``lora.warm_start: full`` (on every agent of the group) the
    base is first fitted whole in the warm start, as one model playing every
    role of the group (the owner's fit takes every role's demonstrations,
    as ``share_policy_with`` does), and the adapters come after it, one set
    per agent on the fitted base.

``share_policy_with``
    The agent plays with that agent's model itself: one set of weights (full
    or LoRA) plays both roles, told apart by their prompts (each role's
    system prompt in the chat view), and one update trains it on both roles'
    tokens (the sum of their losses). Each role keeps its own value head,
    sampling settings and statistics: the objectives normalise advantages
    per agent, that is per role, and GRPO forms its groups per agent too.
    The model trains in the owner's optimiser group (its learning rate); the
    sharer's group holds its value head. The model fields of both configs
    (folder or sizes, ``lora``, ``dtype``, ``gradient_checkpointing``) must be
    equal.

:func:`check_shared_models` refuses anything else in one line before any
work.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from nip_like.errors import ConfigError
from nip_like.lm.lora import lora_enabled
from nip_like.lm.models import agent_option, build_base, build_lm_policy, clone_tokenizer

#: The fields that make a from-config base (with the same architecture, the same weights are drawn once).
SIZE_FIELDS = ("architecture", "hidden_size", "num_layers", "num_heads", "intermediate_size", "vocab_size")


def _warm_start(config: Any) -> str:
    """An agent's ``lora.warm_start`` (``lora`` when it sets none)."""
    return agent_option(agent_option(config, "lora"), "warm_start", "lora")


def with_shared_base(configs: Mapping[str, Any]) -> dict[str, Any]:
    """``configs`` with every agent after the first set to share the first one's base (``scenario.shared_base``).

    Frozen co-players and agents with a ``share_base_with`` or
    ``share_policy_with`` of their own are left as they are; so is a game of
    one agent.
    """
    names = list(configs)
    owner = next((name for name in names if not agent_option(configs[name], "frozen_from")), None)
    shared = {}
    for name, config in configs.items():
        free = not any(agent_option(config, field) for field in ("frozen_from", "share_base_with", "share_policy_with"))
        if name != owner and owner is not None and free:
            config = copy.deepcopy(config)
            config.share_base_with = owner
        shared[name] = config
    return shared


def base_owners(configs: Mapping[str, Any]) -> dict[str, str]:
    """Each agent's name -> the agent whose base weights it plays with (itself when it shares none)."""
    return {name: agent_option(config, "share_base_with") or agent_option(config, "share_policy_with") or name for name, config in configs.items()}


def policy_owners(configs: Mapping[str, Any]) -> dict[str, str]:
    """Each agent's name -> the agent whose model it plays with (``share_policy_with``; itself when none)."""
    return {name: agent_option(config, "share_policy_with") or name for name, config in configs.items()}


def warm_start_owners(configs: Mapping[str, Any]) -> dict[str, str]:
    """Each agent's name -> the agent whose model it plays in the warm start (itself when none).

    That of ``share_policy_with``, and of ``share_base_with`` when the base
    is fitted whole first (``lora.warm_start: full``).
    """
    owners = policy_owners(configs)
    for name, config in configs.items():
        base = agent_option(config, "share_base_with")
        if base and _warm_start(config) == "full":
            owners[name] = base
    return owners


def sharing_groups(configs: Mapping[str, Any]) -> dict[str, list[str]]:
    """The owner of each shared base -> every agent built on it, owner first (others are left out)."""
    groups: dict[str, list[str]] = {}
    for name, config in configs.items():
        owner = agent_option(config, "share_base_with")
        if owner:
            groups.setdefault(owner, [owner])
            groups[owner].append(name)
    return groups


def check_shared_models(agents: Mapping[str, tuple[str, Any]]) -> None:
    """Refuse, in one line, ``share_base_with`` and ``share_policy_with`` settings that cannot be honoured.

    Parameters
    ----------
    agents : mapping of str to (str, LMAgentConfig)
        Each agent of the game -> the config path its settings come from and
        its config.

    Raises
    ------
    ConfigError
        For a name that is not another agent of the game, a chain (the agent
        named shares another's model or base itself), both settings on one
        agent, a frozen co-player in a group, an agent of a shared base
        without LoRA adapters from the start, bases that differ in folder,
        sizes or dtype, or a shared policy whose model fields differ.
    """
    configs = {name: config for name, (_, config) in agents.items()}
    for name, (where, config) in agents.items():
        base, policy = agent_option(config, "share_base_with"), agent_option(config, "share_policy_with")
        if base and policy:
            raise ConfigError(f"{where}: share_base_with and share_policy_with do not go together; set one of them")
        for setting, owner in (("share_base_with", base), ("share_policy_with", policy)):
            if owner:
                _check_owner(agents, name, where, setting, owner)
        if base:
            _check_base(agents, name, where, base)
        if policy:
            difference = _model_difference(configs[name], configs[policy])
            if difference:
                raise ConfigError(
                    f"{where}.share_policy_with={policy}: the agents' model settings differ ({difference}); one model plays "
                    f"both roles, so its folder or sizes, lora, dtype and gradient_checkpointing must be the same"
                )


def _check_owner(agents: Mapping[str, tuple[str, Any]], name: str, where: str, setting: str, owner: str) -> None:
    """The agent named by ``setting`` exists, is another one, shares nothing itself, and neither is frozen."""
    field_name = f"{where}.{setting}={owner}"
    if owner == name:
        raise ConfigError(f"{field_name}: an agent cannot share with itself; name another agent of the game: {sorted(set(agents) - {name})}")
    if owner not in agents:
        raise ConfigError(f"{field_name} is not an agent of this game; allowed: {sorted(set(agents) - {name})}")
    owner_config = agents[owner][1]
    for other in ("share_base_with", "share_policy_with"):
        if agent_option(owner_config, other):
            raise ConfigError(f"{field_name}: {owner} shares with {agent_option(owner_config, other)} itself ({other}); name {agent_option(owner_config, other)} instead")
    for agent, config in ((name, agents[name][1]), (owner, owner_config)):
        if agent_option(config, "frozen_from"):
            raise ConfigError(f"{field_name}: agent {agent} is a frozen co-player (frozen_from), which shares nothing: load both from their folders")


def _check_base(agents: Mapping[str, tuple[str, Any]], name: str, where: str, owner: str) -> None:
    """Both agents train LoRA adapters, added at the same time, on the same base."""
    field_name = f"{where}.share_base_with={owner}"
    owner_where, owner_config = agents[owner]
    for agent, agent_where, agent_config in ((name, where, agents[name][1]), (owner, owner_where, owner_config)):
        if not lora_enabled(agent_option(agent_config, "lora")):
            raise ConfigError(
                f"{field_name}: a shared base stays frozen, so agent {agent} needs LoRA adapters: set {agent_where}.lora.r >= 1"
            )
    starts = {_warm_start(config) for config in (agents[name][1], owner_config)}
    checkpointing = {bool(agent_option(config, "gradient_checkpointing", False)) for config in (agents[name][1], owner_config)}
    if starts == {"full"} and len(checkpointing) > 1:
        raise ConfigError(
            f"{field_name}: a base fitted whole first is one model until the adapters come, so gradient_checkpointing must be "
            f"the same in {where} and {owner_where}"
        )
    if len(starts) > 1:
        raise ConfigError(
            f"{field_name}: the agents of a shared base add their adapters at the same time: set lora.warm_start to the "
            f"same value in {where} and {owner_where} (full: the base is fitted whole in the warm start first)"
        )
    difference = _base_difference(agents[name][1], owner_config)
    if difference:
        raise ConfigError(
            f"{field_name}: the agents' bases differ ({difference}); sharing needs the same pretrained_path "
            f"(or the same from-config sizes) and dtype"
        )


def _model_difference(config: Any, other: Any) -> Optional[str]:
    """What tells the two agents' models apart (base, adapters, checkpointing), None if nothing does."""
    difference = _base_difference(config, other)
    if difference:
        return difference
    for field_name in ("gradient_checkpointing",):
        if bool(agent_option(config, field_name, False)) != bool(agent_option(other, field_name, False)):
            return f"{field_name} {agent_option(config, field_name, False)} against {agent_option(other, field_name, False)}"
    lora, other_lora = _plain(agent_option(config, "lora")), _plain(agent_option(other, "lora"))
    if lora != other_lora:
        return f"lora {lora} against {other_lora}"
    return None


def _plain(options: Any) -> dict:
    """LoRA options as a plain dict (r 0 = none, whatever the rest)."""
    if options is None:
        return {"r": 0}
    fields = ("r", "alpha", "dropout", "target_modules", "warm_start")
    values = {name: agent_option(options, name) for name in fields}
    if not values["r"]:
        return {"r": 0}
    if values["target_modules"] is not None:
        values["target_modules"] = list(values["target_modules"])
    return values


def _base_difference(config: Any, other: Any) -> Optional[str]:
    """What tells the two agents' bases (and so their tokenizers) apart, None if they are the same."""
    path, other_path = agent_option(config, "pretrained_path"), agent_option(other, "pretrained_path")
    if (path is None) != (other_path is None):
        return f"pretrained_path {path} against {other_path}"
    if path is not None and Path(path).expanduser().resolve() != Path(other_path).expanduser().resolve():
        return f"pretrained_path {path} against {other_path}"
    if path is None:
        for field_name in SIZE_FIELDS:
            if agent_option(config, field_name) != agent_option(other, field_name):
                return f"{field_name} {agent_option(config, field_name)} against {agent_option(other, field_name)}"
    if agent_option(config, "dtype", "float32") != agent_option(other, "dtype", "float32"):
        return f"dtype {agent_option(config, 'dtype', 'float32')} against {agent_option(other, 'dtype', 'float32')}"
    return None


def build_policies(
    configs: Mapping[str, Any],
    tokenizers: Mapping[str, Any],
    build_policy: Optional[Callable[..., Any]] = None,
) -> dict[str, Any]:
    """Each agent's :class:`~nip_like.lm.policy.LMPolicy`, in the order of ``configs``, with its sharing applied.

    Parameters
    ----------
    configs : mapping of str to LMAgentConfig
        The agents (checked by :func:`check_shared_models`).
    tokenizers : mapping of str to PreTrainedTokenizerBase or None
        The tokenizer to give each agent's builder (None: its folder's).
    build_policy : callable, optional
        ``build_policy(config, tokenizer, base=None, model=None)``; default
        :func:`~nip_like.lm.models.build_lm_policy`.

    Returns
    -------
    dict of str to LMPolicy
        A policy built on a shared base has ``base_owner`` set to the agent
        whose config the base was loaded from; one that plays another agent's
        model has ``policy_owner`` set to that agent.
    """
    build_policy = build_policy or build_lm_policy
    shared = set(sharing_groups(configs))
    sharers = {name: owner for name, owner in policy_owners(configs).items() if owner != name}
    bases: dict[str, tuple[Any, Any]] = {}
    policies = {}
    # Owners first: a sharer plays its owner's model (and, in a full warm start, its owner's base).
    order = [name for name in configs if name in shared] + [name for name in configs if name not in shared]
    for name in order:
        config = configs[name]
        if name in sharers:
            continue
        owner = agent_option(config, "share_base_with") or name
        if owner not in shared:
            policies[name] = build_policy(config, tokenizers.get(name))
            continue
        if _warm_start(config) == "full":
            # Fitted whole in the warm start first: the group plays the owner's model until its adapters come.
            if owner == name:
                policy = build_policy(config, tokenizers.get(name))
            else:
                played = policies[owner]
                policy = build_policy(config, clone_tokenizer(played.tokenizer), model=played.model)
            policy.base_owner = owner
            policies[name] = policy
            continue
        if owner not in bases:
            bases[owner] = build_base(configs[owner], tokenizers.get(owner))
        base, tokenizer = bases[owner]
        policy = build_policy(config, clone_tokenizer(tokenizer), base)
        policy.base_owner = owner
        policies[name] = policy
    for name, owner in sharers.items():
        played = policies[owner]
        policy = build_policy(configs[name], clone_tokenizer(played.tokenizer), model=played.model)
        policy.policy_owner = owner
        policy.base_owner = played.base_owner
        policies[name] = policy
    return {name: policies[name] for name in configs}
