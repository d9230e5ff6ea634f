"""Errors that reach the user as one line, without a traceback."""

from __future__ import annotations

from collections.abc import Iterable


class NipLikeError(Exception):
    """Base class of the errors that the command line reports in one line.

    Anything raised as a :class:`NipLikeError` is caught by the entry points,
    printed as ``error: <message>`` on standard error and turned into a non-zero
    exit status.
    """


class ConfigError(NipLikeError, ValueError):
    """A configuration value, name or combination is not allowed.

    Its message is one line per problem: the config checks
    (:mod:`nip_like.validation`) report every problem they find together.
    """


def raise_problems(problems: Iterable[str]) -> None:
    """Raise a :class:`ConfigError` with one line per problem, if there is any (nothing otherwise).

    What a component's ``validate`` hook returns, refused in one error where
    the component checks itself (a trainer built without the experiment's checks).
    """
    lines = list(dict.fromkeys(problems))  # each once, in order
    if lines:
        raise ConfigError("\n".join(lines))


class CheckpointError(NipLikeError):
    """A checkpoint is missing, corrupt, or belongs to a different run."""


class TrainingError(NipLikeError, RuntimeError):
    """Training cannot go on, for example because a loss became NaN."""


class SweepJobError(NipLikeError):
    """A job of a sweep failed; the message names its folder and the reason."""


class ReportError(NipLikeError, ValueError):
    """Run folders cannot be compared as asked (mixed budgets, missing metrics, no runs)."""


class RunInUseError(NipLikeError):
    """Another process is running in the run folder (it holds the folder's ``run.lock``)."""


class RunInterrupted(NipLikeError):
    """A run stopped on SIGINT or SIGTERM; the message says how to resume it.

    Parameters
    ----------
    message : str
        One line, ending with the resume command.
    exit_status : int
        ``128 +`` the signal number: 130 for SIGINT (Ctrl-C), 143 for SIGTERM.
    """

    def __init__(self, message: str, exit_status: int) -> None:
        super().__init__(message)
        self.exit_status = exit_status


class FineTuneError(NipLikeError):
    """A fine-tune job failed; the message names the job, its error and its log."""


class ModelServerError(NipLikeError):
    """A text-model server is unreachable or refuses the requests."""


class WriteError(NipLikeError, OSError):
    """A file or folder could not be written (a full disk, a file-size limit, a read-only folder).

    Raised by the atomic writers (:mod:`nip_like.checkpoint`,
    :func:`nip_like.lm.agent_folders.save_agent`), which keep the previous file
    or folder whole; the message names what was written, the reason and that.
    An :class:`OSError` too, so code that handles failed writes still does.
    """


def one_line(error: BaseException) -> str:
    """Fold a Hydra or OmegaConf error message (and its cause) into one line."""
    parts: list[str] = []
    for source in (error, error.__cause__):
        if source is None:
            continue
        for line in str(source).splitlines():
            text = line.strip()
            if text.startswith("Config search path"):
                break
            if text and not text.startswith(("reference_type", "object_type")) and text not in parts:
                parts.append(text)
    return "; ".join(parts).replace(":; ", ": ")
