"""Configs that passed the experiment's one-pass check, so that a trainer built from one does not check them again.

:func:`nip_like.validation.validate` checks the whole config, the trainer's
own :meth:`~nip_like.trainers.base.Trainer.validate` hook included, and notes
the config here when it passes. A trainer's ``__init__`` runs its hook only
for a config not noted: one built directly (in a notebook, a test, a script)
is checked as the experiment would check it, and a run's config is checked
once.

A config is remembered by its content as long as it lives: one changed after
the check, or a new one with other content, is checked again; nothing is kept
for configs that are gone.
"""

from __future__ import annotations

import weakref

from omegaconf import DictConfig

__all__ = ["note_checked", "was_checked"]

#: The configs that passed the check, held weakly (a DictConfig hashes and compares by content).
_CHECKED: "weakref.WeakSet[DictConfig]" = weakref.WeakSet()


def note_checked(config: DictConfig) -> None:
    """Remember that ``config`` passed :func:`nip_like.validation.validate`, as it is now."""
    _CHECKED.add(config)


def was_checked(config: DictConfig) -> bool:
    """Whether ``config``, as it is now, passed :func:`nip_like.validation.validate` in this process."""
    return isinstance(config, DictConfig) and config in _CHECKED
