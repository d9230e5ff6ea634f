"""The comparison report: tables (Markdown and CSV) and plots from a sweep's run folders.

For each task (by default a scenario and a protocol) and each objective (by
default a trainer type) it gives

* the final held-out metrics (``test/...`` in ``summary.json``) as the IQM and
  the mean over seeds, each with a percentile-bootstrap confidence interval
  (from :data:`~nip_like.analysis.statistics.MIN_RUNS_FOR_INTERVALS` runs on;
  below, the range of the runs, labelled as such);
* the frames and the train-loop wall time each run took to reach a threshold
  on a learning curve (``eval/reward >= 0.9`` by default): the median over
  seeds, a run that never reached it counting as infinitely late;
* the probability that a run of one objective beats a run of another on the
  primary metric, with its bootstrap interval (below
  :data:`~nip_like.analysis.statistics.MIN_RUNS_FOR_INTERVALS` runs on either
  side, the share of run pairs, marked as not estimated);
* the budget: frames, held-out episodes and gradient steps per run, checked
  by :func:`nip_like.analysis.budgets.check_budgets`;

and three figures: learning curves against frames and against wall time, and
reward against KL from the initial policy.

A report on fewer than :data:`~nip_like.analysis.statistics.MIN_RUNS_FOR_INTERVALS`
runs per objective says so in its first line and in the header of every table.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from nip_like.analysis.budgets import GradientStepRule, check_budgets
from nip_like.analysis.groups import OBJECTIVE_KEYS, TASK_KEYS, Group, check_seeds_only, group_runs
from nip_like.analysis.plots import plot_learning_curves, plot_reward_against_kl
from nip_like.analysis.runs import FRAMES_METRIC, ITERATION_SECONDS_METRIC, FoundRuns
from nip_like.analysis.statistics import (
    MIN_RUNS_FOR_INTERVALS,
    first_crossing,
    interquartile_mean,
    mean,
    probability_of_improvement,
    probability_of_improvement_ci,
    score_range,
    stratified_bootstrap_ci,
)
from nip_like.errors import ReportError

#: Test metrics that count episodes rather than measure performance.
NOT_PERFORMANCE = ("test/episodes",)

#: Files a report writes.
MARKDOWN_FILE = "report.md"
SUMMARY_CSV = "summary.csv"
METRICS_CSV = "final_metrics.csv"
IMPROVEMENT_CSV = "probability_of_improvement.csv"
PLOT_FILES = {
    "frames": "curves_frames.png",
    "seconds": "curves_wall_time.png",
    "kl": "reward_vs_kl.png",
}


@dataclass
class ReportOptions:
    """What a report compares and how.

    Parameters
    ----------
    metrics : list of str, optional
        Final metrics to tabulate; by default every ``test/`` metric that all
        runs of a task have, except ``test/episodes``.
    primary_metric : str
        The metric of the summary table and of the probability of improvement.
    curve_metric : str
        The learning-curve metric of the plots.
    threshold : float
        The level a run must reach on ``threshold_metric``.
    threshold_metric : str, optional
        The curve the threshold applies to; ``curve_metric`` by default.
    threshold_mode : str
        ``max`` (reach means ``>=``) or ``min`` (``<=``).
    reward_metric, kl_metric : str
        The axes of the reward-against-KL plot.
    gradient_steps : GradientStepRule
        How gradient steps must match.
    allow_mixed_budgets : bool
        Compare runs whose budgets differ (the report says so).
    objective_keys, task_keys : sequence of str
        Config keys naming a run's objective and task.
    objectives : sequence of str, optional
        Objectives to keep, in this order.
    reps : int
        Bootstrap resamples.
    confidence : float
        Coverage of every interval.
    seed : int
        Seed of the bootstrap generators.
    plots : bool
        Draw the figures.
    """

    metrics: list[str] | None = None
    primary_metric: str = "test/reward"
    curve_metric: str = "eval/reward"
    threshold: float = 0.9
    threshold_metric: str | None = None
    threshold_mode: str = "max"
    reward_metric: str = "train/reward"
    kl_metric: str = "objective/kl"
    gradient_steps: GradientStepRule = field(default_factory=GradientStepRule)
    allow_mixed_budgets: bool = False
    objective_keys: Sequence[str] = OBJECTIVE_KEYS
    task_keys: Sequence[str] = TASK_KEYS
    objectives: Sequence[str] | None = None
    reps: int = 10_000
    confidence: float = 0.95
    seed: int = 0
    plots: bool = True

    @property
    def crossing_metric(self) -> str:
        """The curve the threshold applies to."""
        return self.threshold_metric or self.curve_metric


@dataclass
class TaskReport:
    """The tables of one task.

    Parameters
    ----------
    task : str
        The task's label.
    groups : list of Group
        One per objective.
    notes : list of str
        Sentences about the budget.
    summary : list of dict
        One row per objective (see :data:`SUMMARY_COLUMNS`).
    metrics : list of dict
        One row per objective and final metric.
    improvement : list of dict
        One row per pair of objectives.
    """

    task: str
    groups: list[Group]
    notes: list[str]
    summary: list[dict[str, Any]]
    metrics: list[dict[str, Any]]
    improvement: list[dict[str, Any]]


@dataclass
class Report:
    """A whole report: the tasks' tables, the options and the folders left out."""

    tasks: list[TaskReport]
    options: ReportOptions
    unfinished: list[Path]
    roots: list[Path]
    kl_plot: bool = True  # every run logs the KL metric, so the reward-against-KL plot is drawn

    @property
    def groups(self) -> dict[str, list[Group]]:
        """``{task: groups}``, as the plots take them."""
        return {task.task: task.groups for task in self.tasks}

    @property
    def run_counts(self) -> list[int]:
        """The number of runs of every group, in order."""
        return [len(group.runs) for task in self.tasks for group in task.groups]

    @property
    def few_runs(self) -> bool:
        """Whether some objective has fewer runs than intervals need (:data:`MIN_RUNS_FOR_INTERVALS`)."""
        return min(self.run_counts) < MIN_RUNS_FOR_INTERVALS


def interval_label(runs: int, confidence: float) -> str:
    """What the interval of a statistic over ``runs`` runs is: a bootstrap interval, or the range of a few runs."""
    if runs >= MIN_RUNS_FOR_INTERVALS:
        return f"{confidence:.0%} bootstrap CI"
    return "range of 1 run" if runs == 1 else f"range of {runs} runs"


def _score_columns(scores: list[float], options: ReportOptions) -> dict[str, Any]:
    """IQM and mean of ``scores``, each with its interval, and what the interval is, as table columns.

    The interval is a bootstrap confidence interval from
    :data:`MIN_RUNS_FOR_INTERVALS` runs on, and the range of the runs below.
    """
    columns: dict[str, Any] = {}
    for name, statistic in (("iqm", interquartile_mean), ("mean", mean)):
        if len(scores) >= MIN_RUNS_FOR_INTERVALS:
            low, high = stratified_bootstrap_ci([scores], statistic, options.reps, options.confidence, options.seed)
        else:
            low, high = score_range(scores)
        columns.update({name: statistic(scores), f"{name}_low": low, f"{name}_high": high})
    columns["interval"] = interval_label(len(scores), options.confidence)
    return columns


def _task_metrics(groups: list[Group], options: ReportOptions) -> list[str]:
    runs = [run for group in groups for run in group.runs]
    shared = set.intersection(*(set(run.test_metrics) for run in runs))
    if options.metrics:
        missing = [name for name in options.metrics if name not in shared]
        if missing:
            raise ReportError(f"metrics {missing} are not in every run's test_metrics; every run has {sorted(shared)}")
        names = list(options.metrics)
    else:
        names = sorted(name for name in shared if name not in NOT_PERFORMANCE)
    if options.primary_metric not in shared:
        raise ReportError(
            f"primary metric {options.primary_metric!r} is not in every run's test_metrics; "
            f"choose one of {sorted(shared)} with --primary-metric"
        )
    return [options.primary_metric] + [name for name in names if name != options.primary_metric]


def _crossing(run, options: ReportOptions) -> tuple[float, float]:
    """Frames and seconds at which a run first reached the threshold (``inf`` if never)."""
    steps, values = run.curve(options.crossing_metric)
    step = first_crossing(steps, values, options.threshold, options.threshold_mode)
    if step is None:
        return math.inf, math.inf
    return float(run.frames_at(np.array([step]))[0]), float(run.seconds_at(np.array([step]))[0])


def _summary_row(task: str, group: Group, options: ReportOptions) -> dict[str, Any]:
    scores = [float(run.test_metrics[options.primary_metric]) for run in group.runs]
    crossings = [_crossing(run, options) for run in group.runs]
    frames = sorted({run.frames for run in group.runs}, key=str)
    steps = [run.gradient_steps for run in group.runs if run.gradient_steps is not None]
    seconds = [run.train_seconds for run in group.runs if run.train_seconds is not None]
    return {
        "task": task,
        "objective": group.objective,
        "runs": len(group.runs),
        "seeds": " ".join(str(seed) for seed in group.seeds),
        "frames_per_run": frames[0] if len(frames) == 1 else " ".join(str(value) for value in frames),
        "gradient_steps_median": float(np.median(steps)) if steps else math.nan,
        "gradient_steps_min": min(steps) if steps else math.nan,
        "gradient_steps_max": max(steps) if steps else math.nan,
        "train_seconds_median": float(np.median(seconds)) if seconds else math.nan,
        "metric": options.primary_metric,
        **_score_columns(scores, options),
        "threshold_metric": options.crossing_metric,
        "threshold": options.threshold,
        "reached": sum(math.isfinite(frames_at) for frames_at, _ in crossings),
        "frames_to_threshold_median": float(np.median([frames_at for frames_at, _ in crossings])),
        "seconds_to_threshold_median": float(np.median([seconds_at for _, seconds_at in crossings])),
    }


def _metric_rows(task: str, group: Group, names: list[str], options: ReportOptions) -> list[dict[str, Any]]:
    rows = []
    for name in names:
        scores = [float(run.test_metrics[name]) for run in group.runs]
        row = {"task": task, "objective": group.objective, "metric": name, "runs": len(scores)}
        rows.append({**row, **_score_columns(scores, options)})
    return rows


def _improvement_rows(task: str, groups: list[Group], options: ReportOptions) -> list[dict[str, Any]]:
    rows = []
    metric = options.primary_metric
    for index, first in enumerate(groups):
        for second in groups[index + 1 :]:
            x = [float(run.test_metrics[metric]) for run in first.runs]
            y = [float(run.test_metrics[metric]) for run in second.runs]
            estimated = min(len(x), len(y)) >= MIN_RUNS_FOR_INTERVALS
            if estimated:
                low, high = probability_of_improvement_ci(x, y, options.reps, options.confidence, options.seed)
            else:
                low, high = math.nan, math.nan
            rows.append(
                {
                    "task": task,
                    "metric": metric,
                    "x": first.objective,
                    "y": second.objective,
                    "probability": probability_of_improvement(x, y),
                    "low": low,
                    "high": high,
                    "runs_x": len(x),
                    "runs_y": len(y),
                    "interval": f"{options.confidence:.0%} bootstrap CI" if estimated else "not estimated",
                }
            )
    return rows


def build_report(found: FoundRuns, options: ReportOptions, roots: Sequence[Path] = ()) -> Report:
    """Group the runs, check budgets and compute every table.

    Raises
    ------
    ReportError
        If there is nothing to compare, a group mixes configurations, the
        budgets differ (unless allowed) or a metric is missing.
    """
    if options.threshold_mode not in ("max", "min"):
        raise ReportError(f"--threshold-mode must be 'max' or 'min', got {options.threshold_mode!r}")
    if not 0.0 < options.confidence < 1.0:
        raise ReportError(f"--confidence must be between 0 and 1, got {options.confidence}")
    tasks = group_runs(found.runs, options.objective_keys, options.task_keys, options.objectives)
    # Budgets first: a group whose runs differ in budget is better told so than that its configs differ.
    notes = {
        task: check_budgets(task, groups, options.gradient_steps, options.allow_mixed_budgets)
        for task, groups in tasks.items()
    }
    check_seeds_only(tasks, ("trainer.num_iterations",) if options.allow_mixed_budgets else ())
    # Read every curve the report needs now, so that a missing one stops it before it writes a file.
    needed = [options.crossing_metric, FRAMES_METRIC, ITERATION_SECONDS_METRIC]
    runs = [run for groups in tasks.values() for group in groups for run in group.runs]
    # The reward-against-KL plot needs both curves in every run; trainers that measure no KL (the
    # text trainers) leave it out of the report rather than stop it.
    kl_plot = options.plots and all(run.has_metric(options.kl_metric) for run in runs)
    if options.plots:
        needed += [options.curve_metric]
    if kl_plot:
        needed += [options.reward_metric, options.kl_metric]
    for run in runs:
        for metric in needed:
            run.curve(metric)
    reports = []
    for task, groups in tasks.items():
        names = _task_metrics(groups, options)
        reports.append(
            TaskReport(
                task=task,
                groups=groups,
                notes=notes[task],
                summary=[_summary_row(task, group, options) for group in groups],
                metrics=[row for group in groups for row in _metric_rows(task, group, names, options)],
                improvement=_improvement_rows(task, groups, options),
            )
        )
    return Report(
        tasks=reports, options=options, unfinished=found.unfinished, roots=[Path(root) for root in roots], kl_plot=kl_plot
    )


# ------------------------------------------------------------------ formatting
def _value(value: float) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.3f}"


def _with_interval(value: float, low: float, high: float, interval: str = "") -> str:
    if interval.startswith("range"):
        return f"{_value(value)} ({interval}: {_value(low)} to {_value(high)})"
    if math.isnan(low):
        return f"{_value(value)} [n/a]"
    return f"{_value(value)} [{_value(low)}, {_value(high)}]"


def _interval_header(rows: list[dict[str, Any]], options: ReportOptions) -> str:
    """The interval part of a column header: what the cells' intervals are."""
    ranges = [row for row in rows if row["interval"].startswith("range")]
    if not ranges:
        return f"[{options.confidence:.0%} CI]"
    few = f"(range of the runs: fewer than {MIN_RUNS_FOR_INTERVALS}, no CI)"
    return few if len(ranges) == len(rows) else f"[{options.confidence:.0%} CI] or {few}"


def _count(value: float) -> str:
    if isinstance(value, str):
        return value
    if value is None or math.isnan(value):
        return "n/a"
    if math.isinf(value):
        return "not reached"
    return f"{value:,.0f}"


def _seconds(value: float) -> str:
    if value is None or math.isnan(value):
        return "n/a"
    return "not reached" if math.isinf(value) else f"{value:.1f}"


def _steps(row: dict[str, Any]) -> str:
    if math.isnan(row["gradient_steps_median"]):
        return "n/a"
    if row["gradient_steps_min"] == row["gradient_steps_max"]:
        return f"{row['gradient_steps_min']:,}"
    return f"{row['gradient_steps_median']:,.0f} ({row['gradient_steps_min']:,}-{row['gradient_steps_max']:,})"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def summary_table(task: TaskReport, options: ReportOptions) -> str:
    """The per-objective summary of one task, as a Markdown table."""
    level = f"{options.crossing_metric} {'≥' if options.threshold_mode == 'max' else '≤'} {options.threshold:g}"
    interval = _interval_header(task.summary, options)
    header = [
        "objective",
        "seeds",
        f"{options.primary_metric} IQM {interval}",
        f"{options.primary_metric} mean {interval}",
        f"runs reaching {level}",
        "frames to reach (median)",
        "seconds to reach (median)",
        "frames / run",
        "gradient steps / run",
        "train seconds / run (median)",
    ]
    rows = [
        [
            row["objective"],
            str(row["runs"]),
            _with_interval(row["iqm"], row["iqm_low"], row["iqm_high"], row["interval"]),
            _with_interval(row["mean"], row["mean_low"], row["mean_high"], row["interval"]),
            f"{row['reached']}/{row['runs']}",
            _count(row["frames_to_threshold_median"]),
            _seconds(row["seconds_to_threshold_median"]),
            _count(row["frames_per_run"]) if isinstance(row["frames_per_run"], int) else str(row["frames_per_run"]),
            _steps(row),
            _seconds(row["train_seconds_median"]),
        ]
        for row in task.summary
    ]
    return _table(header, rows)


def metrics_table(task: TaskReport, options: ReportOptions) -> str:
    """Every final metric of one task, IQM and mean per objective, as a Markdown table."""
    interval = _interval_header(task.metrics, options)
    header = ["metric", "objective", "runs", f"IQM {interval}", f"mean {interval}"]
    rows = sorted(task.metrics, key=lambda row: (row["metric"] != options.primary_metric, row["metric"]))
    return _table(
        header,
        [
            [
                row["metric"],
                row["objective"],
                str(row["runs"]),
                _with_interval(row["iqm"], row["iqm_low"], row["iqm_high"], row["interval"]),
                _with_interval(row["mean"], row["mean_low"], row["mean_high"], row["interval"]),
            ]
            for row in rows
        ],
    )


def improvement_table(task: TaskReport, options: ReportOptions) -> str:
    """The probability of improvement between each pair of objectives, as a Markdown table.

    A pair with fewer than :data:`MIN_RUNS_FOR_INTERVALS` runs on either side
    gets the share of run pairs in which X scored higher, marked as not
    estimated.
    """
    few = [row for row in task.improvement if row["interval"] == "not estimated"]
    label = f"P(X > Y) on {options.primary_metric}"
    if not few:
        label += f" [{options.confidence:.0%} CI]"
    elif len(few) == len(task.improvement):
        label += f" (not estimated: fewer than {MIN_RUNS_FOR_INTERVALS} runs; share of run pairs)"
    else:
        label += f" [{options.confidence:.0%} CI] or (not estimated: fewer than {MIN_RUNS_FOR_INTERVALS} runs)"
    header = ["X", "Y", "runs", label]
    rows = [[row["x"], row["y"], f"{row['runs_x']} vs {row['runs_y']}", _improvement_cell(row)] for row in task.improvement]
    return _table(header, rows)


def _improvement_cell(row: dict[str, Any]) -> str:
    if row["interval"] != "not estimated":
        return _with_interval(row["probability"], row["low"], row["high"])
    pairs = row["runs_x"] * row["runs_y"]
    return f"{_value(row['probability'])} ({row['probability'] * pairs:g} of {pairs} run pairs; not estimated)"


def few_runs_line(report: Report) -> str:
    """The report's first line: its title, and a warning when some objective has too few runs for intervals."""
    if not report.few_runs:
        return "# Objective comparison"
    counts = sorted(set(report.run_counts))
    shown = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]} to {counts[-1]}"
    return (
        f"# Objective comparison: only {shown} runs per objective, too few for confidence intervals "
        f"(at least {MIN_RUNS_FOR_INTERVALS} needed)"
    )


def format_markdown(report: Report, plot_files: dict[str, str] | None = None) -> str:
    """Return the whole report as Markdown."""
    options = report.options
    runs = sum(len(group.runs) for task in report.tasks for group in task.groups)
    lines = [few_runs_line(report), ""]
    if report.roots:
        lines.append(f"Runs from {', '.join(f'`{root}`' for root in report.roots)}: {runs} finished runs.")
    if report.unfinished:
        shown = ", ".join(f"`{folder.name}`" for folder in report.unfinished[:5])
        more = f" and {len(report.unfinished) - 5} more" if len(report.unfinished) > 5 else ""
        lines.append(f"Left out: {len(report.unfinished)} unfinished run folders ({shown}{more}).")
    if report.few_runs:
        lines += [
            *([""] if lines[-1] else []),
            f"**Fewer than {MIN_RUNS_FOR_INTERVALS} runs per objective.** Where an objective has fewer, its IQM "
            f"(the mean below 4 runs) and mean come with the range of its runs (lowest to highest), not a "
            f"confidence interval, and a probability of improvement is only the share of run pairs in which X "
            f"scored higher, not an estimate; every table says which. Differences at this size can be chance: "
            f"run more seeds before drawing a conclusion.",
        ]
    lines += [
        "",
        f"Statistics over seeds: interquartile mean (IQM) and mean, each with a {options.confidence:.0%} "
        f"percentile-bootstrap confidence interval ({options.reps:,} resamples of the runs) from "
        f"{MIN_RUNS_FOR_INTERVALS} runs on. "
        f"P(X > Y) is the probability that a run of X scores higher than a run of Y on "
        f"{options.primary_metric}, ties counting one half. Frames and seconds to reach the threshold are "
        f"medians over seeds of the first evaluation at which {options.crossing_metric} reached it "
        f"(a run that never did counts as never); seconds are train-loop wall time.",
    ]
    for task in report.tasks:
        lines += ["", f"## {task.task}", ""]
        lines += [" ".join(task.notes), ""]
        lines += [summary_table(task, options), ""]
        lines += ["Final held-out metrics:", "", metrics_table(task, options), ""]
        if task.improvement:
            lines += ["Probability of improvement:", "", improvement_table(task, options), ""]
    if plot_files:
        lines += ["", "## Plots", ""]
        titles = {
            "frames": f"{options.curve_metric} against frames",
            "seconds": f"{options.curve_metric} against train-loop wall time",
            "kl": f"{options.reward_metric} against {options.kl_metric}",
        }
        for key, name in plot_files.items():
            lines += [f"![{titles[key]}]({name})", ""]
        if not report.kl_plot:
            lines += [f"No plot of {options.reward_metric} against {options.kl_metric}: not every run logs {options.kl_metric}.", ""]
    return "\n".join(lines).rstrip() + "\n"


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def write_report(report: Report, out_dir: Path) -> list[Path]:
    """Write ``report.md``, the CSV tables and the plots into ``out_dir``; return the paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    options = report.options
    written = []
    plot_files: dict[str, str] = {}
    if options.plots:
        groups = report.groups
        for axis in ("frames", "seconds"):
            path = out_dir / PLOT_FILES[axis]
            plot_learning_curves(groups, options.curve_metric, axis, path, options.confidence, options.seed)
            written.append(path)
            plot_files[axis] = PLOT_FILES[axis]
        if report.kl_plot:
            path = out_dir / PLOT_FILES["kl"]
            written.append(plot_reward_against_kl(groups, options.reward_metric, options.kl_metric, path))
            plot_files["kl"] = PLOT_FILES["kl"]
    tables = {
        SUMMARY_CSV: [row for task in report.tasks for row in task.summary],
        METRICS_CSV: [row for task in report.tasks for row in task.metrics],
        IMPROVEMENT_CSV: [row for task in report.tasks for row in task.improvement],
    }
    for name, rows in tables.items():
        if rows:
            _write_csv(out_dir / name, rows)
            written.append(out_dir / name)
    markdown = out_dir / MARKDOWN_FILE
    markdown.write_text(format_markdown(report, plot_files))
    written.insert(0, markdown)
    return written
