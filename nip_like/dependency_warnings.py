"""Warnings raised inside a dependency on a path we cannot avoid: shown once per process, not silenced.

A run prints each warning at most once (docs: guarantees). A deprecation that our own call triggers
is fixed by calling the current API. The warnings in :data:`ONCE` are raised *inside* a dependency,
by its own use of a name another dependency deprecated, with no argument of ours that avoids them;
the calls that raise them run inside :func:`dependency_warnings_once`, which shows each of them the
first time (through the filters in force, as any warning) and drops its repeats.

Python's own ``once`` filter action is not enough: it keeps its record in the warning module's
registry, which every ``warnings.catch_warnings`` block (ours, pytest's, a dependency's) clears, so
the warning came back at every model built.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Iterator

#: ``(category, exact message)`` of each warning shown at most once per process, with where it comes from.
ONCE: tuple[tuple[type[Warning], str], ...] = (
    # peft 0.21's PeftModel.__init__ reads ``getattr(model, "is_gradient_checkpointing", True)``, a
    # property transformers 5.2x deprecated for ``is_activation_checkpointing``: raised at every LoRA
    # model built (get_peft_model) or loaded (PeftModel.from_pretrained), whatever the options.
    (
        FutureWarning,
        "`is_gradient_checkpointing` is deprecated and will be removed in v6. Use `is_activation_checkpointing` instead.",
    ),
)

_shown: set[tuple[type[Warning], str]] = set()
_registry: dict = {}  # the "default" action's record for the warnings passed on (one location each)


@contextmanager
def dependency_warnings_once() -> Iterator[None]:
    """Run the block; pass on the warnings it raised, each of :data:`ONCE` only the first time in this process."""
    caught: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        for warning in caught:
            key = (warning.category, str(warning.message))
            if key in ONCE:
                if key in _shown:
                    continue
                _shown.add(key)
            warnings.warn_explicit(
                warning.message, warning.category, warning.filename, warning.lineno, registry=_registry, source=warning.source
            )
