"""The job log: one summary line every N iterations, and the final test metrics.

Under Hydra, Python's root logger writes INFO records to the console
(standard output) and to the run's job log, ``<run folder>/__main__.log``.
:class:`JobLog` sees every metric a run logs (through
:class:`~nip_like.logging.MetricLogger`) and writes there

* every ``logger.log_every`` iterations, one line with the main metrics of
  that iteration and the latest evaluation (``iteration 20: train/reward
  0.312, eval/reward 0.400 (at 18), loss/policy -0.0143, SPS 2.1e+03,
  timers/iteration 0.52``);
* once, the final test metrics (the ``test/...`` metrics);
* at the start, one line per cache entry the run reads or writes (a
  dataset, a warm start, a GGUF conversion, ...: ``cache: dataset
  gi_pairs_0a1b2c3d4e5f6a7b built (sha256 0123456789ab) /home/...``,
  :mod:`nip_like.cache_record`), each when the run first uses it.

The periodic lines go to the console as well when the progress bar is not
drawn there: when standard error is not a terminal (a cluster job's file),
tqdm stays silent and these lines take its place. At a terminal they go to
the job log only, beside the bar. The final metrics go to the job log only:
the console gets them from ``logger.print_metrics``. Outside Hydra (a test,
a notebook) the root logger is at WARNING and nothing is written.
"""

from __future__ import annotations

import logging
import sys
from typing import Mapping, TextIO

#: Where the lines come from (a child of ``nip_like``, so that the root logger's handlers write them).
LOG = logging.getLogger("nip_like.progress")

#: Namespace of the final test metrics.
FINAL_PREFIX = "test/"

#: The metric each trainer's loop logs last in an iteration: its line can be written then.
ITERATION_END = "timers/iteration"

#: Metrics of the periodic line, in this order, when the run logs them.
LINE_METRICS = (
    "train/reward",
    "train/accuracy",
    "eval/reward",
    "eval/accuracy",
    "loss/policy",
    "loss/value",
    "objective/kl",
    "SPS",
    "timers/iteration",
)


def is_terminal(stream: TextIO | None = None) -> bool:
    """Whether ``stream`` (standard error, where tqdm draws its bar, by default) is a terminal."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


def job_log_handlers() -> list[logging.Handler]:
    """The file handlers of the root logger: Hydra's job log (``__main__.log``), if any."""
    return [handler for handler in logging.getLogger().handlers if isinstance(handler, logging.FileHandler)]


def write_job_log(message: str) -> None:
    """Write ``message`` as an INFO line to the job log only (not the console); nothing when INFO is off (outside Hydra)."""
    if not LOG.isEnabledFor(logging.INFO):
        return
    record = LOG.makeRecord(LOG.name, logging.INFO, __file__, 0, message, None, None)
    for handler in job_log_handlers():
        if record.levelno >= handler.level:
            handler.handle(record)


def format_value(value: float) -> str:
    """A metric value in at most about four significant digits."""
    return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.3g}"


class JobLog:
    """Write a run's periodic summary lines and its final metrics to the job log.

    Parameters
    ----------
    every : int
        Write a line every ``every`` iterations (steps); 0 writes none.
    console : bool, optional
        Whether the periodic lines go to the console too; by default when
        standard error is not a terminal (:func:`is_terminal`).
    """

    def __init__(self, every: int, console: bool | None = None) -> None:
        if every < 0:
            raise ValueError(f"every must be >= 0, got {every}")
        self.every = int(every)
        self.console = not is_terminal() if console is None else bool(console)
        self.latest: dict[str, tuple[float, int]] = {}
        self._step: int | None = None
        self._pending = False

    def observe(self, metrics: Mapping[str, float], step: int) -> None:
        """Take the metrics one call of :meth:`MetricLogger.log` logged at ``step``.

        A step's line is written once its metrics are all in: when the
        iteration logs ``timers/iteration``, when a later step is logged,
        when the final metrics come, or at :meth:`close`.
        """
        if self._step is not None and step != self._step:
            self._write_pending()
        self._step = step
        final = {name: float(value) for name, value in metrics.items() if name.startswith(FINAL_PREFIX)}
        others = {name: float(value) for name, value in metrics.items() if name not in final}
        if others:
            self.latest.update({name: (value, step) for name, value in others.items()})
            self._pending = self._pending or (self.every > 0 and step > 0 and step % self.every == 0)
        if ITERATION_END in others or final:
            self._write_pending()
        if final:
            shown = ", ".join(f"{name} {format_value(value)}" for name, value in sorted(final.items()))
            self._write(f"final test metrics (iteration {step}): {shown}", console=False)

    def line(self, step: int) -> str:
        """The summary line of ``step``: the main metrics, each marked with its step when logged before it."""
        parts = []
        for name in LINE_METRICS:
            if name in self.latest:
                value, logged = self.latest[name]
                parts.append(f"{name} {format_value(value)}" + (f" (at {logged})" if logged != step else ""))
        return f"iteration {step}: " + (", ".join(parts) if parts else "no main metric logged")

    def close(self) -> None:
        """Write the line of the last step if it is still due."""
        self._write_pending()

    def _write_pending(self) -> None:
        if self._pending and self._step is not None:
            self._write(self.line(self._step), console=self.console)
        self._pending = False

    def _write(self, message: str, console: bool) -> None:
        if console:
            LOG.info(message)
        else:
            write_job_log(message)
