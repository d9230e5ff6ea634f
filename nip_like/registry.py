"""One table per kind of component: trainers, protocols, scenarios.

Each table maps a short name to a class and the dataclass schema of its
options, and everything else is derived from it: the lookup by name (or by a
dotted path ``package.module.Class``), the nodes stored in Hydra's
ConfigStore, the check of a config section against its schema, the lists of
names in error messages, and the tables in the docs.

Built-in components register themselves with a decorator in the module that
defines them. A table knows the one package that holds its built-in
components and imports every module in it the first time it is read
(:meth:`Registry.load_builtins`), so adding a built-in component is adding a
module: no list elsewhere names it. A user's own class registers the same way
from the user's module, or is named by its dotted path.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Any, Callable, Generic, TypeVar

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from nip_like.allowed import check_values
from nip_like.errors import ConfigError

T = TypeVar("T", bound=type)

#: Class attribute a registered class receives: the dataclass schema of its options.
SCHEMA_ATTRIBUTE = "config_schema"


@dataclass(frozen=True)
class Entry:
    """One row of a registry table.

    Parameters
    ----------
    name : str
        The short name configs use.
    cls : type
        The component class.
    schema : type or None
        The dataclass schema of the component's options (for a trainer: of
        its objective's options, ``trainer.objective``), or ``None`` if it
        takes none.
    """

    name: str
    cls: type
    schema: type | None

    @property
    def summary(self) -> str:
        """The first line of the class's docstring."""
        return (self.cls.__doc__ or "").strip().splitlines()[0] if self.cls.__doc__ else ""


class Registry(Generic[T]):
    """A table from short names to component classes and their config schemas.

    Parameters
    ----------
    kind : str
        What the table holds (``"trainer"``, ``"protocol"``, ``"scenario"``);
        used in error messages.
    package : str
        The package whose modules hold the built-in components.
    config_group : str
        The Hydra config group the schemas are stored in (``"protocol"``,
        ``"trainer/objective"``).
    base : str
        The dotted path of the class every component subclasses
        (``nip_like.scenarios.base.Scenario``); a class named by dotted path
        must subclass it. Imported when first needed.
    class_key : str, optional
        The config key that names the component's class (``scenario.name``,
        ``trainer.trainer_type``); by default ``<config_group>.name``, and then
        the group's choice may name the class too (``scenario=my_module.MyScenario``).
    node_suffix : str
        Appended to a name to make its ConfigStore node's name; the YAML file of
        the same name extends that node (``nip.yaml`` starts from
        ``nip_schema``). Empty when no YAML file shares the group.
    """

    def __init__(
        self,
        kind: str,
        package: str,
        config_group: str,
        base: str,
        class_key: str | None = None,
        node_suffix: str = "_schema",
    ) -> None:
        self.kind = kind
        self.package = package
        self.config_group = config_group
        self.base = base
        self.class_key = class_key or f"{config_group.replace('/', '.')}.name"
        self.node_suffix = node_suffix
        self._entries: dict[str, Entry] = {}
        self._builtins_loaded = False
        self._store_enabled = False

    # ------------------------------------------------------------ registering
    def register(self, name: str, schema: type | None = None) -> Callable[[T], T]:
        """Return a class decorator that registers the class under ``name``.

        Parameters
        ----------
        name : str
            The short name used in configs.
        schema : type, optional
            The dataclass schema of the component's options. The class gets it
            as its ``config_schema`` attribute, so that it is also found when
            the class is named by its dotted path.
        """

        def decorator(cls: T) -> T:
            known = self._entries.get(name)
            if known is not None and known.cls is not cls:
                raise ValueError(f"a {self.kind} called {name!r} is already registered ({known.cls.__qualname__})")
            if schema is not None:
                setattr(cls, SCHEMA_ATTRIBUTE, schema)
            self._entries[name] = Entry(name, cls, schema)
            if self._store_enabled:
                self._store(self._entries[name])
            return cls

        return decorator

    def load_builtins(self) -> None:
        """Import every module of the built-in package (once), which registers its components."""
        if self._builtins_loaded:
            return
        self._builtins_loaded = True
        package = importlib.import_module(self.package)
        for module in pkgutil.walk_packages(package.__path__, prefix=f"{self.package}."):
            importlib.import_module(module.name)

    # ---------------------------------------------------------------- reading
    def names(self, subclass_of: type | None = None) -> list[str]:
        """Return the registered names, sorted; only those of ``subclass_of`` subclasses if given."""
        self.load_builtins()
        return sorted(
            name for name, entry in self._entries.items() if subclass_of is None or issubclass(entry.cls, subclass_of)
        )

    def entries(self) -> list[Entry]:
        """Return every entry, sorted by name."""
        self.load_builtins()
        return [self._entries[name] for name in sorted(self._entries)]

    def entry(self, name: str) -> Entry:
        """Return the entry registered as ``name``, or one for the class at that dotted path.

        Parameters
        ----------
        name : str
            A registered short name, or ``package.module.ClassName``.

        Raises
        ------
        ConfigError
            If the name is neither registered nor an importable class.
        """
        self.load_builtins()
        if name in self._entries:
            return self._entries[name]
        if "." in name:
            cls = _import_dotted(name, self.kind, self.choices)
            base = _import_dotted(self.base, self.kind, self.choices)
            if not issubclass(cls, base):
                raise ConfigError(f"{self.kind} {name!r} is not a subclass of {base.__name__}; {self.choices()}")
            for entry in self._entries.values():
                if entry.cls is cls:
                    return entry
            return Entry(name, cls, getattr(cls, SCHEMA_ATTRIBUTE, None))
        raise ConfigError(f"unknown {self.kind} {name!r}; {self.choices()}")

    @property
    def group_names_class(self) -> bool:
        """Whether the config group's choice may name the class by dotted path (``scenario=my_module.MyScenario``)."""
        return self.class_key == f"{self.config_group}.name"

    def own_class_hint(self) -> str:
        """How to name a component class of your own, for error messages."""
        base = self.base.rpartition(".")[2]
        return f"give the dotted path of a {base} subclass of your own, such as my_module.My{base}"

    def choices(self) -> str:
        """What a component may be named by, for error messages: the registered names or a dotted path."""
        return (
            f"choose one of {self.names()} or {self.own_class_hint()} "
            "(its module importable: in the current folder or on PYTHONPATH)"
        )

    def registered_entry(self, cls: type) -> Entry | None:
        """The entry of ``cls``, or of its nearest registered base class whose options it takes.

        A subclass of a registered component that registers nothing itself
        inherits its parent's schema; its options are the parent's, stored
        under the parent's name.

        Parameters
        ----------
        cls : type
            The component class.

        Returns
        -------
        Entry or None
            ``None`` if neither the class nor a base class with the same schema is registered.
        """
        self.load_builtins()
        schema = getattr(cls, SCHEMA_ATTRIBUTE, None)
        for ancestor in cls.__mro__:
            for entry in self._entries.values():
                if entry.cls is ancestor and entry.schema is schema:
                    return entry
        return None

    def get(self, name: str) -> T:
        """Return the class registered as ``name`` or found at that dotted path (see :meth:`entry`)."""
        return self.entry(name).cls

    def typed_options(self, name: str, options: Any, where: str) -> DictConfig:
        """Check a config section against the schema of component ``name``.

        Parameters
        ----------
        name : str
            The component's registered name or dotted path.
        options : DictConfig or dict
            The section's values.
        where : str
            The section's place in the config, for error messages (``"protocol"``).

        Returns
        -------
        DictConfig
            The section merged into the schema: every key known and every value
            of its declared type.

        Raises
        ------
        ConfigError
            Naming the unknown key or the badly typed field.
        """
        schema = self.entry(name).schema
        if schema is None:
            return OmegaConf.create(options if options is not None else {})
        return typed_entry(schema, options if options is not None else {}, where)

    # ------------------------------------------------------------ ConfigStore
    def node_name(self, name: str) -> str:
        """The ConfigStore node name of component ``name``."""
        return f"{name}{self.node_suffix}"

    def store_configs(self) -> None:
        """Store every schema in Hydra's ConfigStore, and each one registered later."""
        self._store_enabled = True
        for entry in self.entries():
            self._store(entry)

    def _store(self, entry: Entry) -> None:
        if entry.schema is None:
            return
        node = OmegaConf.structured(entry.schema)
        if "name" in node.keys():
            # Components that share a schema (the proof protocols) each get their own name.
            node.name = entry.name
        ConfigStore.instance().store(group=self.config_group, name=self.node_name(entry.name), node=node)


def typed_entry(schema: type, value: Any, where: str) -> DictConfig:
    """Check a config entry against a dataclass schema, with a one-line error.

    Parameters
    ----------
    schema : type
        The dataclass.
    value : DictConfig or dict
        The entry's values.
    where : str
        The entry's place in the config (``scenario.agents.verifier``), for the error.

    Raises
    ------
    ConfigError
        Naming the unknown key, the badly typed field, or the value its field
        does not allow (:func:`nip_like.allowed.check_values`).

    Notes
    -----
    An entry typed by another schema is checked by its values: a section
    composed from a built-in schema (``DuplicatesConfig``) is checked against
    a subclass of it that a user's component registers, which OmegaConf would
    refuse to merge as "not a subclass".
    """
    given = OmegaConf.get_type(value) if isinstance(value, DictConfig) else None
    if given is not None and given is not dict and not issubclass(given, schema):
        value = OmegaConf.to_container(value)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), value)
    except Exception as error:  # OmegaConf raises several error types
        first = str(error).splitlines()[0]
        raise ConfigError(f"{where}: {first}") from error
    check_values(merged, schema, where)
    return merged


def _import_dotted(path: str, kind: str, choices: Callable[[], str]) -> type:
    """Import the class at dotted path ``path``; if there is none, a one-line error ending in ``choices()``."""
    module_name, _, attribute = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError(f"cannot import {kind} {path!r}: {error}; {choices()}") from error
    cls = getattr(module, attribute, None)
    if not isinstance(cls, type):
        raise ConfigError(f"{kind} {path!r}: module {module_name!r} has no class {attribute!r}; {choices()}")
    return cls


#: Trainers; a trainer's schema is that of its objective's options (``trainer.objective``).
TRAINERS: Registry = Registry(
    "trainer",
    "nip_like.trainers",
    "trainer/objective",
    base="nip_like.trainers.base.Trainer",
    class_key="trainer.trainer_type",
    node_suffix="",
)
#: Interaction protocols (``protocol``).
PROTOCOLS: Registry = Registry("protocol", "nip_like.protocols", "protocol", base="nip_like.protocols.base.Protocol")
#: Scenarios (``scenario``).
SCENARIOS: Registry = Registry("scenario", "nip_like.scenarios", "scenario", base="nip_like.scenarios.base.Scenario")

#: Every table, for ConfigStore filling and the docs.
REGISTRIES: dict[str, Registry] = {registry.kind: registry for registry in (TRAINERS, PROTOCOLS, SCENARIOS)}


def register_trainer(name: str, objective: type | None = None) -> Callable[[T], T]:
    """Register a trainer class under ``name``, with the schema of its objective's options.

    Parameters
    ----------
    name : str
        The name ``trainer.trainer_type`` takes.
    objective : type, optional
        The dataclass schema of ``trainer.objective`` for this trainer: the
        keyword arguments of its loss module.
    """
    return TRAINERS.register(name, objective)


def register_protocol(name: str, schema: type | None = None) -> Callable[[T], T]:
    """Register a protocol class under ``name`` with the schema of its options (``protocol``)."""
    return PROTOCOLS.register(name, schema)


def register_scenario(name: str, schema: type | None = None) -> Callable[[T], T]:
    """Register a scenario class under ``name`` with the schema of its options (``scenario``)."""
    return SCENARIOS.register(name, schema)
