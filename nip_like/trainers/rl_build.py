"""The build steps of the RL trainer: inference servers, warm start, sharding, loss, optimiser, collection, token budgets.

Part of :class:`~nip_like.trainers.rl.TensorDictRlTrainer`, whose ``__init__``
runs these steps in the build order: agents -> warm start -> reference ->
loss -> optimiser -> collection. Each step reads the trainer's config and
sets the attributes the loop uses.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from torch import nn
from torchrl.collectors import Collector
from torchrl.envs.utils import ExplorationType
from torchrl.objectives import LossModule

from nip_like.errors import ConfigError
from nip_like.lm.sharding import ShardedAgents
from nip_like.objectives.contract import LossContract, contract_of
from nip_like.optimizers import build_optimizer, build_scheduler
from nip_like.trainers.agent_updates import AgentUpdateSchedule
from nip_like.warm_start import pretrain_agents
from nip_like.trainers.base import TensorDictTrainer
from nip_like.trainers.data_parallel import LossPasses
from nip_like.trainers.update import UpdateSettings


class RlBuildSteps(TensorDictTrainer):
    """The build steps of :class:`~nip_like.trainers.rl.TensorDictRlTrainer`, which its ``__init__`` runs in order."""

    def _attach_inference_servers(self) -> None:
        """Give the LM agents with ``sampler.kind: server`` their inference servers (:mod:`nip_like.lm.server`)."""
        from nip_like.lm.server import InferenceServer, server_agents

        found = server_agents(self.scenario.lm_agent_configs())
        if not found:
            return
        agents = self.scenario.lm_agent_configs()
        self.policy.attach_servers(
            {
                name: InferenceServer(name, where, sampler, agents[name][1].pretrained_path, self.run_dir / "sampler")
                for name, (where, sampler) in found.items()
            }
        )

    def _language_models(self) -> dict[str, tuple[Any, str, Any]]:
        """The language-model agents: by name, the policy that plays it (the hook :meth:`~nip_like.trainers.policy_hooks.PolicyHooks.policy`), its config path and its config."""
        models = {}
        for name, (where, agent, _) in self.scenario.lm_agent_configs().items():
            policy = self.policy_hooks.policy(name)
            if policy is not None:
                models[name] = (policy, where, agent)
        return models

    @property
    def runs_sharded(self) -> bool:
        """Whether this run shards its LM agents over the ranks (``run.fsdp`` under torchrun): :meth:`shard_agents` does."""
        return bool(self.config.run.get("fsdp")) and self.distributed.enabled

    def shard_agents(self) -> ShardedAgents | None:
        """The build order's FSDP2 step (``run.fsdp``): shard the LM agents over the ranks, after the reference is taken.

        None when the run does not shard (the default). The optimiser is built
        after this step, on the sharded parameters.
        """
        if not self.runs_sharded:
            return None
        # Rank 0 builds first (it writes the caches); from here on the build needs every rank at once.
        self.distributed.release_others()
        return ShardedAgents({name: self.policy_hooks.policy(name) for name in self.agent_names})

    def probe_token_bytes(self, sharded: bool = False) -> dict[str, float]:
        """Activation bytes that a token of each LM agent's update keeps, for the agents whose budget is automatic.

        One probe pass per agent whose config leaves ``max_tokens_per_micro_batch``
        null (:func:`~nip_like.lm.memory.activation_bytes_per_token`, under the
        run's autocast). Sharded runs take it before sharding (``sharded``: a
        forward pass of a sharded model is a collective); sharding splits the
        weights, not a pass's activations, but it turns automatic chunked
        scoring off, so the probe scores as the sharded agent will.
        """
        from nip_like.lm.memory import activation_bytes_per_token

        measured = {}
        for name, (policy, _, agent) in self._language_models().items():
            if agent.get("max_tokens_per_micro_batch") is not None:
                continue
            was_sharded, policy.sharded = policy.sharded, sharded or policy.sharded
            try:
                measured[name] = activation_bytes_per_token(policy, self.config.run.get("autocast_dtype"))
            finally:
                policy.sharded = was_sharded
        return measured

    def set_token_budgets(self, token_bytes: Optional[dict[str, float]] = None) -> dict[str, float]:
        """The build order's last step: each LM agent's automatic ``max_tokens_per_micro_batch``, from a probe pass.

        For every language-model agent whose config leaves the budget null,
        one probe pass measures the activation bytes a token of its update
        keeps (:meth:`probe_token_bytes`; ``token_bytes`` when it was measured
        before sharding), and the memory free on the device (at most
        ``run.memory_limit_gib``; on the CPU, shared by the ranks of the
        machine), less every agent's gradients and optimiser state (this
        rank's shards when sharded), sets the budget
        (:func:`~nip_like.lm.memory.automatic_budget`), and the tokens the
        update's graph may hold before its micro-batches are recomputed
        (``max_tokens_held``: the same memory, uncapped). A number in the
        config wins for both. Returns ``lm/memory/<agent>/...`` metrics (logged with the first
        iteration); nothing for other agents.
        """
        from nip_like.lm.memory import automatic_budget, available_memory, local_bytes, memory_tokens, size, trainable_bytes

        models = self._language_models()
        if not models:
            return {}
        held = sum(local_bytes(t) for t in (*self.policy.parameters(), *self.policy.buffers()))
        available = available_memory(self.device, self.config.run.get("memory_limit_gib"), held)
        if available is not None and self.device.type == "cpu" and self.distributed.local_world_size > 1:
            # The ranks of one machine share its memory (a GPU is each rank's own).
            available = (available[0] // self.distributed.local_world_size, f"{available[1]}, shared by {self.distributed.local_world_size} ranks")
        # Each trainable parameter once: one model playing several roles (share_policy_with) trains once.
        reserved = trainable_bytes(nn.ModuleList([policy for policy, _, _ in models.values()]))
        width = int(getattr(self.train_env, "prompt_length", 0)) + int(self.policy.message_tokens)
        metrics: dict[str, float] = {}
        if token_bytes is None and available is not None:
            token_bytes = self.probe_token_bytes()
        for name, (policy, where, agent) in models.items():
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
            policy.max_tokens_per_micro_batch = budget
            # What the graph may hold across micro-batches: the same memory, without the cap on one pass's size.
            policy.max_tokens_held = memory_tokens(per_token, available[0], reserved)
            metrics[f"lm/memory/{name}/budget_tokens"] = float(budget)
            metrics[f"lm/memory/{name}/activation_bytes_per_token"] = float(per_token)
        return metrics

    def warm_start(self) -> dict[str, float]:
        """The build order's warm start: fit the agents of ``trainer.pretrain.agents`` (cached), before the reference is taken.

        Returns the warm start's metrics (logged with the first iteration);
        nothing without ``trainer.pretrain.agents``. Agents whose LoRA adapters
        come after a full warm start get them here (LM agents only).
        """
        metrics = (
            pretrain_agents(self.config, self.scenario, self.agent_modules, self.device)
            if self.trainer_config.pretrain.agents
            else {}
        )
        self.policy_hooks.after_warm_start()
        return metrics

    def _build_loss(self) -> None:
        """The loss module and advantage module of :meth:`~nip_like.trainers.rl.TensorDictRlTrainer._get_loss_module_and_gae`, checked; the loss contract."""
        self.loss_module, self.advantage_module = self._get_loss_module_and_gae()
        if not isinstance(self.loss_module, LossModule):
            raise ConfigError(
                f"{type(self).__name__}._get_loss_module_and_gae must return a torchrl LossModule, "
                f"got {type(self.loss_module).__name__}"
            )
        self.loss_module.to(self.device)
        self.loss_contract: LossContract = contract_of(self.loss_module)
        if self.loss_contract.needs_groups and self.trainer_config.group_size < 2:
            raise ConfigError(
                f"trainer {self.trainer_config.trainer_type} compares episodes that started on the same datapoint: "
                f"set trainer.group_size >= 2, got {self.trainer_config.group_size}"
            )

    def _build_optimizer(self) -> None:
        """One parameter group per agent, the learning-rate schedule, which agents each iteration trains."""
        optimizer_config = self.trainer_config.optimizer
        # Owners before the agents that play their model (share_policy_with): a shared model trains in its owner's group.
        models = self._language_models()
        names = sorted(self.agent_names, key=lambda name: name in models and models[name][0].policy_owner is not None)
        agent_params = {name: list(self.agent_modules.agent_parameters(name)) for name in names}
        self.optimizer = build_optimizer(optimizer_config, agent_params)
        self.scheduler = build_scheduler(optimizer_config, self.optimizer, self.num_iterations)
        self._schedule_stepped = False  # whether the scheduler has stepped in this process (see train_iteration)
        self.update_schedule = AgentUpdateSchedule(self.trainer_config.agent_updates, self.agent_names)
        bound = self.trainer_config.divergence_bound
        self.update_settings = UpdateSettings(
            num_epochs=int(self.trainer_config.num_epochs),
            accumulation=self.accumulation,
            max_grad_norm=optimizer_config.max_grad_norm,
            divergence_bound=float(bound) if bound is not None else math.inf,
        )
        self._loss_passes: LossPasses | None = None  # built at the first update (see _optimize)
        # Read once: OmegaConf lookups are slow enough to show in the inner loop.
        self._diagnostics_every = int(self.config.logger.diagnostics_every)

    def _build_collection(self) -> None:
        """The train environments and their collector; the evaluation environments are built on first use."""
        seed = int(self.config.seed)
        # Under torchrun each rank collects its share of every batch, with its own seeds (nip_like.distributed).
        self.train_env = self.scenario.make_env(
            self.distributed.share(self.trainer_config.num_envs, "trainer.num_envs"),
            "train",
            self.distributed.seed(seed, "train_env"),
            self.device,
            group_size=int(self.trainer_config.group_size),
        )
        self.eval_env = None  # built on first use
        self.collector = Collector(
            self.train_env,
            self.policy,
            frames_per_batch=self.distributed.share(self.trainer_config.frames_per_batch, "trainer.frames_per_batch"),
            total_frames=-1,
            device=self.device,
            exploration_type=ExplorationType.RANDOM,
            auto_register_policy_transforms=False,
        )
        self._collector_iterator = iter(self.collector)
