"""The scenario base and the capabilities a trainer may require of a scenario.

:class:`Scenario` is what every trainer needs of a task: its protocol, data
splits, environments and metrics. What only some trainers need is a
capability, a small base class that a scenario lists among its bases and
whose methods it implements:

* :class:`TensorGame`: agents that are torch modules (:meth:`TensorGame.make_agents`),
  for the tensor trainers (the RL loop's, ``solo_agent``);
* :class:`Demonstrating`: demonstrations of the agents' play, for a warm start
  (``trainer.pretrain.agents``) and the ``solo_agent`` baseline;
* :class:`Labelled`: supervised data (each datapoint with its correct decision), for the same;
* :class:`~nip_like.scenarios.chat.ChatGame`: text agents in chat, for the
  text trainers (``expert_iteration``, ``malt``).

:class:`GeneratedData` is the data of a scenario drawn from a spec, cached and
split, with its extension points (``data_spec``, ``generate``,
``split_fractions``).

A trainer declares what it requires (:attr:`nip_like.trainers.base.Trainer.requires`),
and :func:`nip_like.validation.validate` checks it once, before any work,
as BenchMARL's ``supports_*()`` do. Example::

    class GraphIsomorphismScenario(TensorGame, Demonstrating, Labelled): ...
"""

from __future__ import annotations

import hashlib
import inspect
import json
import sys
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from omegaconf import MISSING, DictConfig
from tensordict import TensorDictBase

from nip_like.agent_modules import AgentModules
from nip_like.errors import ConfigError
from nip_like.keys import EPISODE_RETURN_KEY
from nip_like.protocols.base import Protocol
from nip_like.scenarios.datasets import load_or_build, stratified_split
from nip_like.scenarios.environment import InteractionEnv


def user_classes(cls: type) -> list[type]:
    """The classes of ``cls``'s method resolution order that are the user's: outside nip_like and the standard library."""
    return [
        base
        for base in cls.__mro__
        if base.__module__.partition(".")[0] not in ("nip_like", *sys.stdlib_module_names)
    ]


#: The user classes whose unreadable source has been warned about (once per class and process).
_UNREADABLE: set[str] = set()


def code_key(cls: type) -> dict[str, Any] | None:
    """What keys the caches built from scenario class ``cls`` besides its config: its code, if it is the user's.

    A built-in scenario (every class of its method resolution order in
    nip_like or the standard library) has None: its caches are versioned
    with the package (``pretrain_data_version``, the data's ``generator_version``).
    A user's scenario has its qualified name (``module.Class``) and either
    its explicit :attr:`Scenario.code_version`, when set, or a hash of the
    source (:func:`inspect.getsource`) of each of its classes outside
    nip_like. A class whose source cannot be read (defined in an interactive
    session, say) is keyed by its name alone, with a one-line warning, once,
    that names ``code_version``.

    Returns
    -------
    dict or None
        ``{"class": ..., "version": ...}``, ``{"class": ..., "source": <16 hex digits or None>}``, or None.
    """
    users = user_classes(cls)
    if not users:
        return None
    name = f"{cls.__module__}.{cls.__qualname__}"
    version = getattr(cls, "code_version", None)
    if version is not None:
        return {"class": name, "version": str(version)}
    digest = hashlib.sha256()
    for base in users:
        try:
            digest.update(inspect.getsource(base).encode())
        except (OSError, TypeError) as error:
            if name not in _UNREADABLE:
                _UNREADABLE.add(name)
                warnings.warn(
                    f"cannot read the source of {base.__module__}.{base.__qualname__} ({error}): caches built from "
                    f"scenario {name} are keyed by its name alone; set {cls.__qualname__}.code_version and change it "
                    f"when its code changes",
                    UserWarning,
                    stacklevel=2,
                )
            return {"class": name, "source": None}
    return {"class": name, "source": digest.hexdigest()[:16]}


def code_tag(cls: type) -> str:
    """``""`` for a built-in scenario class, else ``"_"`` and 12 hex digits of its :func:`code_key` (for cache file names)."""
    key = code_key(cls)
    if key is None:
        return ""
    return "_" + hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


@dataclass
class ScenarioConfig:
    """Base of the scenario schemas; ``name`` selects the registered scenario."""

    name: str = MISSING  # registered scenario name, or dotted path module.Class


class Scenario(ABC):
    """A task: its environments and how to score its episodes.

    Its agents come with a capability: :class:`TensorGame` (torch modules)
    or :class:`~nip_like.scenarios.chat.ChatGame` (text models).

    Parameters
    ----------
    config : DictConfig
        The ``scenario`` node of the experiment config, already checked against
        the schema the scenario is registered with (a typed node: every key
        known, every value of its declared type).
    protocol : Protocol
        The interaction protocol the agents play under.
    """

    #: The data split that periodic evaluation plays (a scenario with a validation split names it).
    eval_split: str = "train"

    #: The dataset class of the scenario's data files (:class:`~nip_like.scenarios.datasets.TensorDataset`);
    #: None for a scenario without data files.
    dataset_class: type | None = None

    #: Whether the scenario can play a zero-knowledge protocol (:mod:`nip_like.protocols.zero_knowledge`).
    supports_zero_knowledge: bool = False

    #: The version of a user's scenario code (a subclass in the user's own file). None: the caches built
    #: from it (data, warm start) are keyed by a hash of its source (:func:`code_key`); set, by this
    #: version instead, which the user changes when the code changes what the caches hold.
    code_version: ClassVar[str | int | None] = None

    def __init__(self, config: DictConfig, protocol: Protocol) -> None:
        self.config = config
        self.protocol = protocol
        self._splits: dict | None = None
        if protocol.zero_knowledge and not self.supports_zero_knowledge:
            from nip_like.registry import SCENARIOS

            able = [name for name in SCENARIOS.names() if SCENARIOS.get(name).supports_zero_knowledge]
            raise ConfigError(
                f"scenario {config.name} cannot play a zero-knowledge protocol; protocol.zero_knowledge=true needs one of {able}"
            )

    #: The names of the scenario's data splits (a scenario with data files names them).
    split_names: tuple[str, ...] = ()

    def splits(self) -> dict:
        """The scenario's data splits by name (a scenario with data files overrides it)."""
        raise ConfigError(f"scenario {self.config.name!r} has no data splits")

    def split(self, name: str):
        """The data split ``name``; an unknown name fails in one line before any data is read."""
        if name not in self.split_names:
            raise ConfigError(f"unknown data split {name!r}; the {self.config.name} splits are {list(self.split_names)}")
        return self.splits()[name]

    def use_dataset_file(self, path: Path, split: str = "test") -> int:
        """Play ``split`` on every example of a dataset file instead (``python -m nip_like.evaluate --data``).

        Parameters
        ----------
        path : Path
            A file in the scenario's format (:attr:`dataset_class`, written by
            its ``save``: a cache file or one made by its dataset script).
        split : str
            The split it replaces.

        Returns
        -------
        int
            The number of examples in the file.

        Raises
        ------
        ConfigError
            If the scenario has no data files, or the file's examples do not
            fit the scenario's config (:meth:`check_dataset`).
        DatasetFileError
            If the file is missing, unreadable or not of the scenario's format.
        """
        if self.dataset_class is None:
            raise ConfigError(f"scenario {self.config.name!r} has no data files; --data needs one that has")
        self.split(split)
        data = self.dataset_class.load(Path(path))
        if len(data) == 0:
            raise ConfigError(f"{path} holds no examples")
        self.check_dataset(data, Path(path))
        self._splits = {**self.splits(), split: data}
        return len(data)

    def preflight(self) -> None:
        """Refuse, in one line, inputs that can be checked without data or model weights (none by default).

        Called before the run folder is made (:func:`nip_like.experiment.preflight`):
        model folders, tokenizers, sizes against a model's context. Keep it
        cheap: no dataset is generated or read, no weights are loaded.
        """

    def check_dataset(self, data, path: Path) -> None:
        """Refuse, in one line, a dataset whose examples do not fit the scenario's config."""

    @property
    def agent_names(self) -> tuple[str, ...]:
        """Names of the agents, in the order of the agent dimension."""
        return self.protocol.agent_names

    @abstractmethod
    def make_env(
        self, num_envs: int, split: str, seed: int, device: torch.device | str, group_size: int = 1
    ) -> InteractionEnv:
        """Build a vectorised environment.

        Parameters
        ----------
        num_envs : int
            Number of parallel episodes.
        split : str
            ``"train"`` or ``"test"``: which data the episodes draw from.
        seed : int
            Seed of the environment's generator.
        device : torch.device or str
            Where the environment's tensors live.
        group_size : int
            Consecutive environments that play the same datapoint (grouped
            rollouts, for objectives that compare episodes that started alike).
        """

    def optimal_rewards(self) -> dict[str, float] | None:
        """Return each agent's best achievable expected episode return, if known."""
        return None

    def policy_metrics(self, batch: TensorDictBase) -> dict[str, float]:
        """Scenario-specific measurements of the collecting policy on a batch (none by default).

        Called with the trainer's shared diagnostics (``logger.diagnostics_every``)
        on the collected ``(env, time)`` batch, which holds the policy's logits
        (``("agents", "logits")``), action masks and active flags.
        """
        return {}

    def transcripts(self, episodes: TensorDictBase, limit: int) -> list[dict]:
        """Readable records of up to ``limit`` finished episodes (none by default).

        A scenario whose agents talk returns one JSON-serialisable dict per
        episode: who said what, what the environment revealed, the decision,
        the label and the rewards. The trainer writes them as JSONL beside
        each evaluation and the test (``transcripts/``).

        Parameters
        ----------
        episodes : TensorDictBase
            As for :meth:`episode_metrics`.
        limit : int
            The most records to return.
        """
        return []

    def transcript_text(self, record: dict) -> str:
        """One transcript record as plain text for a logger's text channel.

        By default: ``key: value`` lines, with each turn of ``turns`` (dicts
        with ``agent`` and ``message``) on a line of its own as
        ``agent: message``; a scenario may render its records its own way.
        """
        lines = []
        for key, value in record.items():
            if key == "turns":
                lines += [f"  {turn['agent']}: {turn['message']}" for turn in value]
            else:
                lines.append(f"{key}: {value}")
        return "\n".join(lines)

    def episode_metrics(self, episodes: TensorDictBase) -> dict[str, float]:
        """Summarise finished episodes.

        Parameters
        ----------
        episodes : TensorDictBase
            The ``"next"`` entries of the final step of each finished episode,
            batch shape ``(num_episodes,)``.

        Returns
        -------
        dict
            Metric name (without namespace) to value. The base class reports the
            mean return of each agent as ``agents/<agent>/reward`` and their mean over
            agents as ``reward``.
        """
        returns = episodes.get(EPISODE_RETURN_KEY).squeeze(-1).float()
        metrics = {f"agents/{name}/reward": returns[:, index].mean().item() for index, name in enumerate(self.agent_names)}
        metrics["reward"] = returns.mean().item()
        return metrics


class GeneratedData(Scenario):
    """A scenario whose dataset is drawn from a spec, cached under ``scenario.cache_dir`` and split (the proof scenarios).

    The extension points of the data: :meth:`data_spec` (what is drawn, from
    the config), :meth:`generate` (how) and :meth:`split_fractions` (the
    splits). The dataset is drawn once per spec and code, kept in the cache
    file :meth:`data_cache_path`, and cut into label-stratified splits
    (:func:`~nip_like.scenarios.datasets.stratified_split`). The config has
    ``cache_dir``, ``val_fraction`` and ``test_fraction``; ``split_names``
    are ``train``, ``val`` and ``test``.
    """

    split_names = ("train", "val", "test")
    eval_split = "val"

    @abstractmethod
    def data_spec(self) -> Any:
        """What :meth:`generate` draws (a :class:`~nip_like.scenarios.datasets.DatasetSpec`), from the config.

        Called once, in ``__init__``, as ``self.spec``; its ``key()`` names the
        cache file. A subclass returns a spec of its own (a subclass with more
        fields) when its data depend on options the default spec lacks.
        """

    @abstractmethod
    def generate(self, spec: Any) -> Any:
        """Draw the whole dataset of ``spec`` (a :attr:`dataset_class`), before the splits, from ``spec.seed`` alone."""

    @abstractmethod
    def base_cache_path(self) -> Path:
        """The cache file of the built-in scenario's data for ``self.spec`` (named by the spec's key)."""

    def split_fractions(self) -> dict[str, float]:
        """The share of the dataset in each split of :attr:`split_names` (they sum to 1): from ``val_fraction`` and ``test_fraction``."""
        val, test = float(self.config.val_fraction), float(self.config.test_fraction)
        return {"train": 1.0 - val - test, "val": val, "test": test}

    def data_cache_path(self) -> Path:
        """:meth:`base_cache_path`, whose name, for a scenario class of the user's own, also holds its :func:`code_tag`.

        So data drawn by an earlier version of a user's :meth:`generate` are
        never read back; a built-in scenario's file name is the spec's alone.
        """
        path = self.base_cache_path()
        return path.with_name(f"{path.stem}{code_tag(type(self))}{path.suffix}")

    def splits(self) -> dict:
        """The splits of :meth:`split_fractions`, label-stratified, of the dataset of :meth:`generate` (drawn or read from the cache once)."""
        if self._splits is None:
            spec = self.spec
            data = load_or_build(self.dataset_class, self.data_cache_path(), spec, lambda: self.generate(spec))
            self._splits = stratified_split(data, self.split_fractions(), seed=spec.seed)
        return self._splits


class TensorGame(Scenario):
    """Capability: the agents are torch modules that the scenario builds (the tensor trainers' scenarios)."""

    #: What the capability gives, for the one-line error of a trainer that requires it.
    provides: ClassVar[str] = "agents that are torch modules"

    @abstractmethod
    def make_agents(self) -> AgentModules:
        """Build the agents' policy and value modules (on the CPU)."""

    def lm_agent_configs(self) -> dict[str, tuple[str, Any, int]]:
        """The language-model agents, for the memory check before a run (none by default).

        Returns
        -------
        dict
            By agent name: the config path that sets the agent
            (``scenario.agents.verifier``), its
            :class:`~nip_like.lm.models.LMAgentConfig`, and the vocabulary of
            the model folder it plays from in the chat view (0 in the token
            view). See :func:`~nip_like.lm.memory.check_lm_memory`.
        """
        return {}


class Demonstrating(ABC):
    """Capability: the scenario demonstrates its agents' play (what a warm start fits them to)."""

    provides: ClassVar[str] = "demonstrations"

    #: Version of :meth:`demonstrations`, part of the warm-start cache key: bump it when they
    #: change, so that agents fitted to the old ones are not reused.
    pretrain_data_version: ClassVar[int | None] = None

    @abstractmethod
    def demonstration_agents(self) -> list[str]:
        """The agents that :meth:`demonstrations` gives play for."""

    @abstractmethod
    def demonstrations(self, split: str, seed: int = 0) -> dict[str, TensorDictBase]:
        """Each demonstrated agent's play on ``split``, by agent name.

        Either token demonstrations (``"prompt_ids"``, ``"prompt_mask"``,
        ``"tokens"``, ``"token_mask"``: a language model's prompt and message)
        or decision datapoints laid out as :meth:`Labelled.supervised_data`.
        """


class Labelled(ABC):
    """Capability: the scenario's datapoints come with the correct decision (supervised data)."""

    provides: ClassVar[str] = "labelled data"

    #: Version of :meth:`supervised_data`, part of the warm-start cache key (see
    #: :attr:`Demonstrating.pretrain_data_version`).
    pretrain_data_version: ClassVar[int | None] = None

    @abstractmethod
    def supervised_data(self, split: str) -> TensorDictBase:
        """Every agent's first observation of each datapoint of ``split``, with ``"target_action"`` and ``"target_mask"``."""

    def supervised_metrics(self, predicted: torch.Tensor, data: TensorDictBase) -> dict[str, float]:
        """Scenario-specific measures of predicted decisions ``(E,)`` on ``data`` (none by default)."""
        return {}
