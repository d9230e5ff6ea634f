"""The duplicates game without its agents: its data config, data, roles and the token game's environment.

:class:`DuplicatesGame` is shared by the language-model scenario
(:class:`~nip_like.scenarios.duplicates.scenario.DuplicatesScenario`) and the
chat scenario of text agents
(:class:`~nip_like.scenarios.duplicates.chat.DuplicatesChatScenario`); it
builds no agent. This module registers nothing.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from nip_like.allowed import checked
from nip_like.errors import ConfigError
from nip_like.folders import check_writable_folder
from nip_like.lm.tokenizer import build_tokenizer
from nip_like.scenarios.base import GeneratedData, ScenarioConfig
from nip_like.scenarios.decisions import check_proof_scenario
from nip_like.scenarios.duplicates.chat_text import LIST_FORMATS, SYSTEM_PROMPTS
from nip_like.scenarios.duplicates.data import DuplicateLists, DuplicateSpec, cache_path, generate_lists
from nip_like.scenarios.duplicates.environment import ACCEPT, REJECT, VERIFIER_VIEWS, DuplicatesEnv, DuplicateSymbols

__all__ = ["SPLITS", "DuplicatesDataConfig", "DuplicatesGame"]

SPLITS = ("train", "val", "test")


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


class DuplicatesGame(GeneratedData):
    """The duplicates game without its agents: data, roles and the token game's environment.

    The base of :class:`~nip_like.scenarios.duplicates.scenario.DuplicatesScenario`
    (language-model agents, for the tensor trainers) and
    :class:`~nip_like.scenarios.duplicates.chat.DuplicatesChatScenario` (text agents, for the text trainers). The lists are generated once per
    generation config, cached and split like the graph data; periodic
    evaluation plays the validation split, the test loop the test split.

    A certificate task of your own on lists of values (docs: own_scenario)
    overrides what differs: :meth:`data_spec`, :meth:`split_fractions` and
    :meth:`generate` (the data), and, in
    :class:`~nip_like.scenarios.duplicates.scenario.DuplicatesScenario`,
    :meth:`~nip_like.scenarios.duplicates.scenario.DuplicatesScenario.verifier_accepts`,
    :meth:`~nip_like.scenarios.duplicates.scenario.DuplicatesScenario.decoys` and
    :meth:`~nip_like.scenarios.duplicates.scenario.DuplicatesScenario.certificate_cells`
    (the warm start's honest play).
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

