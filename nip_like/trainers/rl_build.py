"""The RL trainer's parts, and the builder that makes them in the build order.

:class:`~nip_like.trainers.rl.TensorDictRlTrainer` holds two frozen records:

- :class:`RlAgents`, built first by :func:`build_agents`: the agents (their
  policy and value), the policy's hooks, the warm start, the frozen
  reference, the FSDP2 shards. The trainer's hook
  ``_get_loss_module_and_gae`` builds its loss from these.
- :class:`RlParts`, built by :func:`build_parts` from the agents and the loss:
  the loss contract and its passes, the optimiser, the learning-rate schedule,
  which agents each iteration trains, the update's settings, the train
  environments and their collector, the opponent pool, the token budgets.

The build order: agents -> inference servers -> warm start -> reference ->
(sharding) -> loss -> optimiser -> opponent pool -> collection -> token
budgets. Each step is a function of what it needs, named here; nothing in
this module reads or writes a trainer.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ContextManager, Iterator, Optional

import torch
from omegaconf import DictConfig
from tensordict import TensorDictBase
from torch import nn
from torch.optim import Optimizer
from torchrl.collectors import Collector
from torchrl.envs import EnvBase
from torchrl.envs.utils import ExplorationType
from torchrl.objectives import LossModule

from nip_like.agent_modules import AgentModules
from nip_like.distributed import Distributed
from nip_like.errors import ConfigError
from nip_like.lm.sharding import ShardedAgents
from nip_like.objectives.contract import LossContract, contract_of
from nip_like.objectives.reference import ReferencePolicy
from nip_like.optimizers import build_optimizer, build_scheduler
from nip_like.scenarios.base import TensorGame
from nip_like.trainers.agent_updates import AgentUpdateSchedule
from nip_like.trainers.data_parallel import LossPasses
from nip_like.trainers.opponent_pool import OpponentPool, build_opponent_pool
from nip_like.trainers.policy_hooks import PolicyHooks, policy_hooks
from nip_like.trainers.update import UpdateSettings
from nip_like.warm_start import pretrain_agents


@dataclass(frozen=True)
class RlAgents:
    """The agents of an RL run, built, warm-started and (under ``run.fsdp``) sharded: what its loss is built from.

    Attributes
    ----------
    modules : AgentModules
        The agents' stacked policy and value networks.
    hooks : PolicyHooks
        What the loop tells the policy and reads from it (no-ops for tensor agents).
    reference : ReferencePolicy
        The initial policy (after the warm start), frozen: the common reference of ``objective/kl``.
    sharded : ShardedAgents or None
        The FSDP2 units of the LM agents (``run.fsdp`` under torchrun); None otherwise.
    warm_start_metrics : dict
        The warm start's metrics, logged with the first iteration.
    token_bytes : dict or None
        A sharded run's activation bytes per token of each LM agent with an
        automatic budget, probed before sharding; None otherwise.
    """

    modules: AgentModules
    hooks: PolicyHooks
    reference: ReferencePolicy
    sharded: Optional[ShardedAgents]
    warm_start_metrics: dict[str, float]
    token_bytes: Optional[dict[str, float]]

    @property
    def policy(self) -> Any:
        """The agents' stacked policy (``("agents", ...)`` keys)."""
        return self.modules.policy

    @property
    def value(self) -> Any:
        """The agents' stacked value network."""
        return self.modules.value

    def whole_weights(self) -> ContextManager[None]:
        """A context in which sharded agents keep their weights whole (sampling, evaluation, test); else nothing."""
        return self.sharded.gathered() if self.sharded is not None else nullcontext()


@dataclass(frozen=True)
class RlParts:
    """What one RL iteration works with, besides the agents: built once, never replaced.

    Attributes
    ----------
    loss_module : LossModule
        The trainer's loss (``_get_loss_module_and_gae``), on the run's device.
    advantage_module : nn.Module or None
        Its advantage module (GAE), called on each batch before the layout.
    loss_contract : LossContract
        How the loop talks to the loss (:mod:`nip_like.objectives.contract`).
    loss_passes : LossPasses
        The loss's forward and backward passes (under torchrun: DDP or FSDP2).
    optimizer : Optimizer
        One parameter group per agent that trains.
    scheduler : LRScheduler
        The learning-rate schedule, stepped once an iteration.
    update_schedule : AgentUpdateSchedule
        Which agents each iteration trains.
    update_settings : UpdateSettings
        Epochs, accumulation, clipping, the divergence bound.
    train_env : EnvBase
        This rank's train environments.
    collector : Collector
        TorchRL's collector over them.
    batches : Iterator[TensorDictBase]
        The collector's batches, one an iteration.
    opponent_pool : OpponentPool or None
        The opponent pool (``trainer.opponent_pool.agent``), if any.
    memory_metrics : dict
        The LM agents' automatic token budgets, logged with the first iteration.
    diagnostics_every : int
        Iterations between two policy diagnostics (``logger.diagnostics_every``; 0: never).
    """

    loss_module: LossModule
    advantage_module: Optional[nn.Module]
    loss_contract: LossContract
    loss_passes: LossPasses
    optimizer: Optimizer
    scheduler: Any
    update_schedule: AgentUpdateSchedule
    update_settings: UpdateSettings
    train_env: EnvBase
    collector: Collector
    batches: Iterator[TensorDictBase]
    opponent_pool: Optional[OpponentPool]
    memory_metrics: dict[str, float]
    diagnostics_every: int


# ------------------------------------------------------------------ the agents
def build_agents(config: DictConfig, scenario: TensorGame, run_dir: Path, device: torch.device, dist: Distributed) -> RlAgents:
    """The build order's first steps: the agents, their inference servers, the warm start, the reference, the shards.

    Parameters
    ----------
    config : DictConfig
        The whole experiment config.
    scenario : TensorGame
        The game, whose agents are built.
    run_dir : Path
        The run folder (inference servers keep their files there).
    device : torch.device
        The run's device.
    dist : Distributed
        The rank context.
    """
    modules = scenario.make_agents()
    modules.modules().to(device)
    hooks = policy_hooks(modules.policy)
    attach_inference_servers(modules.policy, scenario, run_dir)
    metrics = pretrain_agents(config, scenario, modules, device) if config.trainer.pretrain.agents else {}
    hooks.after_warm_start()  # LoRA adapters that come after a full warm start
    reference = ReferencePolicy(modules.policy)  # after the warm start: the policy the run starts from
    sharded = token_bytes = None
    if runs_sharded(config, dist):
        models = language_models(scenario, hooks)
        # A sharded agent's automatic token budget is probed before sharding (its passes are then collectives).
        token_bytes = probe_token_bytes(models, config.run.get("autocast_dtype"), sharded=True)
        # Rank 0 builds first (it writes the caches); from here on the build needs every rank at once.
        dist.release_others()
        sharded = ShardedAgents({name: hooks.policy(name) for name in scenario.agent_names})
    return RlAgents(modules, hooks, reference, sharded, metrics, token_bytes)


def attach_inference_servers(policy: Any, scenario: TensorGame, run_dir: Path) -> None:
    """Give the LM agents with ``sampler.kind: server`` their inference servers (:mod:`nip_like.lm.server`)."""
    from nip_like.lm.server import InferenceServer, server_agents

    agents = scenario.lm_agent_configs()
    found = server_agents(agents)
    if found:
        policy.attach_servers(
            {
                name: InferenceServer(name, where, sampler, agents[name][1].pretrained_path, Path(run_dir) / "sampler")
                for name, (where, sampler) in found.items()
            }
        )


def runs_sharded(config: DictConfig, dist: Distributed) -> bool:
    """Whether a run shards its LM agents over the ranks (``run.fsdp`` under torchrun)."""
    return bool(config.run.get("fsdp")) and dist.enabled


def language_models(scenario: TensorGame, hooks: PolicyHooks) -> dict[str, tuple[Any, str, Any]]:
    """The language-model agents: by name, the policy that plays it (:meth:`PolicyHooks.policy`), its config path and its config."""
    models = {}
    for name, (where, agent, _) in scenario.lm_agent_configs().items():
        policy = hooks.policy(name)
        if policy is not None:
            models[name] = (policy, where, agent)
    return models


def probe_token_bytes(models: dict[str, tuple[Any, str, Any]], autocast_dtype: Optional[str], sharded: bool = False) -> dict[str, float]:
    """Activation bytes that a token of each LM agent's update keeps, for the agents whose budget is automatic.

    One probe pass per agent of ``models`` (:func:`language_models`) whose
    config leaves ``max_tokens_per_micro_batch`` null
    (:func:`~nip_like.lm.memory.activation_bytes_per_token`, under the run's
    autocast). Sharded runs take it before sharding (``sharded``: a forward
    pass of a sharded model is a collective); sharding splits the weights,
    not a pass's activations, but it turns automatic chunked scoring off, so
    the probe scores as the sharded agent will.
    """
    from nip_like.lm.memory import activation_bytes_per_token

    measured = {}
    for name, (policy, _, agent) in models.items():
        if agent.get("max_tokens_per_micro_batch") is not None:
            continue
        was_sharded, policy.sharded = policy.sharded, sharded or policy.sharded
        try:
            measured[name] = activation_bytes_per_token(policy, autocast_dtype)
        finally:
            policy.sharded = was_sharded
    return measured


# ------------------------------------------------------------------ the loss
def checked_loss(
    built: tuple[LossModule, Optional[nn.Module]], trainer_name: str, config: DictConfig, device: torch.device
) -> tuple[LossModule, Optional[nn.Module], LossContract]:
    """What ``_get_loss_module_and_gae`` returned (``built``), checked and on ``device``; its loss contract.

    Raises
    ------
    ConfigError
        If the loss is not a TorchRL ``LossModule``, or compares episodes of
        a group while ``trainer.group_size`` is under 2.
    """
    loss_module, advantage_module = built
    if not isinstance(loss_module, LossModule):
        raise ConfigError(
            f"{trainer_name}._get_loss_module_and_gae must return a torchrl LossModule, got {type(loss_module).__name__}"
        )
    loss_module.to(device)
    contract = contract_of(loss_module)
    group_size = config.trainer.group_size
    if contract.needs_groups and group_size < 2:
        raise ConfigError(
            f"trainer {config.trainer.trainer_type} compares episodes that started on the same datapoint: "
            f"set trainer.group_size >= 2, got {group_size}"
        )
    return loss_module, advantage_module, contract


# ------------------------------------------------------------------ the rest
def build_parts(
    config: DictConfig,
    scenario: TensorGame,
    agents: RlAgents,
    built: tuple[LossModule, Optional[nn.Module]],
    trainer_name: str,
    run_dir: Path,
    device: torch.device,
    dist: Distributed,
    num_iterations: int,
    accumulation: int,
) -> RlParts:
    """The build order's steps after the agents: loss, optimiser, opponent pool, collection, token budgets.

    Parameters
    ----------
    config : DictConfig
        The whole experiment config.
    scenario : TensorGame
        The game.
    agents : RlAgents
        What :func:`build_agents` built.
    built : tuple
        What the trainer's ``_get_loss_module_and_gae`` returned.
    trainer_name : str
        The trainer class's name, for the errors.
    run_dir : Path
        The run folder (the opponent pool writes its episodes there).
    device : torch.device
        The run's device.
    dist : Distributed
        The rank context.
    num_iterations : int
        The train loop's iterations (the schedule's length).
    accumulation : int
        Minibatches per optimiser step (:func:`~nip_like.trainers.update.accumulation_steps`).
    """
    tc = config.trainer
    loss_module, advantage_module, contract = checked_loss(built, trainer_name, config, device)
    # Under torchrun, DDP (replicated agents; wrapped at the first update, where every rank arrives together) or
    # FSDP2 (run.fsdp) sums the ranks' gradients.
    passes = LossPasses(loss_module, dist, lockstep=agents.sharded is not None)
    models = language_models(scenario, agents.hooks)
    # Owners before the agents that play their model (share_policy_with): a shared model trains in its owner's group.
    names = sorted(scenario.agent_names, key=lambda name: name in models and models[name][0].policy_owner is not None)
    optimizer = build_optimizer(tc.optimizer, {name: list(agents.modules.agent_parameters(name)) for name in names})
    bound = tc.divergence_bound
    settings = UpdateSettings(
        num_epochs=int(tc.num_epochs),
        accumulation=accumulation,
        max_grad_norm=tc.optimizer.max_grad_norm,
        divergence_bound=float(bound) if bound is not None else math.inf,
    )
    pool = build_opponent_pool(tc.opponent_pool, agents.policy, scenario.agent_names, int(config.seed), run_dir)
    with agents.whole_weights():
        train_env, collector = build_collection(config, scenario, agents.policy, device, dist)
    return RlParts(
        loss_module=loss_module,
        advantage_module=advantage_module,
        loss_contract=contract,
        loss_passes=passes,
        optimizer=optimizer,
        scheduler=build_scheduler(tc.optimizer, optimizer, num_iterations),
        update_schedule=AgentUpdateSchedule(tc.agent_updates, scenario.agent_names),
        update_settings=settings,
        train_env=train_env,
        collector=collector,
        batches=iter(collector),
        opponent_pool=pool,
        memory_metrics=set_token_budgets(config, agents, models, train_env, device, dist),
        # Read once: OmegaConf lookups are slow enough to show in the inner loop.
        diagnostics_every=int(config.logger.diagnostics_every),
    )


def build_collection(
    config: DictConfig, scenario: TensorGame, policy: Any, device: torch.device, dist: Distributed
) -> tuple[EnvBase, Collector]:
    """This rank's train environments and their collector (each rank collects its share of a batch, with its own seeds)."""
    tc = config.trainer
    train_env = scenario.make_env(
        dist.share(tc.num_envs, "trainer.num_envs"),
        "train",
        dist.seed(int(config.seed), "train_env"),
        device,
        group_size=int(tc.group_size),
    )
    collector = Collector(
        train_env,
        policy,
        frames_per_batch=dist.share(tc.frames_per_batch, "trainer.frames_per_batch"),
        total_frames=-1,
        device=device,
        exploration_type=ExplorationType.RANDOM,
        auto_register_policy_transforms=False,
    )
    return train_env, collector


def set_token_budgets(
    config: DictConfig,
    agents: RlAgents,
    models: dict[str, tuple[Any, str, Any]],
    train_env: EnvBase,
    device: torch.device,
    dist: Distributed,
) -> dict[str, float]:
    """The build order's last step: each LM agent's automatic ``max_tokens_per_micro_batch``, from a probe pass.

    For every language-model agent of ``models`` whose config leaves the
    budget null, one probe pass measures the activation bytes a token of its
    update keeps (:func:`probe_token_bytes`; ``agents.token_bytes`` when it
    was measured before sharding), and the memory free on the device (at
    most ``run.memory_limit_gib``; on the CPU, shared by the ranks of the
    machine), less every agent's gradients and optimiser state (this rank's
    shards when sharded), sets the budget
    (:func:`~nip_like.lm.memory.automatic_budget`), and the tokens the
    update's graph may hold before its micro-batches are recomputed
    (``max_tokens_held``: the same memory, uncapped). A number in the config
    wins for both. Returns ``lm/memory/<agent>/...`` metrics (logged with
    the first iteration); nothing for other agents.
    """
    from nip_like.lm.memory import automatic_budget, available_memory, local_bytes, memory_tokens, size, trainable_bytes

    if not models:
        return {}
    policy = agents.policy
    held = sum(local_bytes(t) for t in (*policy.parameters(), *policy.buffers()))
    available = available_memory(device, config.run.get("memory_limit_gib"), held)
    if available is not None and device.type == "cpu" and dist.local_world_size > 1:
        # The ranks of one machine share its memory (a GPU is each rank's own).
        available = (available[0] // dist.local_world_size, f"{available[1]}, shared by {dist.local_world_size} ranks")
    # Each trainable parameter once: one model playing several roles (share_policy_with) trains once.
    reserved = trainable_bytes(nn.ModuleList([model for model, _, _ in models.values()]))
    width = int(getattr(train_env, "prompt_length", 0)) + int(policy.message_tokens)
    token_bytes = agents.token_bytes
    if token_bytes is None and available is not None:
        token_bytes = probe_token_bytes(models, config.run.get("autocast_dtype"))
    metrics: dict[str, float] = {}
    for name, (model, where, agent) in models.items():
        if agent.get("max_tokens_per_micro_batch") is not None or available is None:
            continue
        per_token = token_bytes[name]
        budget = automatic_budget(per_token, available[0], reserved)
        if budget < width:
            raise ConfigError(
                f"{where}: agent {name}'s update cannot fit in memory: {size(available[0])} is available "
                f"({available[1]}), gradients and optimiser state take {size(reserved)} and a token of its update "
                f"{per_token / 2**20:.2f} MiB, so a micro-batch holds {budget} tokens, under one row ({width}); lower "
                f"{where}.lora.r or the model's size, or set {where}.gradient_checkpointing=true or run.autocast_dtype=bfloat16"
            )
        model.max_tokens_per_micro_batch = budget
        # What the graph may hold across micro-batches: the same memory, without the cap on one pass's size.
        model.max_tokens_held = memory_tokens(per_token, available[0], reserved)
        metrics[f"lm/memory/{name}/budget_tokens"] = float(budget)
        metrics[f"lm/memory/{name}/activation_bytes_per_token"] = float(per_token)
    return metrics
