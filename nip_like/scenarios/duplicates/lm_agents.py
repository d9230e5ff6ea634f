"""The duplicates game's language-model agents: their configs, models, tokenizers and size checks.

:class:`DuplicatesLMAgents` resolves each agent's
:class:`~nip_like.lm.models.LMAgentConfig` (``scenario.agents.<name>`` or
``scenario.default_agent``; frozen co-players, shared models, a shared base),
builds the small chat models of the chat view, checks prompts and messages
against each model's context and token budget, and builds the agents. It is
the base of :class:`~nip_like.scenarios.duplicates.scenario.DuplicatesScenario`.
This module registers nothing.
"""

from __future__ import annotations

import copy
import os
import shutil
from functools import cached_property
from pathlib import Path

from nip_like.agents import AgentModules
from nip_like.errors import ConfigError
from nip_like.lm.agents import lm_agent_modules
from nip_like.lm.frozen import FrozenSource, check_frozen_config, resolve
from nip_like.lm.local_models import FAMILIES as CHAT_FAMILIES
from nip_like.lm.local_models import build_chat_model_folder
from nip_like.lm.models import LMAgentConfig, architecture_context, load_tokenizer, model_context
from nip_like.lm.policy import LMPolicy
from nip_like.lm.shared_models import build_policies, check_shared_models, policy_owners, warm_start_owners, with_shared_base
from nip_like.registry import typed_entry
from nip_like.scenarios.duplicates.chat_text import ChatSpeaker
from nip_like.scenarios.duplicates.game import DuplicatesGame

__all__ = ["DuplicatesLMAgents"]


class DuplicatesLMAgents(DuplicatesGame):
    """The duplicates game with language-model agents: one causal LM per agent, in the token or the chat view.

    Everything that depends on the agents' configs: which model each agent
    plays with (:meth:`agent_configs`, :meth:`chat_agent_configs`), its
    tokenizer in the chat view (:attr:`chat_speakers`), the longest message
    (:attr:`message_tokens`), the checks before and after the data
    (:meth:`preflight`, :meth:`check_lengths`) and the agents themselves
    (:meth:`make_agents`).
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
            self._frozen_sources[name] = resolve(
                agent.frozen_from, name, self.config.cache_dir, agent.frozen_checkpoint, f"{where}.frozen_from"
            )
        agent = copy.deepcopy(agent)
        agent.pretrained_path = str(self._frozen_sources[name][0])
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
        if not (folder / "config.json").is_file():
            staging = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
            shutil.rmtree(staging, ignore_errors=True)
            build_chat_model_folder(staging, family, **sizes)
            if not (folder / "config.json").is_file():  # another process may have built it meanwhile
                shutil.rmtree(folder, ignore_errors=True)
                staging.rename(folder)
            shutil.rmtree(staging, ignore_errors=True)
        return folder

    @cached_property
    def chat_speakers(self) -> list[ChatSpeaker]:
        """Each agent's tokenizer (from its model folder) and system prompt, for the chat view."""
        return [
            ChatSpeaker(name, load_tokenizer(agent.pretrained_path), self.system_prompt(name))
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
                tokenizer = load_tokenizer(agent.pretrained_path, f"{where}.pretrained_path")
                if self.chat_view:
                    ChatSpeaker(name, tokenizer, self.system_prompt(name))
                context = model_context(agent.pretrained_path)
            if context is not None and int(agent.max_new_tokens) >= context:
                raise ConfigError(
                    f"{where}.max_new_tokens ({agent.max_new_tokens}) is not below the context of the agent's model "
                    f"({context} tokens), which must also hold the prompt"
                )
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

        In the token view, an agent with a model folder must carry the game's own tokenizer.
        """
        check_shared_models({name: (self.agent_config_path(name), agent) for name, agent in self.agent_configs().items()})
        if self.chat_view:
            configs = self.chat_agent_configs
            tokenizers = {speaker.name: speaker.tokenizer for speaker in self.chat_speakers}
            return lm_agent_modules(self._with_sources(build_policies(configs, tokenizers)), self.message_tokens)
        configs = self.agent_configs()
        tokenizers = {name: self.tokenizer if agent.pretrained_path is None else None for name, agent in configs.items()}
        policies = self._with_sources(build_policies(configs, tokenizers))
        for name, agent in configs.items():
            if agent.pretrained_path is not None and policies[name].tokenizer.get_vocab() != self.tokenizer.get_vocab():
                raise ConfigError(
                    f"agent {name}: the tokenizer in {agent.pretrained_path} is not the duplicates game's "
                    f"(length {self.symbols.length}, {self.symbols.num_values} values, agents {list(self.symbols.agents)})"
                )
        return lm_agent_modules(policies, self.message_tokens)

    def _with_sources(self, policies: dict[str, LMPolicy]) -> dict[str, LMPolicy]:
        """``policies`` with each frozen co-player's source recorded on its policy."""
        for name, source in self.frozen_agents().items():
            policies[name].frozen_source = source
        return policies

    def end_token_ids(self) -> list[int]:
        """Each agent's end-of-message token: its chat tokenizer's eos, or the game's ``<eos>``."""
        if self.chat_view:
            return [speaker.eos_id for speaker in self.chat_speakers]
        return [self.tokenizer.eos_token_id] * len(self.agent_names)
