"""Name -> class registries for trainers, scenarios and protocols.

A config names a registered class by its short name (``trainer_type: ppo``) or
any class by its dotted path (``trainer_type: my_pkg.my_module.MyTrainer``), so
that a user's own class loads without an edit to the package.
"""

from __future__ import annotations

import importlib
from typing import Callable, Generic, TypeVar

from nip_like.errors import ConfigError

T = TypeVar("T", bound=type)


class Registry(Generic[T]):
    """A mapping from short names to classes of one kind.

    Parameters
    ----------
    kind : str
        What the registry holds ("trainer", "scenario", "protocol"); used in
        error messages.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._classes: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Return a class decorator that registers the class under ``name``.

        Parameters
        ----------
        name : str
            The short name used in configs.
        """

        def decorator(cls: T) -> T:
            if name in self._classes and self._classes[name] is not cls:
                raise ValueError(f"a {self.kind} called {name!r} is already registered")
            self._classes[name] = cls
            return cls

        return decorator

    def names(self) -> list[str]:
        """Return the registered names, sorted."""
        _import_builtins()
        return sorted(self._classes)

    def get(self, name: str) -> T:
        """Return the class registered as ``name`` or found at that dotted path.

        Parameters
        ----------
        name : str
            A registered short name, or ``package.module.ClassName``.

        Raises
        ------
        ConfigError
            If the name is neither registered nor an importable class.
        """
        _import_builtins()
        if name in self._classes:
            return self._classes[name]
        if "." in name:
            return _import_dotted(name, self.kind)
        raise ConfigError(
            f"unknown {self.kind} {name!r}; choose one of {self.names()} "
            f"or give a dotted path such as my_module.MyClass"
        )


def _import_dotted(path: str, kind: str) -> type:
    module_name, _, attribute = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError(f"cannot import {kind} {path!r}: {error}") from error
    cls = getattr(module, attribute, None)
    if not isinstance(cls, type):
        raise ConfigError(f"{kind} {path!r}: module {module_name!r} has no class {attribute!r}")
    return cls


def _import_builtins() -> None:
    # Importing the packages runs their @register decorators.
    importlib.import_module("nip_like.trainers")
    importlib.import_module("nip_like.protocols")
    importlib.import_module("nip_like.scenarios")


TRAINERS: Registry = Registry("trainer")
SCENARIOS: Registry = Registry("scenario")
PROTOCOLS: Registry = Registry("protocol")

register_trainer = TRAINERS.register
register_scenario = SCENARIOS.register
register_protocol = PROTOCOLS.register
