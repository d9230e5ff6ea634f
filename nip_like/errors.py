"""Errors that reach the user as one line, without a traceback."""

from __future__ import annotations


class NipLikeError(Exception):
    """Base class of the errors that the command line reports in one line.

    Anything raised as a :class:`NipLikeError` is caught by the entry points,
    printed as ``error: <message>`` on standard error and turned into a non-zero
    exit status.
    """


class ConfigError(NipLikeError, ValueError):
    """A configuration value, name or combination is not allowed."""


class CheckpointError(NipLikeError):
    """A checkpoint is missing, corrupt, or belongs to a different run."""


class TrainingError(NipLikeError, RuntimeError):
    """Training cannot go on, for example because a loss became NaN."""


class SweepJobError(NipLikeError):
    """A job of a sweep failed; the message names its folder and the reason."""


class ReportError(NipLikeError, ValueError):
    """Run folders cannot be compared as asked (mixed budgets, missing metrics, no runs)."""
