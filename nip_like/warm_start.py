"""Supervised fitting of an agent's policy to a scenario's labels, and its on-disk cache.

Used by the solo-agent trainer (the supervised baseline) and, with
``trainer.pretrain.agents``, to pretrain agents' networks before RL. A
pretrained agent is cached under a key made of everything that determines it
(scenario and protocol config, agent sizes, the pretraining options and the
seed), so a sweep that pretrains the same agent many times fits it once.
"""

from __future__ import annotations

import copy
import hashlib
import json
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from tensordict import TensorDictBase
from tqdm.auto import tqdm

from nip_like import cache_record
from nip_like.agent_modules import AgentModules, PerAgent
from nip_like.keys import LOGITS_KEY
from nip_like.checkpoint import derive_seed, load_checked, save_atomic
from nip_like.config import without_entries, without_locations
from nip_like.errors import CheckpointError, ConfigError
from nip_like.distributions import masked_log_softmax
from nip_like.interrupts import stop_point
from nip_like.lm.demonstration_fit import demonstration_loss, held_out_scores, sync_value_body
from nip_like.scenarios.base import Demonstrating, Labelled, code_key
from nip_like.optimizers import make_optimizer
from nip_like.supervised import StepLoss, supervised_epoch, warmup_schedule

#: Entries of a scenario's supervised data besides the agents' observations.
TARGET_KEY = "target_action"
TARGET_MASK_KEY = "target_mask"


def decision_log_probs(agents: AgentModules, agent_index: int, batch: TensorDictBase) -> torch.Tensor:
    """Log-probabilities of one agent over the target actions of ``batch``, ``(batch, num_actions)``."""
    logits = agents.policy.get_dist_params(batch.clone(False)).get(LOGITS_KEY)
    return masked_log_softmax(logits[:, agent_index], batch.get(TARGET_MASK_KEY))


def decision_loss(agents: AgentModules, agent_index: int) -> StepLoss:
    """The step loss of a fit to target decisions: cross-entropy of the agent's log-probability of the target.

    For :func:`~nip_like.supervised.supervised_epoch`; a minibatch holds
    ``"target_action"`` among ``"target_mask"``; the accuracy is whether the
    most likely action is the target.
    """

    def step_loss(batch: TensorDictBase) -> tuple[torch.Tensor, torch.Tensor]:
        log_probs = decision_log_probs(agents, agent_index, batch)
        target = batch.get(TARGET_KEY)
        return F.nll_loss(log_probs, target), log_probs.argmax(-1) == target

    return step_loss


def speaks(scenario: Demonstrating | Labelled) -> bool:
    """Whether the scenario demonstrates each agent's play (:class:`~nip_like.scenarios.base.Demonstrating`)
    rather than giving one set of labels (:class:`~nip_like.scenarios.base.Labelled`)."""
    return isinstance(scenario, Demonstrating)


#: The entry that marks token demonstrations (a language model's prompt and message) rather than decisions.
PROMPT_KEY = "prompt_ids"


def is_token_data(data: TensorDictBase) -> bool:
    """Whether ``data`` holds token demonstrations (prompts and messages) rather than decision datapoints."""
    return PROMPT_KEY in data.keys()


def split_data(scenario, split: str, seed: int, device: torch.device | str):
    """What agents are fitted to on ``split``, on ``device``.

    Each agent's demonstrations (a dict by agent name) for a scenario whose
    agents speak, else the scenario's supervised data (one TensorDict for
    every agent); :func:`agent_data` picks one agent's part.
    """
    if speaks(scenario):
        return {name: data.to(device) for name, data in scenario.demonstrations(split, seed=seed).items()}
    return scenario.supervised_data(split).to(device)


def agent_data(scenario, loaded, agent: str, user: str) -> TensorDictBase:
    """``agent``'s part of :func:`split_data`'s result; ``user`` names the option that chose the agent."""
    if not speaks(scenario):
        return loaded
    if agent not in loaded:
        raise ConfigError(
            f"{user}: {agent!r} has no demonstrations in scenario {scenario.config.name!r}; "
            f"those with some are {sorted(loaded)}"
        )
    return loaded[agent]


def role_data(scenario, loaded, agent: str, user: str) -> TensorDictBase:
    """:func:`agent_data` of ``agent`` and of every agent that plays its model in the warm start, in one batch.

    Those are the agents with ``share_policy_with: <agent>``, and with
    ``share_base_with: <agent>`` when the base is fitted whole first
    (``lora.warm_start: full``).

    One model playing several roles is fitted to every role's demonstrations
    at once (each told apart by its prompt); roles without demonstrations add
    nothing.
    """
    data = agent_data(scenario, loaded, agent, user)
    sharers = [name for name, owner in getattr(scenario, "warm_start_owners", dict)().items() if owner == agent and name != agent]
    parts = [loaded[name] for name in sharers if speaks(scenario) and name in loaded]
    return torch.cat([data, *parts]) if parts else data


def fit_loss(scenario, agents: AgentModules, agent: str, data: TensorDictBase) -> StepLoss:
    """The step loss that fits ``agent`` to its :func:`agent_data` ``data``; the agent's network in train mode.

    Token demonstrations (:func:`is_token_data`) are fitted token by token
    (:func:`~nip_like.lm.demonstration_fit.demonstration_loss`; accuracy: the share of
    demonstrations reproduced); decision datapoints by the agent's
    log-probability of the target (:func:`decision_loss`). An epoch is
    :func:`~nip_like.supervised.supervised_epoch` with it.
    """
    network = policy_network(agents, agent)
    network.train()
    if is_token_data(data):
        return demonstration_loss(network)
    return decision_loss(agents, scenario.agent_names.index(agent))


@torch.no_grad()
def predicted_decisions(agents: AgentModules, agent_index: int, data: TensorDictBase) -> torch.Tensor:
    """``(E,)`` the most likely target action of one agent on each datapoint of ``data``, in chunks."""
    decisions = []
    for chunk in data.split(1024):
        stop_point("the scoring of held-out data")
        decisions.append(decision_log_probs(agents, agent_index, chunk).argmax(-1))
    return torch.cat(decisions)


def held_out_accuracy(scenario, agents: AgentModules, agent: str, data: TensorDictBase) -> float:
    """``agent``'s accuracy on held-out :func:`agent_data`: decisions right, or demonstrations reproduced greedily."""
    network = policy_network(agents, agent)
    network.eval()
    if is_token_data(data):
        return held_out_scores(network, data)[1]
    predicted = predicted_decisions(agents, scenario.agent_names.index(agent), data)
    return (predicted == data.get(TARGET_KEY)).float().mean().item()


def without_deferred_adapters(value: Any) -> Any:
    """``value`` with every ``lora`` entry left out that cannot change a warm start, recursively.

    Adapters that are off (``r: 0``) or added after the warm start
    (``warm_start: full``) leave the warm-started weights as they are without
    them, so a LoRA run and a full fine-tuning run of the same agents share
    their warm start.
    """
    return without_entries(
        value, lambda key, item: key == "lora" and isinstance(item, dict) and (not item.get("r") or item.get("warm_start") == "full")
    )


def without_samplers(value: Any) -> Any:
    """``value`` without the LM agents' ``sampler`` entries, recursively: where messages are sampled in the game never changes a warm start."""
    return without_entries(value, lambda key, item: key == "sampler")


def pretrain_key(config: DictConfig, agent: str, scenario=None) -> dict[str, Any]:
    """Everything that determines a pretrained agent (hashed into its cache file name).

    Besides the config and the seed, the scenario's ``pretrain_data_version``
    (:attr:`~nip_like.scenarios.base.Demonstrating.pretrain_data_version`; None
    without a scenario): a scenario bumps it when its labels or demonstrations
    change, so that agents fitted to the old ones are not reused. A scenario
    class of the user's own adds ``"code"``, its
    :func:`~nip_like.scenarios.base.code_key` (its qualified name and a hash of
    its source, or its ``code_version``), so that editing its demonstrations
    never loads a fit to the old ones; a built-in scenario's key has no such entry.
    """
    code = code_key(type(scenario)) if scenario is not None else None
    return {
        **({"code": code} if code is not None else {}),
        "data_version": scenario.pretrain_data_version if scenario is not None else None,
        "scenario": without_samplers(without_deferred_adapters(without_locations(OmegaConf.to_container(config.scenario, resolve=True)))),
        "protocol": without_locations(OmegaConf.to_container(config.protocol, resolve=True)),
        "pretrain": {
            **{
                name: value
                for name, value in without_locations(OmegaConf.to_container(config.trainer.pretrain, resolve=True)).items()
                if name not in ("agents", "agent_epochs", "agent_lr", "agent_restarts")
            },
            # This agent's own number of epochs, learning rate and restarts, not the others'.
            "epochs": int(config.trainer.pretrain.agent_epochs.get(agent, config.trainer.pretrain.epochs)),
            "lr": float(config.trainer.pretrain.agent_lr.get(agent, config.trainer.pretrain.lr)),
            "restarts": agent_restarts(config.trainer.pretrain, agent),
        },
        "agent": agent,
        "seed": int(config.seed),
    }


def agent_restarts(options: Any, agent: str) -> int:
    """How many fits from fresh weights ``agent``'s warm start makes (``agent_restarts``, else ``restarts``)."""
    return int(options.get("agent_restarts", {}).get(agent, options.restarts))


def policy_network(agents: AgentModules, agent: str) -> torch.nn.Module:
    """The policy network of ``agent`` inside the per-agent policy (:class:`~nip_like.agent_modules.PerAgent`)."""
    for module in agents.policy.modules():
        if isinstance(module, PerAgent):
            return module.networks[agent]
    raise ConfigError("pretraining needs per-agent policy networks (nip_like.agent_modules.PerAgent)")


def _copy_body_to_value(agents: AgentModules, agent: str) -> None:
    """Start a separate value body from the pretrained policy body (if the agent has one)."""
    policy = policy_network(agents, agent)
    for module in agents.value.modules():
        if isinstance(module, PerAgent):
            value = module.networks[agent]
            body_p, body_v = getattr(policy, "body", None), getattr(value, "body", None)
            if body_p is not None and body_v is not None and body_p is not body_v:
                body_v.load_state_dict(body_p.state_dict())


def _epochs(config: DictConfig, agent: str) -> tqdm:
    """The pretraining epochs of ``agent`` (one in a test run), with a progress bar when ``run.progress_bar`` is on."""
    options = config.trainer.pretrain
    epochs = 1 if config.run.test_run else int(options.agent_epochs.get(agent, options.epochs))
    return tqdm(
        range(epochs),
        desc=f"Warm start of {agent}",
        unit="epoch",
        disable=not bool(config.run.progress_bar),
        leave=False,
    )


@dataclass
class Fit:
    """One fit of an agent: its weights and how good they are.

    ``score`` picks among restarts: the held-out accuracy with ``keep_best``,
    else the last epoch's train accuracy. ``state`` holds the fit's weights
    when the network no longer does (the best epoch with ``keep_best``, or an
    earlier restart); None while the network's own weights are the fit.
    """

    score: float
    state: Optional[dict]
    train_accuracy: float
    val_accuracy: Optional[float]
    fit_seconds: float = 0.0
    held_out_seconds: float = 0.0


def _fit(
    config: DictConfig,
    scenario,
    agents: AgentModules,
    agent: str,
    train: TensorDictBase,
    held_out: Optional[TensorDictBase],
    restart: int,
) -> Fit:
    """Fit ``agent`` from its current weights for the configured epochs; with ``held_out``, keep its best epoch."""
    options = config.trainer.pretrain
    network = policy_network(agents, agent)
    # PyTorch's default implementation, as the warm start has always had (cached fits stay valid).
    optimizer = make_optimizer("adam", network.parameters(), float(options.agent_lr.get(agent, options.lr)), fast=False)
    scheduler = warmup_schedule(optimizer, int(options.warmup_steps))
    # The first fit keeps the data order it always had; a restart draws its own.
    seed = int(config.seed) if restart == 0 else derive_seed(int(config.seed), f"pretrain/{agent}/order/{restart}")
    generator = torch.Generator().manual_seed(seed)
    best: Optional[Fit] = None
    accuracy, fit_seconds, held_out_seconds = 0.0, 0.0, 0.0
    phase = f"the warm start of {agent}"
    for _ in _epochs(config, agent):
        stop_point(phase)
        started = time.perf_counter()
        _, accuracy, _ = supervised_epoch(
            train, fit_loss(scenario, agents, agent, train), optimizer, options.minibatch_size, generator,
            options.max_grad_norm, scheduler, phase,
        )
        fit_seconds += time.perf_counter() - started
        if held_out is not None:
            started = time.perf_counter()
            score = held_out_accuracy(scenario, agents, agent, held_out)
            if best is None or score > best.score:
                best = Fit(score, copy.deepcopy(network.state_dict()), accuracy, score)
            held_out_seconds += time.perf_counter() - started
    if best is None:
        best = Fit(accuracy, None, accuracy, None)
    best.fit_seconds, best.held_out_seconds = fit_seconds, held_out_seconds
    return best


def fresh_weights(scenario, agent: str, seed: int) -> dict:
    """The policy weights of ``agent`` as the scenario initialises them under ``seed`` (global generators untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return policy_network(scenario.make_agents(), agent).state_dict()


def restart_from(network: torch.nn.Module, state: dict) -> None:
    """Load fresh weights into ``network`` for a restart; a base it shares with other agents stays as it is.

    A shared base (``share_base_with``) is frozen and also other agents'
    weights: a restart draws new adapters and a new value head only.
    """
    if getattr(network, "base_owner", None) is None:
        network.load_state_dict(state)
        return
    frozen = {name for name, param in network.named_parameters() if not param.requires_grad}
    missing, unexpected = network.load_state_dict({key: value for key, value in state.items() if key not in frozen}, strict=False)
    if set(missing) - frozen or unexpected:
        raise CheckpointError(f"fresh weights do not fit the agent: missing {sorted(set(missing) - frozen)[:3]}, unexpected {unexpected[:3]}")


#: In ``trainer.pretrain.agents``: every agent the scenario has demonstrations or labels for.
ALL_AGENTS = "*"


def pretrained_agent_names(scenario, requested: list[str]) -> list[str]:
    """``trainer.pretrain.agents`` with :data:`ALL_AGENTS` expanded, in the protocol's order.

    ``"*"`` stands for every agent of the protocol, or, for a scenario whose
    agents speak, every agent that has demonstrations (a prover arguing for
    *reject* in the duplicates game has none); frozen co-players
    (``frozen_from``) and agents that play another's model
    (``share_policy_with``: the owner's warm start fits the model on every
    role's demonstrations, :func:`role_data`) never.
    """
    frozen = set(getattr(scenario, "frozen_agents", dict)())
    named = sorted(frozen & set(requested))
    if named:
        raise ConfigError(
            f"trainer.pretrain.agents names {named}, frozen co-players (frozen_from) that train nothing: leave them out"
        )
    # An agent that plays another's model (share_policy_with): the owner's warm start fits it on every role (role_data).
    sharers = {name for name, owner in getattr(scenario, "warm_start_owners", dict)().items() if owner != name}
    named = sorted(sharers & set(requested))
    if named:
        raise ConfigError(
            f"trainer.pretrain.agents names {named}, which play another agent's model in the warm start (share_policy_with, "
            f"or share_base_with with lora.warm_start=full): name that agent instead, whose warm start fits the model on "
            f"every role's demonstrations"
        )
    if ALL_AGENTS not in requested:
        return requested
    names = [name for name in scenario.agent_names if name not in frozen and name not in sharers]
    if speaks(scenario):
        names = [name for name in names if name in scenario.demonstration_agents()]
    return list(dict.fromkeys([*names, *(name for name in requested if name != ALL_AGENTS)]))


def pretrain_agents(config: DictConfig, scenario, agents: AgentModules, device: torch.device) -> dict[str, float]:
    """Fit each agent of ``trainer.pretrain.agents`` to the labels, or load it from the cache.

    The scenario is :class:`~nip_like.scenarios.base.Demonstrating` or
    :class:`~nip_like.scenarios.base.Labelled` (the trainer requires it when
    the option is set, :meth:`~nip_like.trainers.rl.TensorDictRlTrainer.requirements`).

    A scenario with ``demonstrations`` (agents that send messages) fine-tunes
    each agent on its demonstrated messages
    (:func:`~nip_like.lm.demonstration_fit.demonstration_loss`); otherwise the
    agent's decisions are fitted to ``supervised_data`` (:func:`decision_loss`;
    each epoch :func:`~nip_like.supervised.supervised_epoch` with :func:`fit_loss`).

    Each cache file read or written is recorded for the run in progress
    (:func:`nip_like.cache_record.record`, kind ``warm start``); a test run's
    fit, never cached, is not.

    Returns
    -------
    dict
        ``pretrain/<agent>/train_accuracy`` and ``pretrain/<agent>/from_cache`` per agent, and
        ``timers/pretrain``: the seconds the warm start took (making the data, fitting, or loading);
        for a warm start made in this run, also the seconds of its parts: ``timers/pretrain/data``
        (the demonstrations or labels of both splits), ``timers/pretrain/<agent>/fit`` (the
        optimiser's epochs) and ``timers/pretrain/<agent>/held_out`` (scoring every epoch on the
        validation split for ``keep_best``).
    """
    started = time.perf_counter()
    options = config.trainer.pretrain
    names = pretrained_agent_names(scenario, list(options.agents))
    unknown = sorted(set(names) - set(scenario.agent_names))
    if unknown:
        raise ConfigError(
            f"trainer.pretrain.agents names {unknown}; the protocol's agents are {list(scenario.agent_names)}"
        )
    if options.epochs < 1:
        raise ConfigError(f"trainer.pretrain.epochs must be at least 1, got {options.epochs}")
    for field_name in ("agent_epochs", "agent_lr", "agent_restarts"):  # their values' ranges are checked with the config
        for agent in options[field_name]:
            if agent not in scenario.agent_names:
                raise ConfigError(
                    f"trainer.pretrain.{field_name} names {agent}; the protocol's agents are {list(scenario.agent_names)}"
                )
    metrics: dict[str, float] = {}
    loaded: dict[str, Any] = {"train": None, "val": None}  # each split's data, read once for every agent
    for agent in names:
        key = pretrain_key(config, agent, scenario)
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        path = Path(options.cache_dir).expanduser() / f"{agent}_{digest}.pt"
        network = policy_network(agents, agent)
        cached = None
        if path.is_file():
            try:
                cached = load_checked(path, digest, what="pretrained-agent cache file")
                if cached.get("key") != key:
                    raise CheckpointError(f"{path} was made for other settings")
            except CheckpointError as error:
                warnings.warn(f"rebuilding the pretrained {agent}: {error}", stacklevel=2)
                cached = None
        if cached is None:
            data_started = time.perf_counter()
            if loaded["train"] is None:
                loaded["train"] = split_data(scenario, "train", int(config.seed), device)
            train = role_data(scenario, loaded["train"], agent, "trainer.pretrain.agents")
            if options.keep_best and loaded["val"] is None:
                loaded["val"] = split_data(scenario, "val", int(config.seed), device)
            metrics["timers/pretrain/data"] = metrics.get("timers/pretrain/data", 0.0) + time.perf_counter() - data_started
            held_out = role_data(scenario, loaded["val"], agent, "trainer.pretrain.agents") if options.keep_best else None
            restarts = agent_restarts(options, agent)
            kept, chosen, scores = None, 0, []
            for restart in range(restarts):
                if restart > 0:
                    seed = derive_seed(int(config.seed), f"pretrain/{agent}/{restart}")
                    restart_from(network, fresh_weights(scenario, agent, seed))
                fit = _fit(config, scenario, agents, agent, train, held_out, restart)
                metrics[f"timers/pretrain/{agent}/fit"] = metrics.get(f"timers/pretrain/{agent}/fit", 0.0) + fit.fit_seconds
                metrics[f"timers/pretrain/{agent}/held_out"] = (
                    metrics.get(f"timers/pretrain/{agent}/held_out", 0.0) + fit.held_out_seconds
                )
                scores.append(fit.score)
                if kept is None or fit.score > kept.score:
                    if fit.state is None and restart < restarts - 1:  # the next restart overwrites the network
                        fit.state = copy.deepcopy(network.state_dict())
                    kept, chosen = fit, restart
            if kept.state is not None:
                network.load_state_dict(kept.state)
            if is_token_data(train):
                sync_value_body(network)
            cached = {
                "key": key,
                "state": network.state_dict(),
                "train_accuracy": kept.train_accuracy,
                "val_accuracy": kept.val_accuracy,
                "restart": chosen,
                "restart_scores": scores,
            }
            if not config.run.test_run:  # a test run's single epoch is not the agent its key names
                save_atomic({"run_id": digest, **cached}, path)
                cache_record.record("warm start", path.stem, path, built=True)
            metrics[f"pretrain/{agent}/from_cache"] = 0.0
        else:
            network.load_state_dict(cached["state"])
            cache_record.record("warm start", path.stem, path, built=False)
            metrics[f"pretrain/{agent}/from_cache"] = 1.0
        metrics[f"pretrain/{agent}/train_accuracy"] = float(cached["train_accuracy"])
        if len(cached.get("restart_scores", ())) > 1:
            metrics[f"pretrain/{agent}/restart"] = float(cached["restart"])
            metrics[f"pretrain/{agent}/worst_restart_score"] = float(min(cached["restart_scores"]))
        if cached.get("val_accuracy") is not None:
            metrics[f"pretrain/{agent}/val_accuracy"] = float(cached["val_accuracy"])
        _copy_body_to_value(agents, agent)
        # Roles that play the fitted model: a separate value body of theirs starts from it too.
        for name, owner in getattr(scenario, "warm_start_owners", dict)().items():
            if owner == agent and name != agent and hasattr(policy_network(agents, name), "value_head"):
                sync_value_body(policy_network(agents, name))
    metrics["timers/pretrain"] = time.perf_counter() - started
    return metrics
