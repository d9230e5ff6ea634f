"""Every check of a composed config, in one pass and in one place, before any folder, cache or model is touched.

:func:`validate` checks the whole config against one tree of schemas: the
global ones (:class:`~nip_like.config.ExperimentConfig`), the trainer's loop
(:attr:`~nip_like.trainers.base.Trainer.loop_schema`) and the schemas the
chosen trainer's objective, scenario and protocol are registered with. It
collects every problem as one line and raises them together in one
:class:`~nip_like.errors.ConfigError` (the command line prints each as
``error: ...`` and exits with status 2). The pass, in order; a step skips
the sections that an earlier one found broken, so that one mistake is
reported once:

1. **names**: ``trainer.trainer_type``, ``scenario.name`` and
   ``protocol.name`` (registered names or dotted paths,
   :mod:`nip_like.registry`);
2. **keys**: every key is declared by its section's schema (Hydra's
   ``+key=value`` adds keys silently);
3. **types and values**: each section merged into its schema, then every
   field against what it allows (:func:`nip_like.allowed.violations`);
4. **device and distributed settings**: ``run.device``, ``run.fsdp``;
5. **the components**: the protocol and the scenario built from their
   sections (no data is loaded; their constructors refuse what a range
   cannot say), the capabilities the trainer requires of the scenario
   (:meth:`~nip_like.trainers.base.Trainer.requirements`), and the
   trainer's own :meth:`~nip_like.trainers.base.Trainer.validate` hook
   (relations between fields: ``trainer.num_envs`` and
   ``trainer.group_size``, an opponent pool and the game, ...).

Components declare their checks: fields with ranges
(:func:`nip_like.allowed.checked`) and hooks that return problems; none of
them calls back into this module. What needs the inputs themselves (model
folders, tokenizers, servers) is checked after this pass by
:func:`nip_like.experiment.preflight`.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import logging
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, TypeVar

import torch
from omegaconf import DictConfig, OmegaConf

from nip_like.allowed import violations
from nip_like.distributed import launched_world_size
from nip_like.config import LOOP_SCHEMAS, ExperimentConfig
from nip_like.errors import ConfigError, one_line, raise_problems
from nip_like.lm.models import agent_option
from nip_like.lm.shared_models import sharing_groups, with_shared_base
from nip_like.protocols.base import Protocol
from nip_like.registry import REGISTRIES, TRAINERS, Entry
from nip_like.scenarios.base import Scenario
from nip_like.trainers.base import Trainer
from nip_like.trainers.checked_configs import note_checked

R = TypeVar("R")

_log = logging.getLogger(__name__)

#: The config's component sections: each is checked against the schema of the component it names.
COMPONENT_SECTIONS = ("trainer", "scenario", "protocol")


@dataclass(frozen=True)
class CheckedConfig:
    """What :func:`validate` resolved on its way: the components' entries, their checked sections, the scenario.

    Parameters
    ----------
    trainer : Entry
        The trainer ``trainer.trainer_type`` names (its class subclasses
        :class:`~nip_like.trainers.base.Trainer`).
    scenario : Scenario
        The scenario and its protocol, built from their checked sections (no data loaded).
    sections : dict
        The component sections merged into their schemas (``scenario``,
        ``protocol``), from which :meth:`build_scenario` builds them again.
    entries : dict
        The registry entries of the scenario and the protocol.
    """

    trainer: Entry
    scenario: Scenario
    sections: dict[str, DictConfig]
    entries: dict[str, Entry]

    def build_scenario(self) -> Scenario:
        """A new scenario (and protocol) from the checked sections: what the run plays, built after the seeding."""
        return _build(self.entries, self.sections)


def _build(entries: dict[str, Entry], sections: dict[str, DictConfig]) -> Scenario:
    """The protocol, then the scenario holding it, from their entries and checked sections: the one scenario builder."""
    return entries["scenario"].cls(sections["scenario"], _build_protocol(entries["protocol"], sections["protocol"]))


def _build_protocol(entry: Entry, section: DictConfig) -> Protocol:
    """The protocol of ``entry`` with its checked ``section`` as keyword arguments."""
    return entry.cls(**OmegaConf.to_container(section, resolve=True))


def _component(config: DictConfig, kind: str) -> tuple[Entry, DictConfig]:
    """The entry that ``config`` names for ``kind`` (``scenario``, ``protocol``) and its section checked against the entry's schema."""
    registry = REGISTRIES[kind]
    name = str(OmegaConf.select(config, registry.class_key))
    return registry.entry(name), registry.typed_options(name, config[kind], kind)


@dataclass
class _Pass:
    """The problems found so far, and the sections they were found in."""

    problems: list[str] = field(default_factory=list)
    broken: set[str] = field(default_factory=set)

    def add(self, section: str, lines: list[str] | str) -> None:
        found = [lines] if isinstance(lines, str) else list(lines)
        self.problems += found
        if found:
            self.broken.add(section)

    def attempt(self, section: str, call: Callable[[], R]) -> R | None:
        """``call()``, or ``None`` with its :class:`ConfigError`'s lines added under ``section``."""
        try:
            return call()
        except ConfigError as error:
            self.add(section, str(error).splitlines())
            return None

    def fine(self, *sections: str) -> bool:
        return not self.broken.intersection(sections)


def validate(config: DictConfig) -> CheckedConfig:
    """Check the whole config in one pass; refuse it with every problem found, one line each.

    A config that passes is noted (:func:`~nip_like.trainers.checked_configs.note_checked`),
    so that a trainer built from it does not run its own checks again.

    Parameters
    ----------
    config : DictConfig
        The composed experiment config.

    Returns
    -------
    CheckedConfig
        The resolved trainer and the scenario (built, no data loaded).

    Raises
    ------
    ConfigError
        One line per problem, in the order of the pass (see the module's docstring).
    """
    checks = _Pass()
    entries, sections = _schema_pass(config, checks)
    trainer = entries.get("trainer")
    checks.add("run", _device_problems(str(config.run.device)))
    scenario = None
    if checks.fine("scenario", "protocol"):
        scenario = checks.attempt("scenario", lambda: _build(entries, sections))
    if trainer is not None and scenario is not None and checks.fine("global", "run"):
        checks.add("run", fsdp_problems(config, trainer.cls, scenario))
    if trainer is not None and checks.fine("trainer", "trainer.objective"):
        checks.add("trainer", trainer.cls.validate(config, scenario))
    if trainer is not None and scenario is not None:
        checks.add("scenario", requirement_problems(trainer.cls, scenario, config))
    if scenario is not None:
        checks.add("scenario", shared_base_problems(scenario))
    raise_problems(checks.problems)
    assert trainer is not None and scenario is not None  # no problem: both were built
    note_checked(config)  # a trainer built from it does not check its options again
    return CheckedConfig(trainer, scenario, sections, {kind: entries[kind] for kind in ("scenario", "protocol")})


def validate_schemas(config: DictConfig) -> Entry:
    """The steps of :func:`validate` that build nothing (names, keys, types and values), for many configs at once.

    A sweep checks each of its jobs this way before the first one runs.

    Returns
    -------
    Entry
        The trainer the config names.

    Raises
    ------
    ConfigError
        One line per problem.
    """
    checks = _Pass()
    entries, _ = _schema_pass(config, checks)
    raise_problems(checks.problems)
    return entries["trainer"]


def _schema_pass(config: DictConfig, checks: _Pass) -> tuple[dict[str, Entry], dict[str, DictConfig]]:
    """Steps 1-3 of the pass (names, keys, types and values): the entries found, and the component sections typed."""
    entries: dict[str, Entry] = {}
    for kind, registry in REGISTRIES.items():  # the trainer's, the protocol's and the scenario's, by name
        entry = checks.attempt(kind, lambda: registry.entry(str(OmegaConf.select(config, registry.class_key))))
        if entry is not None:
            entries[kind] = entry
    if "trainer" in entries and not issubclass(entries["trainer"].cls, Trainer):
        checks.add("trainer", f"trainer {config.trainer.trainer_type!r} is not a nip_like Trainer subclass")
        del entries["trainer"]
    after_names = len(checks.problems)
    # The sections and their schemas: the global ones, the trainer's loop, its objective's, the components'.
    sections: list[tuple[str, type | None, Any]] = [
        ("", ExperimentConfig, {key: config[key] for key in config if key not in COMPONENT_SECTIONS})
    ]
    explained: list[str] = []  # keys of another trainer loop's schema: reported as such, not as unknown
    if "trainer" in entries:
        trainer = entries["trainer"]
        note_unchecked_options(str(config.trainer.trainer_type), trainer, config.trainer.get("objective"))
        checks.add("trainer.objective", _objective_kind_problems(config, trainer))
        explained = _other_loop_keys(config, trainer)
        checks.add("trainer", _other_loop_problems(config, trainer, explained))
        sections.append(("trainer", trainer.cls.loop_schema, config.trainer))
        if checks.fine("trainer.objective"):
            sections.append(("trainer.objective", trainer.schema, config.trainer.get("objective")))
    for kind in ("scenario", "protocol"):
        if kind in entries:
            sections.append((kind, entries[kind].schema, config[kind]))
    unknown = []
    typed: dict[str, DictConfig] = {}
    for where, schema, node in sections:
        section = where or "global"
        if schema is None:
            typed[section] = OmegaConf.create(node if node is not None else {})
            continue
        keys = [key for key in _unknown_keys(node, schema, f"{where}." if where else "") if key not in explained]
        if keys:
            checks.broken.add(section)
            unknown += keys
        merged, problems = typed_section(schema, node, where)
        checks.add(section, problems)
        if merged is not None:
            typed[section] = merged
    if unknown:
        checks.problems.insert(after_names, unknown_keys_line(unknown))
    return entries, {kind: typed[kind] for kind in ("scenario", "protocol") if kind in typed}


def note_unchecked_options(name: str, entry: Entry, options: Any) -> None:
    """Log, once per trainer and options, that a trainer without an options schema takes ``trainer.objective`` as it is.

    A trainer class that registers no schema, neither itself nor through a
    registered base class with the same schema (a direct subclass of
    :class:`~nip_like.trainers.rl.TensorDictRlTrainer` named by dotted path),
    gets whatever options the ``trainer`` group's choice put under
    ``trainer.objective`` (PPO's, with the default ``trainer: ppo``), checked
    only against that choice's schema, if any.
    """
    if entry.schema is not None or not isinstance(options, DictConfig):
        return
    given = OmegaConf.get_type(options)
    _note_once(name, given.__name__ if given not in (None, dict) else "no schema")


@functools.cache
def _note_once(name: str, schema: str) -> None:
    _log.info(
        "trainer %s registers no options schema: it takes trainer.objective as the trainer group's choice made it "
        "(%s; trainer=ppo by default); register it with @register_trainer(<name>, objective=<Schema>) for options of its own",
        name,
        schema,
    )


def _objective_kind_problems(config: DictConfig, entry: Entry) -> list[str]:
    """``trainer.objective`` typed by another trainer's objective schema (chosen with the wrong ``trainer/objective``)."""
    options = config.trainer.get("objective")
    given = OmegaConf.get_type(options) if isinstance(options, DictConfig) else None
    if entry.schema is None or given is None or given is dict or issubclass(given, entry.schema):
        return []
    return [
        f"trainer {config.trainer.trainer_type} takes objective options {entry.schema.__name__}, but trainer.objective holds "
        f"{given.__name__}; select its options with trainer/objective={entry.name}"
    ]


def _other_loop_keys(config: DictConfig, trainer: Entry) -> list[str]:
    """The keys of ``trainer`` that its loop's schema lacks, if each is another loop's option (else none)."""
    loop_schema = trainer.cls.loop_schema
    unread = _unknown_keys(config.trainer, loop_schema, "trainer.")
    own = {field.name for field in dataclasses.fields(loop_schema)}
    other_loops = {field.name for schema in LOOP_SCHEMAS for field in dataclasses.fields(schema)} - own
    return unread if unread and all(key.split(".")[1] in other_loops for key in unread) else []


def _other_loop_problems(config: DictConfig, trainer: Entry, keys: list[str]) -> list[str]:
    """The line for another trainer loop's options given to this one (an RL loop's option to a text trainer, ...)."""
    if not keys:
        return []
    return [
        f"trainer {config.trainer.trainer_type} does not read {', '.join(keys)}: its loop's options are "
        f"{trainer.cls.loop_schema.__name__}'s; leave them out (select the trainer with trainer=<name>, see docs: configuration)"
    ]


def unknown_keys_line(keys: list[str]) -> str:
    """The one line that names every key no schema declares."""
    return f"unknown config keys {keys}; check the spelling (see docs: configuration)"


def unknown_key_line(key: str, known: Iterable[str], schema: str | None = None, nested: Iterable[str] = ()) -> str:
    """The one line for one key that its section does not declare: the key, and the section's nearest keys.

    Parameters
    ----------
    key : str
        The full dotted key, as given (``trainer.objective.entropy_strat``).
    known : iterable of str
        The keys its section declares.
    schema : str, optional
        The name of the section's schema (``PPOConfig``), said after the section.
    nested : iterable of str
        Full keys of the same name one section further down (``trainer.optimizer.lr``
        for ``trainer.lr``), offered first.

    Returns
    -------
    str
        ``unknown config key K: S (Schema) has no option 'N'; did you mean A or B?``
        (the nearest spellings, :func:`difflib.get_close_matches`), or the
        section's options when none is near.
    """
    section, _, name = key.rpartition(".")
    options = sorted(str(option) for option in known)
    nearest = [*nested, *difflib.get_close_matches(name, options, n=3, cutoff=0.6)]
    hint = f"did you mean {' or '.join(nearest)}?" if nearest else f"its options: {', '.join(options) or 'none'}"
    where = f"{section or 'the config'}{f' ({schema})' if schema else ''}"
    return f"unknown config key {key}: {where} has no option {name!r}; {hint}"


def _unknown_keys(node: Any, schema: type, prefix: str) -> list[str]:
    """The keys of ``node`` (and of its nested sections) that ``schema`` does not declare, as full paths."""
    if not isinstance(node, (DictConfig, dict)):
        return []
    hints = typing.get_type_hints(schema)
    unknown = []
    for key in node.keys():
        if key not in hints:
            unknown.append(f"{prefix}{key}")
        elif dataclasses.is_dataclass(hints[key]) and isinstance(node[key], DictConfig):
            unknown += _unknown_keys(node[key], hints[key], f"{prefix}{key}.")
    return unknown


def typed_section(schema: type, node: Any, where: str) -> tuple[DictConfig | None, list[str]]:
    """A section merged into its schema, and its problems: a value of the wrong type (one per key), else every value not allowed.

    Keys that ``schema`` does not declare are left to the keys step. The
    merged section is ``None`` when a value has the wrong type.
    """
    if node is None:
        node = {}
    given = OmegaConf.get_type(node) if isinstance(node, DictConfig) else None
    if given is not None and given is not dict and not issubclass(given, schema):
        node = OmegaConf.to_container(node)  # typed by another schema: checked by its values
    known = {field.name for field in dataclasses.fields(schema)}
    declared = {key: node[key] for key in node.keys() if key in known}
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), declared)
    except Exception:  # OmegaConf raises several error types: find each key that it refuses
        problems = []
        for key, value in declared.items():
            try:
                OmegaConf.merge(OmegaConf.structured(schema), {key: value})
            except Exception as error:
                problems.append(f"{where}.{key}: {one_line(error)}" if where else f"{key}: {one_line(error)}")
        return None, problems or [f"{where or 'config'}: cannot be read as {schema.__name__}"]
    return merged, list(violations(merged, schema, where))


def _device_problems(device: str) -> list[str]:
    try:
        parsed = torch.device(device)
    except RuntimeError:
        return [f"run.device {device!r} is not a torch device (cpu, cuda, cuda:1, ...)"]
    if parsed.type == "cuda" and not torch.cuda.is_available():
        return [f"run.device is {device!r} but CUDA is not available on this machine; use run.device=cpu"]
    return []


def build_protocol(config: DictConfig) -> Protocol:
    """Build the protocol ``config.protocol`` names from its options, checked against its schema.

    Parameters
    ----------
    config : DictConfig
        The whole experiment config.
    """
    return _build_protocol(*_component(config, "protocol"))


def build_scenario(config: DictConfig) -> Scenario:
    """Build the protocol and the scenario that ``config`` names (no data is loaded yet).

    Parameters
    ----------
    config : DictConfig
        The whole experiment config.
    """
    components = {kind: _component(config, kind) for kind in ("protocol", "scenario")}
    return _build({kind: entry for kind, (entry, _) in components.items()}, {kind: section for kind, (_, section) in components.items()})


def fsdp_problems(config: DictConfig, trainer_cls: type, scenario: Any) -> list[str]:
    """Why ``run.fsdp=true`` cannot apply, in one line (none when it is off or applies).

    It needs ``torchrun`` with two or more ranks, a trainer whose update
    shards (:attr:`~nip_like.trainers.rl.TensorDictRlTrainer.shards_lm_agents`)
    and a scenario whose agents are language models, none of them scoring in
    chunks (its output layer would run outside the sharded forward).
    """
    if not config.run.get("fsdp"):
        return []
    if launched_world_size() < 2:
        return [
            "run.fsdp=true shards the agents over torchrun's ranks: start with torchrun --nproc_per_node=N (N >= 2), "
            "or set run.fsdp=false"
        ]
    if not getattr(trainer_cls, "shards_lm_agents", False):
        allowed = [entry.name for entry in TRAINERS.entries() if getattr(entry.cls, "shards_lm_agents", False)]
        return [f"run.fsdp=true: trainer {config.trainer.trainer_type} does not shard its agents; allowed: {', '.join(allowed)}"]
    lm_agents = getattr(scenario, "lm_agent_configs", lambda: {})()
    if not lm_agents:
        return [
            f"run.fsdp=true shards language-model agents; scenario {config.scenario.name} has none "
            "(its agents are replicated on every rank: set run.fsdp=false)"
        ]
    return [
        f"{where}.score_chunk_tokens={agent.get('score_chunk_tokens')} and run.fsdp=true do not go together: set "
        f"{where}.score_chunk_tokens to null (automatic: off for a sharded agent) or 0, or run.fsdp=false"
        for where, agent, _ in lm_agents.values()
        if agent.get("score_chunk_tokens")
    ][:1]


def check_fsdp(config: DictConfig, trainer_cls: type, scenario: Any) -> None:
    """Refuse ``run.fsdp=true`` where it cannot apply (:func:`fsdp_problems`), in one line."""
    raise_problems(fsdp_problems(config, trainer_cls, scenario))


def _capabilities(requirement: type | tuple[type, ...]) -> tuple[type, ...]:
    return requirement if isinstance(requirement, tuple) else (requirement,)


def meets(scenario_class: type, requires: tuple[type | tuple[type, ...], ...]) -> bool:
    """Whether a scenario class has every capability of ``requires`` (a trainer's :attr:`~Trainer.requires`)."""
    return all(issubclass(scenario_class, _capabilities(requirement)) for requirement in requires)


def requirement_problems(trainer_class: type[Trainer], scenario: Scenario, config: DictConfig) -> list[str]:
    """Each capability the trainer requires (:meth:`Trainer.requirements`) that the scenario lacks, one line each.

    The capabilities are the classes of :mod:`nip_like.scenarios.base` and
    :mod:`nip_like.scenarios.chat` that a scenario lists among its bases. A
    line names what requires it, the capability, the scenario, and the
    registered trainers whose requirements the scenario meets.
    """
    problems = []
    for who, requires in trainer_class.requirements(config).items():
        for requirement in requires:
            options = _capabilities(requirement)
            if isinstance(scenario, options):
                continue
            provides = " or ".join(capability.provides for capability in options)
            names = " or ".join(capability.__name__ for capability in options)
            playable = [
                entry.name
                for entry in TRAINERS.entries()
                if issubclass(entry.cls, Trainer) and meets(type(scenario), entry.cls.requires)
            ]
            hint = f"; trainers for it: {', '.join(playable)}" if playable and who.startswith("trainer ") else ""
            problems.append(
                f"{who} needs a scenario with {provides} ({names}); scenario {config.scenario.name!r} has none{hint}"
            )
    return problems


def shared_base_problems(scenario: Scenario) -> list[str]:
    """A line if ``scenario.shared_base=true`` shares no base because of frozen co-players; none otherwise.

    ``shared_base`` builds every agent on the base of the first agent that is
    not frozen (:func:`~nip_like.lm.shared_models.with_shared_base`); a
    frozen co-player (``frozen_from``) keeps the model of the run it comes
    from. When that leaves no two agents on one base, the setting would do
    nothing, silently: it is refused, naming the frozen agents. Only the
    config is read (no run folder is resolved).
    """
    config = scenario.config
    if not isinstance(config, DictConfig) or not config.get("shared_base") or "default_agent" not in config:
        return []
    agents = {
        name: config.agents[name] if name in config.get("agents", {}) else config.default_agent
        for name in scenario.agent_names
    }
    frozen = [name for name, agent in agents.items() if agent_option(agent, "frozen_from")]
    if not frozen or sharing_groups(with_shared_base(agents)):
        return []
    free = [name for name in agents if name not in frozen]
    who = f"the frozen co-player {frozen[0]} keeps" if len(frozen) == 1 else f"the frozen co-players {', '.join(frozen)} keep"
    left = f"leaving {free[0]} no agent to share its base with" if len(free) == 1 else "leaving no two agents to share a base"
    return [
        f"scenario.shared_base=true shares nothing here: {who} the model of the run it comes from (frozen_from), "
        f"{left}; drop scenario.shared_base"
    ]
