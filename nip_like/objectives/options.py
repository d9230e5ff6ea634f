"""A loss's keyword options, checked against the ranges its options schema declares.

An objective option is written once, as a field of the loss's
:class:`~nip_like.objectives.contract.ObjectiveConfig` schema: its default
(which the loss's constructor reads, ``beta: float = DPOConfig.beta``) and
the values it allows (:func:`~nip_like.allowed.checked`). The config checks
(:mod:`nip_like.validation`) refuse a bad ``trainer.objective`` value from
that metadata; :func:`check_options` refuses a bad argument of a loss built
directly (in a notebook, a test) from the same metadata, so the two cannot
disagree.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from nip_like.allowed import allowed_of
from nip_like.errors import raise_problems


def check_options(loss: object, schema: type, **values: Any) -> None:
    """Refuse the keyword arguments of a loss that their fields in ``schema`` do not allow.

    Parameters
    ----------
    loss : object
        The loss being built (or its class), named in the lines.
    schema : type
        The dataclass schema that declares the arguments (a field without a
        declared range allows anything).
    **values
        The arguments, by field name; ``None`` is left to the field's type.

    Raises
    ------
    ConfigError
        One line per value not allowed: ``<Loss>: <argument> must be <what is allowed>, got <value>``.
    TypeError
        If ``schema`` has no field for one of the arguments.
    """
    owner = loss.__name__ if isinstance(loss, type) else type(loss).__name__
    fields = {field.name: field for field in dataclasses.fields(schema)}
    problems = []
    for name, value in values.items():
        if name not in fields:
            raise TypeError(f"{owner} checks {name}, which {schema.__name__} does not declare")
        allowed = allowed_of(fields[name])
        if allowed is not None and allowed.violation(value):
            problems.append(f"{owner}: {name} must be {allowed.describe()}, got {value!r}")
    raise_problems(problems)
