"""Language-model agents in the RL loop: the stacked actor and critic over per-agent LMs.

:class:`LMActor` is the policy the collector runs: for each agent it samples a
message from that agent's :class:`~nip_like.lm.policy.LMPolicy` on the rows
where the agent acts, batched, and writes the ``(*batch, agents, T)`` action
with its token mask, per-token log-probabilities and entropies and their sum.
Its :meth:`LMActor.score_actions` recomputes the same log-probabilities with
gradients in one teacher-forced pass per agent, which is all the objectives
ask of a policy (:mod:`nip_like.objectives.action_scores`). :class:`LMCritic` is the
value network: each agent's value head on its prompt.

A frozen agent played by a chat server (:class:`~nip_like.text.served.ServedAgent`,
:meth:`LMActor.attach_served`) has its messages written by that server; they
carry no log-probabilities and enter no scoring pass, so no loss.

Both hold the per-agent models in one :class:`~nip_like.agent_modules.PerAgent`, so
each agent's parameters (its model and value head) form its own optimiser
group, as for the other agent kinds.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import torch
from torch import nn
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from torchrl.data import Composite, Unbounded
from torchrl.envs.utils import ExplorationType, exploration_type

from nip_like import keys
from nip_like.agent_modules import AgentModules, PerAgent
from nip_like.lm.agent_folders import save_agent
from nip_like.lm.lora import adapters_disabled, has_lora
from nip_like.lm.micro_batches import largest_across_ranks
from nip_like.lm.padding import kept_columns
from nip_like.lm.policy import LMPolicy
from nip_like.lm.models import sharing_copy
from nip_like.objectives.action_scores import ActionScores

if TYPE_CHECKING:
    from nip_like.lm.server import InferenceServer

#: Exploration types that take the most likely token instead of sampling.
GREEDY = (ExplorationType.DETERMINISTIC, ExplorationType.MODE)


def _flat(tensor: torch.Tensor, batch_dims: int) -> torch.Tensor:
    """Merge the first ``batch_dims`` dimensions of ``tensor`` into one."""
    return tensor.reshape(-1, *tensor.shape[batch_dims:])


def _pass_tokens(prompt_mask: torch.Tensor, message_tokens: int) -> int:
    """Tokens of one scoring pass over these rows: rows x (prompt columns not padding in every row + ``message_tokens``).

    The pass drops the prompt columns that are padding in every row
    (:func:`~nip_like.lm.padding.kept_columns`), so this is what it holds,
    not the prompts' padded width.
    """
    rows = prompt_mask.shape[0]
    if rows == 0:
        return 0
    return rows * (int(kept_columns(prompt_mask).sum()) + message_tokens)


class LMActor(TensorDictModuleBase):
    """Sample each acting agent's message with its own language model.

    Parameters
    ----------
    policies : Mapping[str, LMPolicy]
        One policy per agent, in the order of the agent dimension.
    message_tokens : int
        ``T``, the width of the action: at least every policy's
        ``max_new_tokens`` (a shorter message is padded, mask False).

    Notes
    -----
    Reads ``("agents", "prompt_ids")``, ``("agents", "prompt_mask")`` and
    ``("agents", "active")``; writes ``("agents", "action")`` (the tokens,
    ``<pad>`` after the message and for agents that do not act),
    ``("agents", "token_mask")``, ``("agents", "token_log_probs")``,
    ``("agents", "token_entropy")`` and ``("agents", "action_log_prob")``.
    Under ``ExplorationType.DETERMINISTIC`` (evaluation with
    ``trainer.eval.deterministic``) each token is the most likely one.
    """

    def __init__(self, policies: Mapping[str, LMPolicy], message_tokens: int) -> None:
        super().__init__()
        longest = max(policy.max_new_tokens for policy in policies.values())
        if message_tokens < longest:
            raise ValueError(f"message_tokens ({message_tokens}) is below an agent's max_new_tokens ({longest})")
        self.agents = PerAgent(dict(policies))
        self.agent_names = tuple(policies)
        self.message_tokens = int(message_tokens)
        self.in_keys = [keys.PROMPT_IDS_KEY, keys.PROMPT_MASK_KEY, keys.ACTIVE_KEY]
        self.out_keys = [
            keys.ACTION_KEY,
            keys.TOKEN_MASK_KEY,
            keys.TOKEN_LOG_PROBS_KEY,
            keys.TOKEN_ENTROPY_KEY,
            keys.LOG_PROB_KEY,
        ]
        #: Agents that sample from an inference server (:meth:`attach_servers`); not modules, not in the state dict.
        self.servers: dict[str, "InferenceServer"] = {}
        #: Frozen agents whose messages a chat server writes (:meth:`attach_served`); not modules, not in the state dict.
        self.served: dict[str, Any] = {}  # agent -> its ServedAgent (nip_like.text.served, a layer above: not imported)
        #: The opponent pool (:class:`~nip_like.trainers.opponent_pool.OpponentPool`) whose snapshots play one
        #: agent's seat in training episodes (:meth:`attach_pool`).
        self.pool = None

    @property
    def spec(self) -> Composite:
        """What :meth:`forward` writes, per step: each out key's shape (agent dimension last but the message's) and dtype.

        TorchRL's collector reads it to lay out its rollouts; without it, the
        collector samples a whole batch of messages once when it is built, to
        see which keys come out (seconds for a model with a large vocabulary).
        """
        agents, length = len(self.agent_names), self.message_tokens
        device = next((param.device for param in self.parameters()), torch.device("cpu"))
        shapes = {
            keys.ACTION_KEY: ((agents, length), torch.long),
            keys.TOKEN_MASK_KEY: ((agents, length), torch.bool),
            keys.TOKEN_LOG_PROBS_KEY: ((agents, length), torch.float32),
            keys.TOKEN_ENTROPY_KEY: ((agents, length), torch.float32),
            keys.LOG_PROB_KEY: ((agents,), torch.float32),
            keys.SAMPLER_WEIGHT_KEY: ((agents, length), torch.float32),
            keys.OPPONENT_VERSION_KEY: ((), torch.long),
        }
        spec = Composite(device=device)
        for key in self.out_keys:
            shape, dtype = shapes[key]
            spec[key] = Unbounded(shape=shape, dtype=dtype, device=device)
        return spec

    def attach_pool(self, pool) -> None:
        """Let ``pool`` choose who plays its agent's seat in each episode; every step then gets ``opponent_version``."""
        self.pool = pool
        if keys.OPPONENT_VERSION_KEY not in self.out_keys:
            self.out_keys.append(keys.OPPONENT_VERSION_KEY)

    def attach_servers(self, servers: Mapping[str, "InferenceServer"]) -> None:
        """Sample these agents' messages from their inference servers (see :mod:`nip_like.lm.server`).

        When one of them truncates importance weights, every step also gets
        ``("agents", "sampler_weight")`` (1 for the agents sampled here).
        """
        self.servers = dict(servers)
        if any(server.sampler.max_importance_weight is not None for server in self.servers.values()):
            if keys.SAMPLER_WEIGHT_KEY not in self.out_keys:
                self.out_keys.append(keys.SAMPLER_WEIGHT_KEY)

    def attach_served(self, served: Mapping[str, Any]) -> None:
        """Let chat servers write these frozen agents' messages (see :class:`~nip_like.text.served.ServedAgent`).

        Their steps then hold the server's tokens with a token mask over the
        reply, as a local agent's, and log-probabilities and entropies of 0;
        :meth:`score_actions` leaves them out (mask False, no pass of their model).
        """
        self.served = dict(served)

    def weights_changed(self) -> None:
        """Tell the servers that the agents' weights changed: each gets them before it samples again."""
        for server in self.servers.values():
            if server.sampler.sync != "none":
                server.stale = True

    def pop_sampler_metrics(self) -> dict[str, float]:
        """The servers' sampling metrics since the last call, by agent (``sampler/...``)."""
        metrics: dict[str, float] = {}
        for name, server in self.servers.items():
            metrics.update(server.stats.pop(name))
        return metrics

    def close_servers(self) -> None:
        """Stop the servers the run started and close the clients (the served agents' too)."""
        for server in self.servers.values():
            server.close()
        for player in self.served.values():
            player.close()

    def policy(self, name: str) -> LMPolicy:
        """Agent ``name``'s policy."""
        return self.agents.networks[name]

    def after_warm_start(self) -> None:
        """Add the adapters of agents whose LoRA comes after the warm start (see :meth:`LMPolicy.after_warm_start`)."""
        # Agents of a shared base fitted whole in the warm start (lora.warm_start: full) played one model until now:
        # each gets its own module tree over the fitted base's tensors before its adapters are added.
        groups: dict[int, list[LMPolicy]] = {}
        for name in self.agent_names:
            policy = self.policy(name)
            if policy.policy_owner is None and policy.base_owner is not None and policy.defers_lora:
                groups.setdefault(id(policy.model), []).append(policy)
        for members in groups.values():
            trees = [sharing_copy(members[0].model) for _ in members]
            for policy, tree in zip(members, trees):
                policy.model = tree
        for name in self.agent_names:
            if self.policy(name).policy_owner is None:
                self.policy(name).after_warm_start()
        for name in self.agent_names:  # an agent that plays another's model plays it with the adapters just added
            owner = self.policy(name).policy_owner
            if owner is not None:
                self.policy(name).play_with(self.policy(owner).model, self.policy(owner).fitted_base)

    def frozen_reference(self) -> "LMReference":
        """The initial policy, frozen, for KL penalties and DPO (see :class:`LMReference`)."""
        return LMReference(self)

    def pop_padding_fraction(self) -> float | None:
        """Share of padding in the scoring passes since the last call (None if nothing was scored)."""
        real = total = 0
        for name in self.agent_names:
            counted = self.policy(name).pop_padding_counts()
            real, total = real + counted[0], total + counted[1]
        return 1.0 - real / total if total else None

    def save_pretrained(self, folder: Path, states: Mapping[str, tuple[dict, dict | None]] | None = None) -> list[Path]:
        """Write each agent to ``folder/<agent>`` as a Hugging Face folder (model, tokenizer, value head).

        ``AutoModelForCausalLM.from_pretrained(folder / agent)`` reloads the
        model, ``AutoTokenizer.from_pretrained`` its tokenizer, and
        ``scenario.agents.<agent>.pretrained_path`` starts a run from it.
        ``states`` (from :meth:`whole_states`) gives the weights of sharded
        agents; None: the modules' own. The folder of an agent whose LoRA
        adapters came after a warm start that fitted every weight also holds
        that fitted base (``base/``, see :func:`~nip_like.lm.agent_folders.save_agent`).
        """
        states = states or {}
        return [
            save_agent(
                Path(folder) / name, policy.model, policy.tokenizer, policy.value_head, *states.get(name, (None, None)),
                with_base=policy.fitted_base,
            )
            for name, policy in ((name, self.policy(name)) for name in self.agent_names)
            if policy.frozen_source is None  # a frozen co-player's folder is where it was loaded from
        ]

    def frozen_sources(self) -> dict:
        """The frozen co-players' :class:`~nip_like.lm.frozen.FrozenSource`, by agent (none: empty)."""
        return {name: self.policy(name).frozen_source for name in self.agent_names if self.policy(name).frozen_source is not None}

    def whole_states(self) -> dict[str, tuple[dict, dict | None]]:
        """Each agent's model and value-head state dicts with whole tensors (sharded agents: a collective on every rank)."""
        from nip_like.lm.sharding import whole

        return {
            name: (
                whole(self.policy(name).model.state_dict()),
                whole(self.policy(name).value_head.state_dict()) if self.policy(name).value_head is not None else None,
            )
            for name in self.agent_names
        }

    @torch.no_grad()
    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Sample the acting agents' messages into ``tensordict`` (see the class notes)."""
        active = tensordict.get(keys.ACTIVE_KEY)
        batch_shape, dims = active.shape[:-1], active.ndim - 1
        prompt_ids = _flat(tensordict.get(keys.PROMPT_IDS_KEY), dims)
        prompt_mask = _flat(tensordict.get(keys.PROMPT_MASK_KEY), dims)
        acting = _flat(active, dims)
        rows, agents, length = acting.shape[0], acting.shape[1], self.message_tokens
        device = prompt_ids.device
        pads = torch.tensor([self.policy(name).pad_token_id for name in self.agent_names], device=device)
        # Each agent's rows are padded with its own tokenizer's pad token (agents may differ in vocabulary).
        tokens = pads.view(1, -1, 1).expand(rows, agents, length).clone()
        token_mask = torch.zeros((rows, agents, length), dtype=torch.bool, device=device)
        token_log_probs = torch.zeros((rows, agents, length), dtype=torch.float32, device=device)
        token_entropy = torch.zeros((rows, agents, length), dtype=torch.float32, device=device)
        weighted = keys.SAMPLER_WEIGHT_KEY in self.out_keys
        weights = torch.ones((rows, agents, length), dtype=torch.float32, device=device) if weighted else None
        greedy = exploration_type() in GREEDY
        versions = None
        if self.pool is not None:
            versions = self.pool.versions_for(_flat(tensordict.get(keys.GROUP_ID_KEY), dims))
        for index, name in enumerate(self.agent_names):
            where = acting[:, index]
            if not bool(where.any()):
                continue
            policy = self.policy(name)
            server = self.servers.get(name)
            served = self.served.get(name)
            # The pooled agent's seat: each version that its episodes meet samples its own rows (the agent itself: -1).
            seats = [(where, None)]
            if versions is not None and index == self.pool.index:
                seats = [(where & (versions == version), int(version)) for version in versions[where].unique()]
            for rows, version in seats:
                with self.pool.playing(version) if version is not None else nullcontext():
                    if served is not None:
                        sample = served.sample(prompt_ids[rows, index], prompt_mask[rows, index], greedy=greedy)
                    elif server is None:
                        sample = policy.sample(prompt_ids[rows, index], prompt_mask[rows, index], greedy=greedy)
                    else:
                        sample = server.sample(policy, prompt_ids[rows, index], prompt_mask[rows, index], greedy=greedy)
                width = sample["tokens"].shape[-1]
                if weights is not None and server is not None:
                    weights[rows, index, :width] = server.importance_weights(sample)
                tokens[rows, index, :width] = sample["tokens"]
                token_mask[rows, index, :width] = sample["token_mask"]
                token_log_probs[rows, index, :width] = sample["token_log_probs"]
                token_entropy[rows, index, :width] = sample["token_entropy"]
        shape = (*batch_shape, agents)
        tensordict.set(keys.ACTION_KEY, tokens.reshape(*shape, length))
        tensordict.set(keys.TOKEN_MASK_KEY, token_mask.reshape(*shape, length))
        tensordict.set(keys.TOKEN_LOG_PROBS_KEY, token_log_probs.reshape(*shape, length))
        tensordict.set(keys.TOKEN_ENTROPY_KEY, token_entropy.reshape(*shape, length))
        tensordict.set(keys.LOG_PROB_KEY, token_log_probs.sum(-1).reshape(shape))
        if weights is not None:
            tensordict.set(keys.SAMPLER_WEIGHT_KEY, weights.reshape(*shape, length))
        if versions is not None:
            tensordict.set(keys.OPPONENT_VERSION_KEY, versions.reshape(batch_shape))
        return tensordict

    def score_actions(self, tensordict: TensorDictBase, with_value: bool = False) -> ActionScores:
        """Teacher-forced log-probabilities and entropies of the stored messages, with gradients.

        Each agent's model runs once, on the rows where it acted; the other
        rows get zeros with a False mask. On the messages this actor sampled,
        the log-probabilities equal the stored ones up to float error.

        With ``with_value``, the scores also hold each agent's value of every
        step's prompt (``(*batch, agents)``, as :class:`LMCritic` computes it;
        0 for an agent without a value head). A value head on the policy's
        body reads it from the same pass that scores the agent's message: one
        body pass per row and agent (the rows where the agent did not act
        pass their prompt alone). A value body of its own takes its own pass.

        A served agent's (:meth:`attach_served`) messages are not scored: its
        log-probabilities and entropies are 0 and its token mask False, so
        they count in no loss.

        When the scoring passes of all agents together hold more tokens (rows
        times the prompt columns that are not padding in every row, plus the
        message's width) than an agent's ``max_tokens_held`` (set from the
        memory free with the automatic budget; else its
        ``max_tokens_per_micro_batch``), that agent's micro-batches are
        recomputed in the backward pass, so the update's graph holds one
        micro-batch's activations at a time, across agents too. Counting the
        columns a pass really takes, not the prompts' padded width, keeps a
        minibatch that fits from being computed twice.
        """
        active = tensordict.get(keys.ACTIVE_KEY)
        batch_shape, dims = active.shape[:-1], active.ndim - 1
        prompt_ids = _flat(tensordict.get(keys.PROMPT_IDS_KEY), dims)
        prompt_mask = _flat(tensordict.get(keys.PROMPT_MASK_KEY), dims)
        tokens = _flat(tensordict.get(keys.ACTION_KEY), dims)
        token_mask = _flat(tensordict.get(keys.TOKEN_MASK_KEY), dims) & _flat(active, dims).unsqueeze(-1)
        rows, agents, length = tokens.shape
        if self.served:  # a served agent's messages have no log-probabilities of its model: none is scored
            scored_agents = torch.tensor([name not in self.served for name in self.agent_names], device=token_mask.device)
            token_mask = token_mask & scored_agents.view(1, -1, 1)
        acting = token_mask.any(-1)  # (rows, agents)
        in_pass = [self._rows_in_pass(index, acting[:, index], with_value) for index in range(agents)]
        held = sum(_pass_tokens(prompt_mask[where, index], length) for index, where in enumerate(in_pass))
        if any(self.policy(name).lockstep for name in self.agent_names):
            # FSDP2: a recomputed pass gathers the weights again, so every rank must decide alike (the largest count).
            held = largest_across_ranks(held, token_mask.device)
        per_agent_log_probs, per_agent_entropy, per_agent_value = [], [], []
        for index, name in enumerate(self.agent_names):
            policy = self.policy(name)
            limit = policy.max_tokens_held if policy.max_tokens_held is not None else policy.max_tokens_per_micro_batch
            recompute = limit is not None and held > limit
            where = in_pass[index]
            log_probs = tokens.new_zeros((rows, length), dtype=torch.float32)
            entropy = tokens.new_zeros((rows, length), dtype=torch.float32)
            value = tokens.new_zeros((rows,), dtype=torch.float32)
            shared_value = with_value and policy.value_head is not None and policy.value_head.shared_body
            if bool(where.any()):
                scored = policy.evaluate(
                    prompt_ids[where, index], prompt_mask[where, index], tokens[where, index], token_mask[where, index],
                    with_value=shared_value, value_at="prompt", recompute=recompute,
                )
                # Scatter with index_put so that gradients flow into the selected rows.
                rows_index = (where.nonzero().squeeze(-1),)
                log_probs = log_probs.index_put(rows_index, scored["token_log_probs"].float())
                entropy = entropy.index_put(rows_index, scored["entropy"].float())
                if shared_value:
                    value = value.index_put(rows_index, scored["value"].float())
            elif policy.lockstep and rows:
                # FSDP2 (nip_like.lm.sharding): every rank runs every agent's model in each minibatch; an agent
                # without rows here runs on a stand-in row whose scores count zero.
                scored = policy.evaluate(
                    prompt_ids[:1, index], prompt_mask[:1, index], tokens[:1, index], token_mask[:1, index], with_value=False
                )
                log_probs = log_probs + 0 * scored["token_log_probs"].float().sum()
            if with_value and policy.value_head is not None and not shared_value:
                empty = tokens.new_zeros((rows, 0))
                value = policy.evaluate(
                    prompt_ids[:, index], prompt_mask[:, index], empty, empty.bool(), with_log_probs=False, with_value=True,
                    recompute=recompute,
                )["value"].float()
            per_agent_log_probs.append(log_probs)
            per_agent_entropy.append(entropy)
            per_agent_value.append(value)
        shape = (*batch_shape, agents, length)
        return ActionScores(
            token_log_probs=torch.stack(per_agent_log_probs, dim=1).reshape(shape),
            token_mask=token_mask.reshape(shape),
            token_entropy=torch.stack(per_agent_entropy, dim=1).reshape(shape),
            value=torch.stack(per_agent_value, dim=1).reshape(*batch_shape, agents) if with_value else None,
        )

    def _rows_in_pass(self, index: int, acting: torch.Tensor, with_value: bool) -> torch.Tensor:
        """``(rows,)``: the rows agent ``index``'s scoring pass takes (all of them when it also reads its value)."""
        head = self.policy(self.agent_names[index]).value_head
        if with_value and head is not None and head.shared_body:
            return torch.ones_like(acting)
        return acting


class LMReference(nn.Module):
    """The reference policy of language-model agents, without a second copy of LoRA models.

    An agent with LoRA adapters is scored by its own model with the adapters
    switched off (``peft``'s ``disable_adapter``): its reference is the model
    it started from, and no weights are copied. A frozen co-player
    (``frozen_from``) is its own reference. Any other agent is a frozen
    deep copy of its policy. Only the copies are this module's parameters
    (and enter its state dict).

    Parameters
    ----------
    actor : LMActor
        The live actor.
    """

    def __init__(self, actor: LMActor) -> None:
        super().__init__()
        policies, originals = {}, {}
        for name in actor.agent_names:
            policy = actor.policy(name)
            if has_lora(policy.model) or policy.frozen_source is not None:  # a frozen co-player is its own reference
                policies[name] = policy
            else:
                originals[name] = policy
        # One deep copy of all of them: agents that play one model (share_policy_with) keep one reference model.
        copies = {name: policy.requires_grad_(False) for name, policy in copy.deepcopy(originals).items()}
        policies.update(copies)
        policies = {name: policies[name] for name in actor.agent_names}
        self.copies = nn.ModuleDict(copies)
        models = {id(policies[name].model): policies[name].model for name in policies if name not in copies}
        self._shared_models = list(models.values())
        # Not a registered submodule: the shared models belong to the live actor.
        scorer = LMActor(policies, actor.message_tokens)
        scorer.served = actor.served  # served agents' messages are left out here too (only their names are read)
        object.__setattr__(self, "_scorer", scorer)

    @torch.no_grad()
    def score_actions(self, tensordict: TensorDictBase) -> ActionScores:
        """The reference's scores of the stored messages (see :meth:`LMActor.score_actions`)."""
        with adapters_disabled(self._shared_models):
            return self._scorer.score_actions(tensordict)


class LMCritic(TensorDictModuleBase):
    """Each agent's value head on its prompt, ``("agents", "state_value")`` ``(*batch, agents, 1)``.

    An agent whose policy has no value head (``value_head: false``) gets the
    constant 0, a critic with nothing to learn.

    Parameters
    ----------
    agents : PerAgent
        The actor's per-agent policies (the same modules, so a shared body is
        shared).
    """

    def __init__(self, agents: PerAgent) -> None:
        super().__init__()
        self.agents = agents
        self.in_keys = [keys.PROMPT_IDS_KEY, keys.PROMPT_MASK_KEY]
        self.out_keys = [keys.VALUE_KEY]

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Write each agent's value of its prompt into ``tensordict``."""
        prompt_ids = tensordict.get(keys.PROMPT_IDS_KEY)
        prompt_mask = tensordict.get(keys.PROMPT_MASK_KEY)
        dims = prompt_ids.ndim - 2
        ids, mask = _flat(prompt_ids, dims), _flat(prompt_mask, dims)
        empty = ids.new_zeros((ids.shape[0], 0))
        values = []
        for index, name in enumerate(self.agents.agent_names):
            policy: LMPolicy = self.agents.networks[name]
            if policy.value_head is None:
                values.append(torch.zeros(ids.shape[0], device=ids.device))
                continue
            values.append(policy.value(ids[:, index], mask[:, index], empty, empty.bool()).float())
        value = torch.stack(values, dim=-1).reshape(*prompt_ids.shape[:-1], 1)
        tensordict.set(keys.VALUE_KEY, value)
        return tensordict


def lm_agent_modules(policies: Mapping[str, LMPolicy], message_tokens: int) -> AgentModules:
    """The :class:`~nip_like.agent_modules.AgentModules` of language-model agents.

    Parameters
    ----------
    policies : Mapping[str, LMPolicy]
        One policy per agent, in the order of the agent dimension.
    message_tokens : int
        ``T``, the width of the environment's action.
    """
    actor = LMActor(policies, message_tokens)
    return AgentModules(policy=actor, value=LMCritic(actor.agents), agent_names=actor.agent_names)
