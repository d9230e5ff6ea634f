"""What each config field allows, declared with the field and checked before any work.

A schema field declares its allowed values where it is declared::

    lr: float = checked(1e-3, gt=0)  # learning rate
    name: str = checked("adam", choices=OPTIMIZERS)  # which optimiser

:func:`checked` stores an :class:`Allowed` in the dataclass field's metadata;
:func:`violations` walks a config section against its schema and names
every value outside its field's range in one line (the field, the value and
what is allowed); :mod:`nip_like.validation` reports them with every other
problem of the config. A test requires every numeric field of every schema to declare one,
and the docs' configuration reference shows them (:func:`allowed_values`).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, ListConfig

from nip_like.errors import ConfigError

#: The metadata key under which a field keeps its :class:`Allowed`.
METADATA_KEY = "allowed"


@dataclass(frozen=True)
class Allowed:
    """The values a config field allows.

    Parameters
    ----------
    ge, gt, le, lt : float, optional
        Bounds of a number (``>=``, ``>``, ``<=``, ``<``).
    choices : tuple, optional
        The values allowed, for a field with a fixed set.
    length : int, optional
        The exact length of a list.
    each : Allowed, optional
        What every item of a list, or every value of a dict, allows.
    integer_valued : bool
        The number must be a whole number (for counts stored as floats).
    also : tuple, optional
        Values allowed besides the range (``0`` for a temperature whose 0 means greedy).
    """

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple[Any, ...] | None = None
    length: int | None = None
    each: "Allowed | None" = None
    integer_valued: bool = False
    also: tuple[Any, ...] | None = None

    def describe(self) -> str:
        """What is allowed, in words (``> 0``, ``in [0, 1)``, ``one of ['a', 'b']``)."""
        if self.choices is not None:
            return f"one of {list(self.choices)}"
        parts = []
        if self.length is not None:
            parts.append(f"a list of {self.length}")
        if self.each is not None:
            parts.append(f"{'each' if parts else 'all'} {self.each.describe()}")
        low = ("[", self.ge) if self.ge is not None else ("(", self.gt) if self.gt is not None else None
        high = ("]", self.le) if self.le is not None else (")", self.lt) if self.lt is not None else None
        if low and high:
            parts.append(f"in {low[0]}{low[1]:g}, {high[1]:g}{high[0]}")
        elif low:
            parts.append(f"{'>=' if low[0] == '[' else '>'} {low[1]:g}")
        elif high:
            parts.append(f"{'<=' if high[0] == ']' else '<'} {high[1]:g}")
        if self.integer_valued:
            parts.append("a whole number")
        described = ", ".join(parts) if parts else "a finite number"
        if self.also:
            return " or ".join([*(f"{value:g}" if isinstance(value, float) else str(value) for value in self.also), described])
        return described

    def violation(self, value: Any) -> bool:
        """Whether ``value`` is outside what this allows (``None`` is checked by the field's type, not here)."""
        if value is None or (self.also is not None and not isinstance(value, bool) and value in self.also):
            return False
        if self.choices is not None:
            return value not in self.choices
        if self.each is not None and isinstance(value, (dict, DictConfig)):
            return any(self.each.violation(item) for item in value.values())
        if self.length is not None or self.each is not None:
            if not isinstance(value, (list, tuple, ListConfig)):
                return True
            if self.length is not None and len(value) != self.length:
                return True
            return self.each is not None and any(self.each.violation(item) for item in value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return True
        if isinstance(value, float) and not math.isfinite(value):
            return True
        if self.integer_valued and value != int(value):
            return True
        return (
            (self.ge is not None and value < self.ge)
            or (self.gt is not None and value <= self.gt)
            or (self.le is not None and value > self.le)
            or (self.lt is not None and value >= self.lt)
        )


def checked(default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING, **allowed: Any) -> Any:
    """A dataclass field with a default (or a default factory) and the values it allows.

    Parameters
    ----------
    default : any
        The field's default.
    factory : callable, optional
        A default factory, for lists.
    **allowed
        The keyword arguments of :class:`Allowed` (``gt=0``, ``choices=(...)``, ...).
    """
    metadata = {METADATA_KEY: Allowed(**allowed)}
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def allowed_of(field: dataclasses.Field) -> Allowed | None:
    """The :class:`Allowed` a field declares, or ``None``."""
    return field.metadata.get(METADATA_KEY)


def _nested_schema(schema: type, name: str) -> type | None:
    """The dataclass schema of field ``name`` (also an optional one, ``Optional[Schema]``), or ``None``."""
    hint = typing.get_type_hints(schema).get(name)
    if dataclasses.is_dataclass(hint):
        return hint
    inner = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    return inner[0] if len(inner) == 1 and dataclasses.is_dataclass(inner[0]) else None


def violations(node: DictConfig | dict, schema: type, where: str) -> Iterator[str]:
    """Every value of ``node`` that its field in ``schema`` does not allow (nested schemas too), one line each.

    Parameters
    ----------
    node : DictConfig or dict
        A config section.
    schema : type
        Its dataclass schema.
    where : str
        The section's place in the config (``"trainer"``), for the lines.

    Yields
    ------
    str
        ``<where>.<field> must be <what is allowed>, got <value>``.
    """
    for field in dataclasses.fields(schema):
        if field.name not in node:
            continue
        value = node[field.name]
        name = f"{where}.{field.name}" if where else field.name
        nested = _nested_schema(schema, field.name)
        if nested is not None and isinstance(value, (DictConfig, dict)):
            yield from violations(value, nested, name)
            continue
        allowed = allowed_of(field)
        if allowed is not None and allowed.violation(value):
            shown = list(value) if isinstance(value, ListConfig) else value
            yield f"{name} must be {allowed.describe()}, got {shown!r}"


def check_values(node: DictConfig | dict, schema: type, where: str) -> None:
    """Refuse the values of ``node`` that their fields in ``schema`` do not allow (:func:`violations`), together.

    Raises
    ------
    ConfigError
        One line per value not allowed: ``<where>.<field> must be <what is allowed>, got <value>``.
    """
    found = list(violations(node, schema, where))
    if found:
        raise ConfigError("\n".join(found))


def numeric_fields_without_range(schema: type) -> Iterator[str]:
    """Names of the int or float fields of ``schema`` (and its nested schemas) that declare nothing allowed."""
    hints = typing.get_type_hints(schema)
    for field in dataclasses.fields(schema):
        hint = hints[field.name]
        nested = _nested_schema(schema, field.name)
        if nested is not None:
            yield from (f"{field.name}.{inner}" for inner in numeric_fields_without_range(nested))
            continue
        numeric = {int, float} & {hint, *typing.get_args(hint)}
        if numeric and bool not in typing.get_args(hint) and hint is not bool and allowed_of(field) is None:
            yield field.name


def allowed_values(schema: type, prefix: str = "") -> list[tuple[str, str]]:
    """``(field, what is allowed)`` for every field of ``schema`` that declares it, nested schemas included."""
    rows = []
    for field in dataclasses.fields(schema):
        nested = _nested_schema(schema, field.name)
        if nested is not None:
            rows += allowed_values(nested, f"{prefix}{field.name}.")
        elif allowed_of(field) is not None:
            rows.append((f"{prefix}{field.name}", allowed_of(field).describe()))
    return rows
