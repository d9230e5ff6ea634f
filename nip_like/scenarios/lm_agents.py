"""Language-model agents of a scenario: their configs, models, tokenizers and size checks.

:class:`LMAgents` is what a scenario whose agents are causal language models
(one per agent) shares, whatever its game: it resolves each agent's
:class:`~nip_like.lm.models.LMAgentConfig` (``scenario.agents.<name>`` or
``scenario.default_agent``; frozen co-players, shared models, a shared base),
builds the small chat models of the chat view, checks prompts and messages
against each model's context and token budget, and builds the agents. The
game gives the system prompt of each agent (``system_prompt(agent)``) and,
for a token view over its own symbols,
:meth:`LMAgents.token_view_policies` and a ``tokenizer``. It is a base of the
duplicates game's agents
(:class:`~nip_like.scenarios.duplicates.lm_agents.DuplicatesLMAgents`) and of
the code-validation scenario
(:class:`~nip_like.scenarios.code_validation.scenario.CodeValidationScenario`).
This module registers nothing.
"""

from __future__ import annotations

import copy
import os
import shutil
from functools import cached_property
from pathlib import Path

import torch
from tensordict import TensorDictBase

from nip_like import cache_record, keys
from nip_like.agent_modules import AgentModules
from nip_like.errors import ConfigError
from nip_like.lm.actor_critic import lm_agent_modules
from nip_like.lm.frozen import FrozenSource, check_frozen_config, resolve
from nip_like.text.served import ServedAgent, check_served_agent
from nip_like.lm.local_models import FAMILIES as CHAT_FAMILIES
from nip_like.lm.local_models import build_chat_model_folder
from nip_like.lm.gguf import is_gguf
from nip_like.lm.models import (
    LMAgentConfig,
    agent_option,
    architecture_context,
    load_tokenizer,
    model_context,
    source_folder,
    template_stop_strings,
)
from nip_like.lm.policy import LMPolicy
from nip_like.lm.shared_models import build_policies, check_shared_models, policy_owners, warm_start_owners, with_shared_base
from nip_like.registry import typed_entry
from nip_like.scenarios.base import Scenario
from nip_like.scenarios.chat_prompts import ChatSpeaker

__all__ = ["LMAgents"]


class LMAgents(Scenario):
    """A scenario's language-model agents: one causal LM per agent, in the chat view or a token view.

    Everything that depends on the agents' configs: which model each agent
    plays with (:meth:`agent_configs`, :meth:`chat_agent_configs`), its
    tokenizer in the chat view (:attr:`chat_speakers`), the longest message
    (:attr:`message_tokens`), the checks before and after the data
    (:meth:`preflight`, :meth:`check_lengths`) and the agents themselves
    (:meth:`make_agents`). The config has ``agents``, ``default_agent`` and
    ``cache_dir``, and optionally ``view`` and ``shared_base``; the game
    gives each agent's chat-view system prompt, ``system_prompt(agent)``.
    """

    @property
    def chat_view(self) -> bool:
        """Whether the agents play in chat (``scenario.view=chat``) rather than over the game's symbols."""
        return self.config.get("view", "token") == "chat"

    def agent_config_path(self, name: str) -> str:
        """The config path that sets agent ``name``: ``scenario.agents.<name>`` or ``scenario.default_agent``."""
        return f"scenario.agents.{name}" if name in self.config.agents else "scenario.default_agent"

    def agent_configs(self) -> dict[str, LMAgentConfig]:
        """Each agent's language-model config (``scenario.agents.<name>`` or ``scenario.default_agent``).

        A frozen co-player's (``frozen_from``) comes with ``pretrained_path``
        set to the model folder it plays from (:func:`~nip_like.lm.frozen.resolve`).
        """
        configs = {
            name: typed_entry(LMAgentConfig, self.config.agents[name], f"scenario.agents.{name}")
            if name in self.config.agents
            else self.config.default_agent
            for name in self.agent_names
        }
        configs = {name: self._frozen_config(name, agent) if agent.frozen_from else agent for name, agent in configs.items()}
        configs = {name: self._sourced_config(name, agent) for name, agent in configs.items()}
        if self.config.get("shared_base"):
            configs = with_shared_base(configs)
        return configs

    @cached_property
    def _frozen_sources(self) -> dict[str, tuple[Path, FrozenSource]]:
        """Each frozen co-player's model folder and source, resolved on first use."""
        return {}

    def _frozen_config(self, name: str, agent: LMAgentConfig) -> LMAgentConfig:
        """``agent`` with ``pretrained_path`` set to the folder its ``frozen_from`` resolves to (resolved once)."""
        if name not in self._frozen_sources:
            where = self.agent_config_path(name)
            check_frozen_config(where, agent)
            source = agent.frozen_from
            if is_gguf(source):  # a GGUF file plays as the folder it converts to
                source = str(source_folder(source, f"{where}.frozen_from"))
            self._frozen_sources[name] = resolve(
                source, name, self.config.cache_dir, agent.frozen_checkpoint, f"{where}.frozen_from"
            )
        agent = copy.deepcopy(agent)
        agent.pretrained_path = str(self._frozen_sources[name][0])
        return agent

    @cached_property
    def _sources(self) -> dict[tuple[str, str, str | None], tuple[str, list[str]]]:
        """Each (agent, model source, chat template) -> the folder it plays from and the stop strings its template adds."""
        return {}

    def _sourced_config(self, name: str, agent: LMAgentConfig) -> LMAgentConfig:
        """``agent`` playing from a model folder: a ``.gguf`` source is converted (once, cached), and the
        stop strings its ``chat_template`` needs are added (:func:`~nip_like.lm.models.template_stop_strings`)."""
        source, template = agent.pretrained_path, agent_option(agent, "chat_template")
        if source is None or (not is_gguf(source) and not template):
            return agent
        key = (name, str(source), template)
        if key not in self._sources:
            where = f"{self.agent_config_path(name)}.pretrained_path"
            folder = source_folder(source, where)
            self._sources[key] = (str(folder), template_stop_strings(folder, template, where))
        folder, stops = self._sources[key]
        agent = copy.deepcopy(agent)
        agent.pretrained_path = folder
        agent.stop_strings = [*agent.stop_strings, *(stop for stop in stops if stop not in agent.stop_strings)]
        return agent

    def policy_owners(self) -> dict[str, str]:
        """Each agent -> the agent whose model it plays with (``share_policy_with``; itself when none)."""
        return policy_owners(self.agent_configs())

    def warm_start_owners(self) -> dict[str, str]:
        """Each agent -> the agent whose model it plays in the warm start (:func:`~nip_like.lm.shared_models.warm_start_owners`)."""
        return warm_start_owners(self.agent_configs())

    def frozen_agents(self) -> dict[str, FrozenSource]:
        """The frozen co-players (``frozen_from``) and where each one's weights come from."""
        self.agent_configs()
        return {name: source for name, (_, source) in self._frozen_sources.items()}

    @property
    def message_tokens(self) -> int:
        """``T``: the longest message an agent can send (its ``max_new_tokens``)."""
        return max(int(agent.max_new_tokens) for agent in self.agent_configs().values())

    @cached_property
    def chat_agent_configs(self) -> dict[str, LMAgentConfig]:
        """Each agent's config in the chat view, with the model folder it plays from.

        An agent without ``pretrained_path`` gets a small chat model of its
        ``architecture`` and sizes, with a byte-level BPE tokenizer of
        ``vocab_size`` trained offline (:func:`~nip_like.lm.local_models.build_chat_model_folder`),
        built once into ``<scenario.cache_dir>/chat_models/`` and reused.
        """
        configs = {}
        for name, agent in self.agent_configs().items():
            if agent.pretrained_path is None:
                agent = copy.deepcopy(agent)
                agent.pretrained_path = str(self._built_chat_model(agent, name))
                agent = self._sourced_config(name, agent)
            configs[name] = agent
        return configs

    def _built_chat_model(self, agent: LMAgentConfig, name: str) -> Path:
        where = self.agent_config_path(name)
        family = str(agent.architecture)
        if family not in CHAT_FAMILIES:
            raise ConfigError(
                f"{where}.architecture={family!r} cannot be built for the chat view; give one of {list(CHAT_FAMILIES)} "
                f"or a model folder in {where}.pretrained_path"
            )
        sizes = dict(
            vocab_size=int(agent.vocab_size), hidden_size=int(agent.hidden_size), num_layers=int(agent.num_layers),
            num_heads=int(agent.num_heads), intermediate_size=int(agent.intermediate_size),
        )
        if sizes["hidden_size"] % sizes["num_heads"]:
            raise ConfigError(f"{where}.hidden_size ({sizes['hidden_size']}) must be a multiple of num_heads ({sizes['num_heads']})")
        folder = Path(self.config.cache_dir).expanduser() / "chat_models" / "-".join(
            [family, *(f"{key}{value}" for key, value in sizes.items())]
        )
        built = not (folder / "config.json").is_file()
        if built:
            staging = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
            shutil.rmtree(staging, ignore_errors=True)
            build_chat_model_folder(staging, family, **sizes)
            if not (folder / "config.json").is_file():  # another process may have built it meanwhile
                shutil.rmtree(folder, ignore_errors=True)
                staging.rename(folder)
            shutil.rmtree(staging, ignore_errors=True)
        cache_record.record("chat model", folder.name, folder, built=built)
        return folder

    @cached_property
    def chat_speakers(self) -> list[ChatSpeaker]:
        """Each agent's tokenizer (from its model folder) and system prompt, for the chat view."""
        return [
            ChatSpeaker(name, load_tokenizer(agent.pretrained_path, chat_template=agent_option(agent, "chat_template")), self.system_prompt(name))
            for name, agent in self.chat_agent_configs.items()
        ]

    def preflight(self) -> None:
        """Check each agent's model folder (and, in the chat view, its chat template) and its sizes, without weights."""
        check_shared_models({name: (self.agent_config_path(name), agent) for name, agent in self.agent_configs().items()})
        for name, agent in self.agent_configs().items():
            where = self.agent_config_path(name)
            if agent.pretrained_path is None:
                context = architecture_context(str(agent.architecture), f"{where}.architecture")
            else:
                tokenizer = load_tokenizer(agent.pretrained_path, f"{where}.pretrained_path", agent_option(agent, "chat_template"))
                if self.chat_view:
                    ChatSpeaker(name, tokenizer, self.system_prompt(name))
                context = model_context(agent.pretrained_path)
            if context is not None and int(agent.max_new_tokens) >= context:
                raise ConfigError(
                    f"{where}.max_new_tokens ({agent.max_new_tokens}) is not below the context of the agent's model "
                    f"({context} tokens), which must also hold the prompt"
                )
            check_served_agent(where, agent, self.chat_view)  # a served agent's entry and its server
            budget = agent.max_tokens_per_micro_batch
            if budget is not None and budget <= int(agent.max_new_tokens):
                raise ConfigError(
                    f"{where}.max_tokens_per_micro_batch ({budget}) cannot hold one prompt plus a "
                    f"{agent.max_new_tokens}-token message"
                )

    def check_lengths(self, prompt_length: int) -> None:
        """Refuse, in one line, agents whose prompt plus message cannot fit their model or token budget.

        Parameters
        ----------
        prompt_length : int
            ``P``, the prompt width of the game's environment.
        """
        agents = self.chat_agent_configs if self.chat_view else self.agent_configs()
        for name, agent in agents.items():
            where = self.agent_config_path(name)
            longest = prompt_length + int(agent.max_new_tokens)
            budget = agent.max_tokens_per_micro_batch
            if budget is not None and budget < longest:
                raise ConfigError(
                    f"{where}.max_tokens_per_micro_batch ({budget}) is below one sequence of agent {name} "
                    f"({prompt_length} prompt + {agent.max_new_tokens} message tokens = {longest}): it must be at least {longest}"
                )
            if agent.pretrained_path is not None:
                context = model_context(agent.pretrained_path)
                if context is not None and longest > context:
                    raise ConfigError(
                        f"{where}.max_new_tokens ({agent.max_new_tokens}) plus the {prompt_length}-token prompt exceeds "
                        f"the context of the model in {agent.pretrained_path} ({context} tokens): at most "
                        f"{max(context - prompt_length, 0)}"
                    )

    # ------------------------------------------------------------------ agents
    def lm_agent_configs(self) -> dict[str, tuple[str, LMAgentConfig, int]]:
        """Each agent's config path and config, and in the chat view the vocabulary of its model folder."""
        return {
            name: (self.agent_config_path(name), agent, int(agent.vocab_size) if self.chat_view else 0)
            for name, agent in self.agent_configs().items()
        }

    def make_agents(self) -> AgentModules:
        """Build the agents (see :meth:`TensorGame.make_agents <nip_like.scenarios.base.TensorGame.make_agents>`).

        In the chat view each agent plays from its model folder with that
        folder's tokenizer; in the token view the game's own
        (:meth:`token_view_policies`).
        """
        check_shared_models({name: (self.agent_config_path(name), agent) for name, agent in self.agent_configs().items()})
        if self.chat_view:
            configs = self.chat_agent_configs
            tokenizers = {speaker.name: speaker.tokenizer for speaker in self.chat_speakers}
            modules = lm_agent_modules(self._with_sources(build_policies(configs, tokenizers)), self.message_tokens)
            modules.policy.attach_served({  # frozen agents played by a chat server (nip_like.text.served.ServedAgent)
                name: ServedAgent(agent.served, f"{self.agent_config_path(name)}.served", tokenizers[name], int(agent.max_new_tokens),
                                  float(agent.temperature), float(agent.top_p))
                for name, agent in configs.items() if agent_option(agent, "served") is not None
            })
            return modules
        return lm_agent_modules(self._with_sources(self.token_view_policies()), self.message_tokens)

    def token_view_policies(self) -> dict[str, LMPolicy]:
        """Each agent's policy in the token view, over the game's own tokenizer (a game without one refuses it)."""
        raise ConfigError(f"scenario {self.config.name}: its agents play in chat only (it has no token view)")

    def _with_sources(self, policies: dict[str, LMPolicy]) -> dict[str, LMPolicy]:
        """``policies`` with each frozen co-player's source recorded on its policy."""
        for name, source in self.frozen_agents().items():
            policies[name].frozen_source = source
        return policies

    def message_metrics(self, batch: TensorDictBase) -> dict[str, float]:
        """Each agent's mean message length (tokens, the end token included) and share of messages cut at the limit.

        As ``agents/<agent>/policy/message_tokens`` and
        ``agents/<agent>/policy/cut_messages`` of a collected batch (what a
        scenario's :meth:`~nip_like.scenarios.base.Scenario.policy_metrics` reports).
        """
        active = batch.get(keys.ACTIVE_KEY)
        mask = batch.get(keys.TOKEN_MASK_KEY)
        action = batch.get(keys.ACTION_KEY)
        # A message ended (was not cut) if it holds its agent's eos token or stops before the limit.
        eos = torch.tensor(self.end_token_ids(), device=action.device).view(-1, 1)
        finished = ((action == eos) & mask).any(-1) | ~mask.all(-1)
        metrics = {}
        for index, name in enumerate(self.agent_names):
            acted = active[..., index]
            if bool(acted.any()):
                metrics[f"agents/{name}/policy/message_tokens"] = mask[..., index, :][acted].sum(-1).float().mean().item()
                metrics[f"agents/{name}/policy/cut_messages"] = (~finished[..., index][acted]).float().mean().item()
        return metrics

    def end_token_ids(self) -> list[int]:
        """Each agent's end-of-message token: its chat tokenizer's eos, or in the token view the game's (``self.tokenizer``)."""
        if self.chat_view:
            return [speaker.eos_id for speaker in self.chat_speakers]
        return [self.tokenizer.eos_token_id] * len(self.agent_names)
