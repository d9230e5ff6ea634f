"""The duplicates scenario: language-model agents argue whether a list holds two equal values."""

from __future__ import annotations

import copy
import os
import shutil
from abc import abstractmethod
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from nip_like import keys
from nip_like.agents import AgentModules
from nip_like.allowed import checked
from nip_like.errors import ConfigError
from nip_like.folders import check_writable_folder
from nip_like.lm.agents import lm_agent_modules
from nip_like.lm.local_models import FAMILIES as CHAT_FAMILIES
from nip_like.lm.local_models import build_chat_model_folder
from nip_like.lm.models import LMAgentConfig, architecture_context, load_tokenizer, model_context
from nip_like.lm.frozen import FrozenSource, check_frozen_config, resolve
from nip_like.lm.policy import LMPolicy
from nip_like.lm.shared_models import build_policies, check_shared_models, policy_owners, warm_start_owners, with_shared_base
from nip_like.lm.tokenizer import build_tokenizer
from nip_like.registry import register_scenario, typed_entry
from nip_like.scenarios.base import Demonstrating, GeneratedData, ScenarioConfig, TensorGame
from nip_like.scenarios.decisions import check_proof_scenario, decision_metrics
from nip_like.scenarios.duplicates.data import (
    DuplicateLists,
    DuplicateSpec,
    cache_path,
    equal_pairs,
    generate_lists,
)
from nip_like.scenarios.duplicates.chat_view import (
    LIST_FORMATS,
    SYSTEM_PROMPTS,
    ChatSpeaker,
    DuplicatesChatViewEnv,
    parse_reply,
)
from nip_like.scenarios.duplicates.environment import (
    ACCEPT,
    REJECT,
    VERIFIER_VIEWS,
    DuplicatesEnv,
    DuplicateSymbols,
)

SPLITS = ("train", "val", "test")
#: How language-model agents play: over the game's own symbols, or in chat through their tokenizer's template.
VIEWS = ("token", "chat")


@dataclass
class DuplicatesDataConfig(ScenarioConfig):
    """The duplicates game's data and view, shared by its token and chat scenarios."""

    name: str = "duplicates"  # scenario name
    num_lists: int = checked(4000, ge=2)  # lists in the dataset, before the splits
    length: int = checked(8, ge=2, le=64)  # L, values in a list (at most num_values)
    num_values: int = checked(16, ge=2, le=256)  # V, the values are 0 .. V-1
    positive_fraction: float = checked(0.5, gt=0, lt=1)  # share of lists that hold a duplicate pair
    dataset_seed: int = checked(0, ge=0)  # seed of the dataset generator (the run's seed does not change the data)
    val_fraction: float = checked(0.1, gt=0, lt=1)  # share of lists in the validation split (periodic evaluation)
    test_fraction: float = checked(0.2, gt=0, lt=1)  # share of lists in the held-out test split
    cache_dir: str = "~/.cache/nip_like/datasets"  # where generated datasets are cached
    verifier_view: str = checked("cells", choices=VERIFIER_VIEWS)  # cells (only revealed cells) | full (the whole list)
    system_prompts: dict[str, str] = field(default_factory=lambda: dict(SYSTEM_PROMPTS))  # chat: the system prompt of each role (verifier, accept, reject); set one with scenario.system_prompts.verifier="..."
    list_format: str = checked("plain", choices=LIST_FORMATS)  # chat: plain ("list: 3 ? 7") | indexed ("list: 0=3 1=? 2=7") | seen ("list: 0=3 2=7")


@dataclass
class DecoyWeights:
    """How often the verifier's demonstrations show each kind of decoy (relative weights).

    A decoy is what a prover sends on a negative list in honest play (see
    :meth:`DuplicatesScenario.demonstrations`). The kinds differ in how many
    cells they reveal, so their mix decides what the verifier can learn: with
    few ``pair`` decoys, "two distinct cells were named" predicts *accept*
    almost as well as comparing the two values does, and a verifier that
    learns that shortcut accepts every list of a game whose prover always
    names two cells.
    """

    pair: float = checked(1.0, ge=0)  # two distinct cells (the later first, like a certificate)
    alone: float = checked(1.0, ge=0)  # one cell alone
    twice: float = checked(1.0, ge=0)  # one cell named twice


@dataclass
class DuplicatesConfig(DuplicatesDataConfig):
    """The duplicates scenario (see :mod:`nip_like.scenarios.duplicates.environment`)."""

    agents: dict[str, Any] = field(default_factory=dict)  # per-agent LMAgentConfig entries; others use default_agent
    default_agent: LMAgentConfig = field(default_factory=LMAgentConfig)  # the language model of agents not in agents
    view: str = checked("token", choices=VIEWS)  # token (the game's symbols, tiny models) | chat (any chat model folder: its template, free-text replies)
    quote_tokens: int = checked(32, ge=1)  # chat: tokens of a reply shown to the agents that read it
    max_prompt_tokens: int = checked(0, ge=0)  # chat: prompt width; 0 = the longest prompt the game can produce
    decoys: DecoyWeights = field(default_factory=DecoyWeights)  # the verifier's demonstrations: mix of decoy kinds
    shared_base: bool = False  # every agent of the game (but frozen co-players and agents with their own share_base_with or share_policy_with) shares the frozen base of the protocol's first agent, each with its own LoRA adapters (share_base_with)


def equal_pair_seen(values: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """``(B,)``: whether two distinct cells among the ``seen`` ones ``(B, L)`` hold equal ``values`` ``(B, L)``."""
    # Unseen cells get distinct values that no cell holds, so that only seen cells can make a pair.
    unseen = -1 - torch.arange(values.shape[-1], device=values.device)
    return equal_pairs(torch.where(seen, values, unseen)) > 0


def check_decoy_weights(weights: tuple[float, float, float]) -> None:
    """Refuse decoy weights (pair, alone, twice) that draw nothing, in one line."""
    if min(weights) < 0 or sum(weights) <= 0:
        raise ConfigError(f"scenario.decoys: the weights (pair, alone, twice) must be >= 0 with one > 0, got {tuple(weights)}")


def decoy_messages(
    count: int, length: int, generator: torch.Generator, weights: tuple[float, float, float] = (1.0, 1.0, 1.0)
) -> torch.Tensor:
    """``(count, 2)`` cells of messages that prove nothing unless by chance.

    Each is a random pair (the later cell first, like a certificate), one
    cell alone (second entry -1: the message is ``c<i> <eos>``) or one cell
    twice, drawn with the relative ``weights`` of these three kinds (equal
    weights: evenly, as the demonstrations of version 3 drew them).

    Raises
    ------
    ConfigError
        If no weight is positive.
    """
    check_decoy_weights(weights)
    # The later cell first, as in a certificate, so that the order of the names tells nothing.
    pair = torch.rand(count, length, generator=generator).argsort(-1)[:, :2].sort(-1, descending=True).values
    if len(set(weights)) == 1:
        kind = torch.randint(3, (count,), generator=generator)
    else:
        kind = torch.multinomial(torch.tensor(weights, dtype=torch.float64), count, replacement=True, generator=generator)
    pair[kind == 1, 1] = -1
    pair[kind == 2, 1] = pair[kind == 2, 0]
    return pair


class DuplicatesGame(GeneratedData):
    """The duplicates game without its agents: data, roles and the token game's environment.

    The base of :class:`DuplicatesScenario` (language-model agents, for the
    tensor trainers) and :class:`~nip_like.scenarios.duplicates.chat.DuplicatesChatScenario`
    (text agents, for the text trainers). The lists are generated once per
    generation config, cached and split like the graph data; periodic
    evaluation plays the validation split, the test loop the test split.

    A certificate task of your own on lists of values (docs: own_scenario)
    overrides what differs: :meth:`data_spec`, :meth:`split_fractions` and
    :meth:`generate` (the data), and, in :class:`DuplicatesScenario`,
    :meth:`~DuplicatesScenario.verifier_accepts`, :meth:`~DuplicatesScenario.decoys`
    and :meth:`~DuplicatesScenario.certificate_cells` (the warm start's honest play).
    """

    dataset_class = DuplicateLists
    split_names = SPLITS

    def __init__(self, config, protocol) -> None:
        super().__init__(config, protocol)
        check_proof_scenario(str(config.name), config, protocol)
        if config.length > config.num_values:
            raise ConfigError(
                f"scenario.length ({config.length}) must be at most scenario.num_values ({config.num_values}) "
                f"so that lists without a duplicate exist"
            )
        self.spec = self.data_spec()
        self.symbols = DuplicateSymbols(int(config.length), int(config.num_values), tuple(protocol.agent_names))
        check_writable_folder(Path(config.cache_dir), "scenario.cache_dir")
        unknown = sorted(set(config.system_prompts) - set(SYSTEM_PROMPTS))
        if unknown:
            raise ConfigError(f"scenario.system_prompts names {unknown}; allowed roles: {', '.join(SYSTEM_PROMPTS)}")

    # ------------------------------------------------------------------- roles
    def role(self, agent: str) -> str:
        """``"verifier"``, or the side a prover argues (``"accept"`` or ``"reject"``)."""
        if self.agent_names.index(agent) == self.protocol.verifier_index:
            return "verifier"
        return ACCEPT if self.protocol.prover_sides.get(agent, True) else REJECT

    def system_prompt(self, agent: str) -> str:
        """The system prompt of ``agent``'s role in chat (``scenario.system_prompts`` overrides the default)."""
        role = self.role(agent)
        return str(self.config.system_prompts.get(role, SYSTEM_PROMPTS[role]))

    # -------------------------------------------------------------------- data
    def data_spec(self) -> DuplicateSpec:
        """What :meth:`generate` draws, from the config (called once, in ``__init__``, as ``self.spec``).

        Its ``key()`` names the data's cache file. A subclass returns a spec
        of its own (a subclass of :class:`~nip_like.scenarios.duplicates.data.DuplicateSpec`
        with more fields, say) when its data depend on options the default
        spec does not hold.
        """
        config = self.config
        return DuplicateSpec(
            num_lists=int(config.num_lists),
            length=int(config.length),
            num_values=int(config.num_values),
            seed=int(config.dataset_seed),
            positive_fraction=float(config.positive_fraction),
        )

    def generate(self, spec: DuplicateSpec) -> DuplicateLists:
        """Draw the whole dataset of ``spec`` (before the splits); the same spec must give the same lists.

        The contract: ``spec.num_lists`` lists of ``spec.length`` values in
        ``0 .. spec.num_values-1``, each with its exact ``label`` (the claim
        the verifier decides holds) and, for a positive list, the
        ``certificate``: the two cells whose values prove it (``(-1, -1)``
        for a negative list). Draw everything from ``spec.seed``. By default,
        lists with or without one duplicate pair
        (:func:`~nip_like.scenarios.duplicates.data.generate_lists`).
        """
        return generate_lists(spec)

    def base_cache_path(self) -> Path:
        """The data's cache file: ``duplicate_lists_<spec key>.pt`` in ``scenario.cache_dir``."""
        return cache_path(self.spec, Path(self.config.cache_dir).expanduser())

    def check_dataset(self, data: DuplicateLists, path: Path) -> None:
        length, values = int(self.config.length), int(self.config.num_values)
        if data.values.shape[1] != length or int(data.values.max()) >= values:
            raise ConfigError(
                f"{path} holds lists of {data.values.shape[1]} values up to {int(data.values.max())}; "
                f"this run's game has lists of {length} values in 0..{values - 1}"
            )

    @cached_property
    def tokenizer(self):
        """The word-level tokenizer of the game's symbols (the token agents' shared tokenizer)."""
        return build_tokenizer(self.symbols.alphabet())

    @property
    @abstractmethod
    def message_tokens(self) -> int:
        """``T``: the longest message an agent can send, in the game's symbols."""

    def make_env(
        self, num_envs: int, split: str, seed: int, device: torch.device | str, group_size: int = 1
    ) -> DuplicatesEnv:
        common = dict(
            verifier_view=str(self.config.verifier_view), num_envs=num_envs, device=device, seed=seed, group_size=group_size
        )
        game_ids = self.symbols.ids(self.tokenizer)
        env = self.game_env(self.split(split), game_ids, common)
        self.check_lengths(env.prompt_length)
        return env

    @cached_property
    def reading_env(self) -> DuplicatesEnv:
        """An environment of the scenario (one episode of the evaluation split), whose parser :meth:`parse_messages` uses."""
        return self.make_env(1, self.eval_split, 0, "cpu")

    def parse_messages(self, messages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Which two cells ``(..., T)`` stored messages (``("state", "messages")``) name: the environment's own parser.

        The transcripts read the cells a message revealed with it, so they
        show what the game did: :meth:`DuplicatesEnv.named_cells
        <nip_like.scenarios.duplicates.environment.DuplicatesEnv.named_cells>`
        of the environment :meth:`game_env` builds (a subclass that changes how
        messages are read overrides that method of its environment, not this one).
        """
        return self.reading_env.named_cells(messages)

    def game_env(self, lists: DuplicateLists, game_ids: dict[str, int], common: dict[str, Any]) -> DuplicatesEnv:
        """The environment of :meth:`make_env` on ``lists``: the token game (``common``: its shared options)."""
        return DuplicatesEnv(
            self.protocol,
            lists,
            game_ids,
            vocab_size=len(self.tokenizer),
            message_tokens=self.message_tokens,
            **common,
        )

    def check_lengths(self, prompt_length: int) -> None:
        """Refuse, in one line, agents whose prompt plus message cannot fit (nothing to check by default).

        Parameters
        ----------
        prompt_length : int
            ``P``, the prompt width of the game's environment.
        """


@register_scenario("duplicates", DuplicatesConfig)
class DuplicatesScenario(DuplicatesGame, TensorGame, Demonstrating):
    """Decide whether a list holds a duplicate pair, seeing only the cells that messages name.

    The agents are causal language models (one per agent, built from
    ``scenario.default_agent`` or ``scenario.agents.<name>``) sharing a
    word-level tokenizer of the game's symbols (``scenario.view=token``), or
    playing in chat through their own tokenizers (``scenario.view=chat``).
    """

    #: Version of :meth:`demonstrations` (part of the warm-start cache key): 3 = sound verifier, decoys
    #: named in a certificate's order.
    pretrain_data_version = 3

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

    def game_env(self, lists: DuplicateLists, game_ids: dict[str, int], common: dict[str, Any]) -> DuplicatesEnv:
        """The token game, or in the chat view the game rendered through each agent's chat template."""
        if not self.chat_view:
            return super().game_env(lists, game_ids, common)
        return DuplicatesChatViewEnv(
            self.protocol,
            lists,
            game_ids,
            self.chat_speakers,
            num_values=self.symbols.num_values,
            reply_tokens=self.message_tokens,
            quote_tokens=int(self.config.quote_tokens),
            prompt_tokens=int(self.config.max_prompt_tokens),
            list_format=self.config.list_format,
            **common,
        )

    def preflight(self) -> None:
        """Check the decoy weights, each agent's model folder (and, in the chat view, its chat template) and its sizes, without weights."""
        decoys = self.config.decoys
        check_decoy_weights((float(decoys.pair), float(decoys.alone), float(decoys.twice)))
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

    # ----------------------------------------------------------------- metrics
    def policy_metrics(self, batch: TensorDictBase) -> dict[str, float]:
        """Each agent's mean message length (tokens, ``<eos>`` included) and share of messages cut at the limit."""
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

    def episode_metrics(self, episodes: TensorDictBase) -> dict[str, float]:
        """Verifier accuracy, decision rate, precision, recall, length, and each prover's certificate rate.

        ``decided``: share of episodes that ended with a decision (the rest
        ran out of turns: wrong). ``agents/<prover>/certificates``: share of
        the positive lists on which the prover named the duplicate pair.
        """
        metrics = super().episode_metrics(episodes)
        state = episodes.get("state")
        metrics.update(decision_metrics(state["decision"], state["label"], state["list_index"]))
        metrics["decided"] = (state["decision"] >= 0).float().mean().item()
        metrics["episode_length"] = state["round"].float().mean().item()
        positive = state["label"]
        if bool(positive.any()):
            certificate = state["certificate"][positive].clamp(min=0)  # (E+, 2)
            revealed = state["revealed"][positive]  # (E+, N, L)
            index = certificate.unsqueeze(1).expand(-1, revealed.shape[1], 2)
            named = revealed.gather(-1, index).all(-1)  # (E+, N)
            for agent, name in enumerate(self.agent_names):
                if agent != self.protocol.verifier_index:
                    metrics[f"agents/{name}/certificates"] = named[:, agent].float().mean().item()
        return metrics

    def transcripts(self, episodes: TensorDictBase, limit: int) -> list[dict]:
        """The dialogues of up to ``limit`` episodes, as text (see :meth:`Scenario.transcripts`).

        Each record: ``list_index``, ``values``, ``label``, ``certificate``,
        ``turns`` (each message with its round, speaker, text and the cells it
        revealed with their values), ``decision`` (``accept``, ``reject`` or
        ``none``), ``correct`` and each agent's ``rewards`` (episode return).
        """
        state = episodes.get("state")[:limit].cpu()
        returns = episodes.get(keys.EPISODE_RETURN_KEY)[:limit].squeeze(-1).cpu()
        pad = self.tokenizer.pad_token_id
        names, first, second = (part.cpu() for part in self.parse_messages(state["messages"]))
        records = []
        for episode in range(state.batch_size[0]):
            values = state["values"][episode]
            turns = []
            for round_index in range(state["messages"].shape[1]):
                for agent, name in enumerate(self.agent_names):
                    message = state["messages"][episode, round_index, agent]
                    if self.chat_view:
                        length = int(state["reply_length"][episode, round_index, agent])
                        if length < 0:
                            continue
                        reply = state["replies"][episode, round_index, agent, :length].tolist()
                        text = self.chat_speakers[agent].tokenizer.decode(reply, skip_special_tokens=True)
                    elif bool((message == pad).all()):
                        continue
                    else:
                        text = " ".join(self.tokenizer.convert_ids_to_tokens(message[message != pad].tolist()))
                    revealed = []
                    if bool(names[episode, round_index, agent]):
                        cells = (int(first[episode, round_index, agent]), int(second[episode, round_index, agent]))
                        revealed = [[cell, int(values[cell])] for cell in cells]
                    turns.append({"round": round_index, "agent": name, "message": text, "revealed": revealed})
            decision = int(state["decision"][episode])
            label = bool(state["label"][episode])
            records.append(
                {
                    "list_index": int(state["list_index"][episode]),
                    "values": values.tolist(),
                    "label": label,
                    "certificate": state["certificate"][episode].tolist(),
                    "turns": turns,
                    "decision": {1: "accept", 0: "reject"}.get(decision, "none"),
                    "correct": decision >= 0 and bool(decision) == label,
                    "rewards": {name: float(returns[episode, agent]) for agent, name in enumerate(self.agent_names)},
                }
            )
        return records

    # ------------------------------------------------------ demonstrations
    def verifier_accepts(self, values: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        """The sound decision rule the verifier's demonstrations follow in the ``cells`` view: ``(B,)`` bool.

        The contract: accept only when the ``seen`` cells ``(B, L)`` of the
        lists ``values`` ``(B, L)`` prove the claim (sound: no decoy can make
        it accept a negative list), and whenever they hold the cells of the
        honest certificate (:meth:`certificate_cells`; complete). By default:
        two distinct seen cells hold equal values (:func:`equal_pair_seen`).
        In the ``full`` view the verifier reads the whole list and is shown the label.
        """
        return equal_pair_seen(values, seen)

    def decoys(self, count: int, length: int, generator: torch.Generator) -> torch.Tensor:
        """``(count, 2)`` cells of the messages a prover sends when it has no certificate to give.

        The contract: cells in ``0 .. length-1``, a second entry of ``-1``
        for a message that names one cell alone; draw only from
        ``generator``. Good decoys look like certificates in every way but
        the values (the verifier's demonstrations teach it to reject them),
        so that it learns to check the values, not a shortcut. By default
        :func:`decoy_messages` with the weights of ``scenario.decoys``.
        """
        weights = self.config.decoys
        return decoy_messages(count, length, generator, (weights.pair, weights.alone, weights.twice))

    def certificate_cells(self, certificate: torch.Tensor) -> torch.Tensor:
        """``(B, 2)`` cells an honest prover names, in order, for the datasets' ``certificate`` ``(B, 2)`` of positive lists.

        By default the later cell first (``c<j> c<i>`` for ``i < j``: a causal
        model reading cell ``j`` has already seen cell ``i``).
        """
        return certificate.clamp(min=0).flip(-1)

    def demonstration_agents(self) -> list[str]:
        """The agents :meth:`demonstrations` gives messages for: the verifier and the accept-side provers."""
        return [
            name
            for index, name in enumerate(self.agent_names)
            if index == self.protocol.verifier_index or self.protocol.prover_sides.get(name, True)
        ]

    def demonstrations(self, split: str, seed: int = 0) -> dict[str, TensorDictBase]:
        """Honest play on every list of ``split``, as (prompt, message) pairs per agent, for a warm start.

        The scripted play: a prover arguing for *accept* names the cells of
        :meth:`certificate_cells` of a positive list (the duplicate pair, the
        later cell first: ``c<j> c<i> <eos>``); on a negative list, and
        always for a prover arguing for *reject*, it sends one of
        :meth:`decoys` (by default a random pair, the later cell first, as in
        a certificate, so that the order of the names tells the verifier
        nothing, one cell alone, or one cell twice, drawn with the weights of
        ``scenario.decoys``). The verifier passes (the empty message
        ``<eos>``) before its last turn and then decides as a sound verifier
        does: in the ``cells`` view it says ``accept <eos>`` exactly when
        :meth:`verifier_accepts` the cells it has seen (by default: two of
        them hold equal values), so decoys and lone cells are rejected
        whatever the label; in the ``full`` view it decides by the label (it
        reads the whole list). Every list is played once, through the
        environment's own prompts and rules (its public ``new_state``,
        ``policy_inputs``, ``scripted_replies`` and ``advance``), so a subclass
        that overrides these hooks never copies this method.

        Returns
        -------
        dict of str to TensorDict
            For each agent with demonstrations (the verifier on every list, an
            accept-side prover on the positive lists, a reject-side prover on
            none: it has no certificate to give):
            batch ``(E,)`` with ``"prompt_ids"``/``"prompt_mask"`` ``(E, P)``
            and ``"tokens"``/``"token_mask"`` ``(E, T)``.
        """
        env = self.make_env(1, split, 0, "cpu")
        if env.message_tokens < 3:
            raise ConfigError(
                f"demonstrations need messages of at least 3 tokens (two cells and <eos>); "
                f"scenario.default_agent.max_new_tokens is {env.message_tokens}"
            )
        lists = self.split(split)
        count, ids = len(lists), env.ids
        generator = torch.Generator().manual_seed(seed)
        state = env.new_state(count)
        state["list_index"] = torch.arange(count)
        state["values"], state["label"], state["certificate"] = lists.values, lists.label, lists.certificate
        state.update(self.protocol.initial_state(count, generator))
        state["round"] = torch.zeros(count, dtype=torch.int64)
        state["group_id"] = torch.arange(count)
        eos, pad, tokens = self.tokenizer.eos_token_id, ids["pad"], env.message_tokens
        collected: dict[str, list[dict[str, torch.Tensor]]] = {name: [] for name in self.agent_names}
        playing = torch.ones(count, dtype=torch.bool)
        alone = len(self.agent_names) == 1
        for _ in range(self.protocol.num_rounds):
            active = self.protocol.active_agents_in(state) & playing.unsqueeze(-1)
            inputs = env.policy_inputs(state)
            action = torch.full((count, self.protocol.num_agents, tokens), pad, dtype=torch.int64)
            shown_by = {}
            for index, name in enumerate(self.agent_names):
                if index == self.protocol.verifier_index:
                    deciding = self.protocol.decision_round(state["round"])
                    if env.verifier_view == "full":
                        proven = state["label"]
                    else:
                        proven = self.verifier_accepts(state["values"], env.visible_cells(state)[:, index])
                    decision = torch.where(proven, ids["accept"], ids["reject"])
                    action[:, index, 0] = torch.where(deciding, decision, eos)
                    action[:, index, 1] = torch.where(deciding, eos, pad)
                    if alone:
                        # Without a prover (solo_opening), the verifier opens a random pair itself before deciding.
                        pair = torch.rand(count, env.length, generator=generator).argsort(-1)[:, :2]
                        opening = torch.cat([ids["cell0"] + pair, torch.full_like(pair[:, :1], eos)], -1)
                        action[:, index, :3] = torch.where(deciding.unsqueeze(-1), action[:, index, :3], opening)
                    shown = active[:, index]
                else:
                    proves = self.protocol.prover_sides.get(name, True) & state["label"]
                    certificate = self.certificate_cells(state["certificate"])
                    message = self.decoys(count, env.length, generator)
                    message[proves, 0] = certificate[proves, 0]
                    message[proves, 1] = certificate[proves, 1]
                    action[:, index, :2] = torch.where(message >= 0, ids["cell0"] + message, eos)
                    action[:, index, 2] = torch.where(message[:, 1] >= 0, eos, pad)
                    shown = active[:, index] & proves
                shown_by[name] = shown
            # The moves as the agents would send them (in the chat view: text in their own tokens).
            replies, reply_mask = env.scripted_replies(torch.where(active.unsqueeze(-1), action, pad))
            for index, name in enumerate(self.agent_names):
                shown = shown_by[name]
                if bool(shown.any()):
                    collected[name].append(
                        {
                            "prompt_ids": inputs["prompt_ids"][shown, index],
                            "prompt_mask": inputs["prompt_mask"][shown, index],
                            "tokens": replies[shown, index],
                            "token_mask": reply_mask[shown, index],
                        }
                    )
            state, _, ended = env.advance(state, replies, active)
            state["round"] = state["round"] + 1
            playing = playing & ~ended
            if not bool(playing.any()):
                break
        return {
            name: TensorDict(
                {key: torch.cat([part[key] for part in parts]) for key in parts[0]},
                batch_size=[sum(part["tokens"].shape[0] for part in parts)],
            )
            for name, parts in collected.items()
            if parts
        }
