"""Stop a run cleanly on Ctrl-C (SIGINT) or SIGTERM.

:func:`~nip_like.experiment.run_experiment` runs inside :func:`handle_interrupts`.
The first SIGINT or SIGTERM only records the request. The train loops look at
:func:`stop_requested` between iterations (:meth:`nip_like.trainers.base.Trainer.stop_if_requested`):
there the state is whole, so they write ``checkpoints/last.pt`` (unless it
already holds that iteration) and raise :class:`StopRequested`, which
``run_experiment`` turns into :class:`~nip_like.errors.RunInterrupted`: one
line on standard error with the resume command, and exit status 128 + the
signal number (130 for SIGINT, 143 for SIGTERM). A second signal raises
:class:`KeyboardInterrupt` at once, wherever the run is.

Work that can wait long inside one iteration or stage (a request to a model
server, a fine-tune job, a long generation) does not wait for the next safe
point: it calls :func:`raise_if_stop_requested` while it waits, or waits
through :func:`sleep`, which raise :class:`StopNow` within
:data:`POLL_SECONDS` of the first signal. The run then stops with the work
since its last checkpoint dropped; a resume starts that iteration or stage
again.

Long computations call :func:`stop_point` at each of their steps (a warm
start's minibatch, an update's minibatch, an episode's step, a token of a
language model's message, a drawn datapoint of a dataset). It raises
:class:`StopNow` once :data:`GRACE_SECONDS` have passed since the first
signal without the run reaching a safe point: an iteration that ends soon
still ends, and is saved, as before; a long one is dropped, and the run is
resumed from its last checkpoint (or started again when it has none). Until
a signal comes, a call costs a look at a list: no system call, no clock.

A signal that the process was started with ignored (a shell's background job
ignores SIGINT) stays ignored.
"""

from __future__ import annotations

import signal
import threading
import time
from contextlib import contextmanager
from typing import Iterator

#: The signals that stop a run.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

#: How often a wait looks for a stop request (seconds).
POLL_SECONDS = 0.1

#: How long after the first signal :func:`stop_point` lets a computation go on toward the next safe point (seconds).
GRACE_SECONDS = 2.0

_requested: list[int] = []  # the signals received while handle_interrupts is active, in order
_requested_at: list[float] = []  # time.monotonic() of the first of them
_active = False


class StopRequested(BaseException):
    """Raised by a loop at a safe point after a stop request.

    A :class:`BaseException`, like :class:`KeyboardInterrupt`, so that an
    ``except Exception`` on the way does not swallow it.

    Parameters
    ----------
    iteration : int
        The train iterations completed (and saved in ``checkpoints/last.pt``).
    phase : str
        ``"train"`` (between train iterations) or ``"test"`` (in the test loop).
    """

    def __init__(self, iteration: int, phase: str = "train") -> None:
        super().__init__(f"stop requested after iteration {iteration} ({phase})")
        self.iteration = iteration
        self.phase = phase


class StopNow(BaseException):
    """Raised inside a long wait after a stop request: the work since the last checkpoint is dropped.

    Parameters
    ----------
    what : str
        What was waited for (``"a reply from the server at <url>"``), or with
        ``waiting=False`` the computation that was under way (``"the update"``),
        for the report.
    waiting : bool
        Whether ``what`` was waited for (:func:`raise_if_stop_requested`) or
        computed (:func:`stop_point`).

    Attributes
    ----------
    where : str
        ``"waiting for <what>"`` or ``"in <what>"``: where the run was, for its one line.
    during : str or None
        The part of the run it was in, where a loop on the way knows it better
        than the run's counters do (the train loop sets ``"in the evaluation
        after iteration N"``: that evaluation runs after ``state.iteration``
        has counted iteration N); ``None`` lets the report say it from the state.
    """

    def __init__(self, what: str, waiting: bool = True) -> None:
        self.what = what
        self.where = f"waiting for {what}" if waiting else f"in {what}"
        self.during: str | None = None
        super().__init__(f"stopped while {self.where}")


def raise_if_stop_requested(what: str) -> None:
    """Raise :class:`StopNow` if SIGINT or SIGTERM asked the run to stop; ``what`` is being waited for."""
    if _requested:
        raise StopNow(what)


def stop_point(phase: str) -> None:
    """Raise :class:`StopNow` if a stop request has waited :data:`GRACE_SECONDS` for a safe point.

    Long computations call it at each step; ``phase`` names the computation
    (``"the update"``, ``"the warm start of prover"``) in the run's one line.
    Pass a fixed string where it is called often (each token): building one
    costs more than the check.
    """
    if _requested and stop_due():
        raise StopNow(phase, waiting=False)


def stop_due() -> bool:
    """Whether a stop request has waited :data:`GRACE_SECONDS` (a computation should stop now, wherever it is)."""
    return bool(_requested_at) and time.monotonic() - _requested_at[0] >= GRACE_SECONDS


def sleep(seconds: float, what: str) -> None:
    """``time.sleep(seconds)``, cut short by a stop request (:class:`StopNow`)."""
    deadline = time.monotonic() + seconds
    while True:
        raise_if_stop_requested(what)
        left = deadline - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(left, POLL_SECONDS))


def stop_requested() -> bool:
    """Whether SIGINT or SIGTERM asked the running experiment to stop."""
    return bool(_requested)


def requested_signal() -> int | None:
    """The last stop signal received, or ``None``."""
    return _requested[-1] if _requested else None


def _handler(signum: int, frame: object) -> None:
    if not _requested_at:
        _requested_at.append(time.monotonic())
    _requested.append(signum)
    if len(_requested) > 1:
        raise KeyboardInterrupt


@contextmanager
def handle_interrupts(enabled: bool = True) -> Iterator[None]:
    """Turn SIGINT and SIGTERM into stop requests while the block runs.

    Parameters
    ----------
    enabled : bool
        ``False`` leaves the signals as they are (the jobs of a Hydra multirun,
        whose launcher handles Ctrl-C itself).

    Notes
    -----
    Only the main thread can install signal handlers; elsewhere, and inside an
    outer ``handle_interrupts``, this does nothing. The previous handlers and a
    clear request state come back when the block ends.
    """
    global _active
    if not enabled or _active or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}
    for signum in STOP_SIGNALS:
        current = signal.getsignal(signum)
        if current is signal.SIG_IGN or current is None:
            continue
        previous[signum] = current
        signal.signal(signum, _handler)
    _active = True
    _requested.clear()
    _requested_at.clear()
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _active = False
        _requested.clear()
        _requested_at.clear()
