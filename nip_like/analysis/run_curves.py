"""The learning curves of one run, or of a few runs side by side: the figure of ``python -m nip_like.analyse plot``.

A run folder here is any folder ``python -m nip_like`` wrote: its
``config.yaml`` is enough, so a run still in progress (no ``summary.json``
yet) can be plotted too. Curves come from the CSV metrics
(``metrics/scalars/``, the ``csv`` logger, on by default). Each metric gets
a panel, each run a colour; a curve is the values the run logged, point by
point, from step 0 (the initial policy) when the run logged it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from nip_like.analysis.runs import FRAMES_METRIC, ITERATION_SECONDS_METRIC, Run  # noqa: E402
from nip_like.errors import ReportError  # noqa: E402
from nip_like.experiment import CONFIG_FILE, SUMMARY_FILE  # noqa: E402

#: The curves drawn when none are named, those a run logged, in this order.
MAIN_METRICS = (
    "train/reward",
    "eval/reward",
    "train/accuracy",
    "eval/accuracy",
    "loss/policy",
    "objective/kl",
)

#: What the curves can be drawn against: the step (iteration), frames collected, train-loop wall time.
X_AXES = {
    "iteration": "iteration",
    "frames": "frames collected",
    "seconds": "train-loop wall time (s)",
}

#: Curves with at most this many points are drawn with markers.
FEW_POINTS = 40


def open_run_folder(folder: Path) -> Run:
    """Read a run folder, finished or not, or fail in one line saying why it is not one.

    Raises
    ------
    ReportError
        If ``folder`` is not a folder, has no ``config.yaml``, or a file
        cannot be read.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise ReportError(f"{folder} is not a folder; give a run folder (outputs/<date>/<time>_<name>/)")
    if not (folder / CONFIG_FILE).is_file():
        inside = sorted(path.parent.name for path in folder.glob(f"*/{CONFIG_FILE}"))
        hint = f"; it holds run folders: {', '.join(inside[:3])}{' ...' if len(inside) > 3 else ''}" if inside else ""
        raise ReportError(
            f"{folder} is not a run folder: it has no {CONFIG_FILE} (a run folder is what python -m nip_like "
            f"writes: {CONFIG_FILE}, metrics/, checkpoints/ and, once finished, {SUMMARY_FILE}){hint}"
        )
    try:
        config = OmegaConf.to_container(OmegaConf.load(folder / CONFIG_FILE), resolve=True)
    except Exception as error:  # bad YAML: OmegaConf raises several types
        raise ReportError(f"{folder / CONFIG_FILE} cannot be read ({type(error).__name__})") from error
    summary = {}
    if (folder / SUMMARY_FILE).is_file():
        try:
            summary = json.loads((folder / SUMMARY_FILE).read_text())
        except (OSError, ValueError) as error:
            raise ReportError(f"{folder / SUMMARY_FILE} cannot be read as JSON ({type(error).__name__})") from error
    return Run(folder=folder, summary=summary if isinstance(summary, dict) else {}, config=config)


def logged_metrics(run: Run) -> list[str]:
    """The metrics a run logged to CSV (``metrics/scalars/<name>.csv``), sorted."""
    scalars = run.folder / "metrics" / "scalars"
    return sorted(path.relative_to(scalars).with_suffix("").as_posix() for path in scalars.rglob("*.csv"))


def choose_metrics(runs: Sequence[Run], asked: Sequence[str]) -> list[str]:
    """The metrics to draw: those ``asked``, each logged by some run, or by default the main ones logged.

    Raises
    ------
    ReportError
        If a run logged no CSV metric, a metric asked for is logged by no
        run (naming those that are), or none of :data:`MAIN_METRICS` is.
    """
    logged: set[str] = set()
    for run in runs:
        names = logged_metrics(run)
        if not names:
            raise ReportError(
                f"run {run.folder} has no CSV metrics (metrics/scalars/ is empty or absent): it ran without the "
                f"csv logger (logger=csv is the default)"
            )
        logged.update(names)
    missing = [name for name in asked if name not in logged]
    if missing:
        where = "the runs" if len(runs) > 1 else f"run {runs[0].folder}"
        raise ReportError(f"metric {missing[0]!r} is not logged by {where}; logged: {', '.join(sorted(logged))}")
    if asked:
        return list(dict.fromkeys(asked))
    chosen = [name for name in MAIN_METRICS if name in logged]
    if not chosen:
        raise ReportError(
            f"none of the main metrics ({', '.join(MAIN_METRICS)}) is logged; name the metrics to draw, from: "
            f"{', '.join(sorted(logged))}"
        )
    return chosen


def run_label(run: Run, runs: Sequence[Run]) -> str:
    """A run's name in a legend: its folder's name, with its parent's when two runs share a name."""
    names = [other.folder.name for other in runs]
    if names.count(run.folder.name) > 1:
        return f"{run.folder.parent.name}/{run.folder.name}"
    return run.folder.name


def run_curves_figure(runs: Sequence[Run], metrics: Sequence[str], x_axis: str = "iteration") -> plt.Figure:
    """Draw each of ``metrics`` for every run, one panel per metric; return the figure.

    Parameters
    ----------
    runs : sequence of Run
        Run folders (:func:`open_run_folder`).
    metrics : sequence of str
        Metrics to draw; a run that did not log one is left out of its panel.
    x_axis : str
        ``iteration`` (the step), ``frames`` (``train/frames``) or
        ``seconds`` (the running sum of ``timers/iteration``).

    Raises
    ------
    ReportError
        If ``x_axis`` is unknown, or a run lacks the metric it needs.
    """
    if x_axis not in X_AXES:
        raise ReportError(f"--x must be one of {', '.join(X_AXES)}, got {x_axis!r}")
    needed = {"frames": FRAMES_METRIC, "seconds": ITERATION_SECONDS_METRIC}.get(x_axis)
    for run in runs:
        if needed is not None and not run.has_metric(needed):
            raise ReportError(f"run {run.folder} has no {needed} to draw against {x_axis}; use --x iteration")
    columns = min(3, len(metrics))
    rows = -(-len(metrics) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(5.0 * columns, 3.6 * rows), squeeze=False)
    palette = plt.get_cmap("tab10")
    for axis, metric in zip(axes.flat, metrics):
        for index, run in enumerate(runs):
            if not run.has_metric(metric):
                continue
            steps, values = run.curve(metric)
            x = {"frames": run.frames_at, "seconds": run.seconds_at}.get(x_axis, lambda steps: steps)(steps)
            marker = "o" if len(x) <= FEW_POINTS else None
            axis.plot(x, values, color=palette(index % 10), marker=marker, markersize=3, linewidth=1.6,
                      label=run_label(run, runs))
        axis.set_title(metric)
        axis.set_xlabel(X_AXES[x_axis])
        axis.grid(alpha=0.3)
        if len(runs) > 1:
            axis.legend(fontsize="small")
    for axis in list(axes.flat)[len(metrics):]:
        axis.set_visible(False)
    title = run_label(runs[0], runs) if len(runs) == 1 else f"{len(runs)} runs side by side"
    figure.suptitle(f"{title}: values as logged", fontsize="medium")
    figure.tight_layout()
    return figure


def write_run_curves(runs: Sequence[Run], metrics: Sequence[str], x_axis: str, path: Path) -> Path:
    """Draw :func:`run_curves_figure` and save it as a PNG at ``path``; return ``path``."""
    figure = run_curves_figure(runs, metrics, x_axis)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
