"""The code-validation game without its agents: its data config, data, splits, roles, prompts and environments.

:class:`CodeValidationGame` is the base of the registered scenario
(:class:`~nip_like.scenarios.code_validation.scenario.CodeValidationScenario`),
whose text agents (:mod:`~nip_like.scenarios.code_validation.text_agents`) and
language-model agents (:class:`~nip_like.scenarios.lm_agents.LMAgents`) both
play it. The data is the generated family of
:mod:`~nip_like.scenarios.code_validation.data` (cached under
``scenario.cache_dir``) or a Buggy-APPS JSONL file (``scenario.data_file``),
cut into splits by problem, so that no problem of the test split was seen in
training. This module registers nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from nip_like.allowed import checked
from nip_like.errors import ConfigError
from nip_like.folders import check_writable_folder
from nip_like.lm.tokenizer import build_tokenizer
from nip_like.scenarios.base import GeneratedData, ScenarioConfig
from nip_like.scenarios.code_validation.buggy_apps import read_buggy_apps
from nip_like.scenarios.code_validation.chat_text import (
    ACCEPT,
    LAST_TURN_NOTICE,
    REJECT,
    ROLES,
    datapoint_text,
    default_system_prompt,
)
from nip_like.scenarios.code_validation.data import (
    CodeValidationData,
    CodeValidationSpec,
    cache_path,
    generate_programs,
    load_buggy_apps,
    split_by_problem,
)
from nip_like.scenarios.code_validation.environment import MOVE_SYMBOLS, CodeValidationEnv
from nip_like.scenarios.code_validation.problems import all_problems
from nip_like.scenarios.code_validation.sandbox import SandboxLimits
from nip_like.scenarios.datasets import DatasetFileError, load_or_build
from nip_like.scenarios.decisions import check_proof_scenario

__all__ = ["SPLITS", "CodeValidationDataConfig", "CodeValidationGame"]

SPLITS = ("train", "val", "test")
#: The number of problems in the generated family (the most ``num_problems`` can be).
FAMILY_SIZE = len(all_problems())
#: How the programs of a ``data_file`` are labelled.
LABEL_BY = ("tests", "field")


@dataclass
class CodeValidationDataConfig(ScenarioConfig):
    """The code-validation game's data and prompts (the options that do not depend on the agents)."""

    name: str = "code_validation"  # scenario name
    num_problems: int = checked(60, ge=2, le=FAMILY_SIZE)  # problems of the generated family (at most 115), cut into the splits
    correct_per_problem: int = checked(2, ge=1)  # rewritten copies of each problem's reference solution
    mutants_per_problem: int = checked(3, ge=1)  # buggy variants (AST mutations) of each reference
    tests_per_problem: int = checked(12, ge=1)  # hidden tests per problem: every program is labelled by running them
    dataset_seed: int = checked(0, ge=0)  # seed of the dataset generator (the run's seed does not change the data)
    test_time_limit: float = checked(0.1, gt=0)  # CPU seconds a program may spend on one hidden test while it is labelled
    time_limit: float = checked(5.0, gt=0)  # wall-clock seconds of one program's whole labelling run
    memory_mib: int = checked(256, ge=64)  # address-space limit of a program's process while it is labelled, in MiB
    data_file: Optional[str] = None  # a JSONL file in the Buggy-APPS layout to play instead of the generated family (docs: code_validation_data)
    label_by: str = checked("tests", choices=LABEL_BY)  # data_file: tests (run every program against its problem's tests) | field (trust the file's solutions / buggy_solutions)
    max_tests_per_problem: int = checked(0, ge=0)  # data_file: run only the first this many tests of a problem; 0 = all
    workers: int = checked(2, ge=1)  # programs labelled at once (threads, each program in its own process); the data do not depend on it
    val_fraction: float = checked(0.1, gt=0, lt=1)  # share of the problems in the validation split (periodic evaluation)
    test_fraction: float = checked(0.2, gt=0, lt=1)  # share of the problems in the held-out test split
    cache_dir: str = "~/.cache/nip_like/datasets"  # where the labelled dataset is cached
    system_prompts: dict[str, Optional[str]] = field(default_factory=lambda: dict.fromkeys(ROLES))  # the system prompt of a role (verifier, accept, reject); null = the protocol's default; set one with scenario.system_prompts.verifier="..."


class CodeValidationGame(GeneratedData):
    """The code-validation game without its agents: data, splits, roles, prompts and the move game.

    Every interactive-proof protocol in which provers talk to the verifier
    plays it, and so does the baseline without provers, ``solo_verifier``; a
    protocol whose verifier takes several turns alone (``solo_opening``) has
    nothing to open here and is refused, as are the zero-knowledge versions.
    """

    dataset_class = CodeValidationData
    split_names = SPLITS

    def __init__(self, config, protocol) -> None:
        super().__init__(config, protocol)
        check_proof_scenario(str(config.name), config, protocol)
        provers = [name for name in protocol.agent_names if name != "verifier"]
        if not provers and protocol.num_rounds > 1:
            raise ConfigError(
                f"scenario {config.name} gives a verifier without provers nothing to open: protocol {protocol.name} "
                f"has it speak {protocol.num_rounds} times alone; use protocol=solo_verifier"
            )
        unknown = sorted(set(config.system_prompts) - set(ROLES))
        if unknown:
            raise ConfigError(f"scenario.system_prompts names {unknown}; allowed roles: {', '.join(ROLES)}")
        self.spec = self.data_spec()
        check_writable_folder(Path(config.cache_dir).expanduser(), "scenario.cache_dir")

    def preflight(self) -> None:
        """Refuse, in one line, a ``data_file`` that is missing or not in the Buggy-APPS layout (read, nothing run)."""
        super().preflight()
        if self.config.data_file is not None:
            self.read_data_file()

    # ------------------------------------------------------------------- roles
    def role(self, agent: str) -> str:
        """``"verifier"``, or the side a prover argues (``"accept"`` or ``"reject"``)."""
        if self.agent_names.index(agent) == self.protocol.verifier_index:
            return "verifier"
        return ACCEPT if self.protocol.prover_sides.get(agent, True) else REJECT

    def system_prompt(self, agent: str) -> str:
        """The system prompt of ``agent``'s role (``scenario.system_prompts`` overrides the protocol's default)."""
        role = self.role(agent)
        if self.config.system_prompts.get(role) is not None:
            return str(self.config.system_prompts[role])
        return default_system_prompt(role, self.protocol, agent)

    def last_turn_prompt(self) -> str:
        """The verifier's system prompt on its last turn: its prompt, then the notice that it must decide now."""
        return f"{self.system_prompt(self.agent_names[self.protocol.verifier_index])} {LAST_TURN_NOTICE}"

    # -------------------------------------------------------------------- data
    def data_spec(self) -> CodeValidationSpec:
        """The generated family's spec, from the config (its ``key()`` names the cache file)."""
        config = self.config
        return CodeValidationSpec(
            num_problems=int(config.num_problems),
            correct_per_problem=int(config.correct_per_problem),
            mutants_per_problem=int(config.mutants_per_problem),
            tests_per_problem=int(config.tests_per_problem),
            seed=int(config.dataset_seed),
            test_time_limit=float(config.test_time_limit),
            time_limit=float(config.time_limit),
            memory_mib=int(config.memory_mib),
        )

    def generate(self, spec: CodeValidationSpec) -> CodeValidationData:
        """Build the generated family's dataset of ``spec``, every program labelled by running its hidden tests."""
        return generate_programs(spec, workers=int(self.config.workers))

    def base_cache_path(self) -> Path:
        """The generated data's cache file: ``code_validation_<spec key>.pt`` in ``scenario.cache_dir``."""
        return cache_path(self.spec, Path(self.config.cache_dir).expanduser())

    def read_data_file(self) -> None:
        """Check ``scenario.data_file``'s layout without running anything; a one-line ``ConfigError`` if it is wrong."""
        path = Path(str(self.config.data_file)).expanduser()
        if not path.is_file():
            raise ConfigError(f"scenario.data_file: {path} is not a file")
        try:
            read_buggy_apps(path)
        except DatasetFileError as error:
            raise ConfigError(f"scenario.data_file is not a Buggy-APPS JSONL file: {error}") from None

    def dataset(self) -> CodeValidationData:
        """The whole dataset: ``scenario.data_file``, labelled (and cached), or the generated family (cached)."""
        config = self.config
        if config.data_file is None:
            spec = self.spec
            return load_or_build(CodeValidationData, self.data_cache_path(), spec, lambda: self.generate(spec))
        limits = SandboxLimits(
            time_limit=float(config.time_limit), test_time_limit=float(config.test_time_limit), memory_mib=int(config.memory_mib)
        )
        try:
            return load_buggy_apps(
                Path(str(config.data_file)).expanduser(),
                Path(config.cache_dir).expanduser(),
                label_by=str(config.label_by),
                max_tests_per_problem=int(config.max_tests_per_problem),
                limits=limits,
                workers=int(config.workers),
            )
        except DatasetFileError as error:
            raise ConfigError(f"scenario.data_file is not a Buggy-APPS JSONL file: {error}") from None

    def splits(self) -> dict[str, CodeValidationData]:
        """The splits, cut by problem (:func:`~nip_like.scenarios.code_validation.data.split_by_problem`), each non-empty."""
        if self._splits is None:
            splits = split_by_problem(self.dataset(), self.split_fractions(), seed=int(self.config.dataset_seed))
            empty = [name for name, split in splits.items() if len(split) == 0]
            if empty:
                problems = len({p.problem_id for split in splits.values() for p in split.programs})
                more = "scenario.num_problems" if self.config.data_file is None else "the problems of scenario.data_file"
                raise ConfigError(
                    f"the code-validation data has {problems} problems, too few for a {empty[0]} split of "
                    f"{self.split_fractions()[empty[0]]:g} of them: raise {more} or the split's fraction"
                )
            self._splits = splits
        return self._splits

    def check_dataset(self, data: CodeValidationData, path: Path) -> None:
        """A dataset file (``python -m nip_like.evaluate --data``) must hold programs."""
        if len(data) == 0:
            raise ConfigError(f"{path} holds no program")

    def datapoint_texts(self, split: str) -> list[str]:
        """Each program of ``split`` with its problem, as every agent reads them (the opening of its user message)."""
        data = self.split(split)
        return [datapoint_text(data.problems[program.problem_id].statement, program.source) for program in data.programs]

    def all_datapoint_texts(self) -> list[str]:
        """:meth:`datapoint_texts` of every split, each text once (what a prompt's width is measured on)."""
        return list(dict.fromkeys(text for split in self.split_names for text in self.datapoint_texts(split)))

    # ------------------------------------------------------------- the game
    @property
    def move_tokenizer(self):
        """The word-level tokenizer of the moves (``message``, ``accept``, ``reject``; its pad token: no move)."""
        if not hasattr(self, "_move_tokenizer"):
            self._move_tokenizer = build_tokenizer(list(MOVE_SYMBOLS))
        return self._move_tokenizer

    def move_ids(self) -> dict[str, int]:
        """The token ids of ``pad`` and of each move symbol."""
        vocab = self.move_tokenizer.get_vocab()
        return {"pad": int(self.move_tokenizer.pad_token_id), **{symbol: vocab[symbol] for symbol in MOVE_SYMBOLS}}

    def make_text_env(
        self, num_envs: int, split: str, seed: int, device: torch.device | str, group_size: int = 1
    ) -> CodeValidationEnv:
        """The move game on ``split``: what the text agents play through (their replies parsed into moves)."""
        return CodeValidationEnv(
            self.protocol,
            self.split(split).label,
            self.datapoint_texts(split),
            self.move_ids(),
            vocab_size=len(self.move_tokenizer),
            num_envs=num_envs,
            device=device,
            seed=seed,
            group_size=group_size,
        )
