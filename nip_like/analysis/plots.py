"""Plots of a comparison: learning curves against frames and wall time, reward against KL.

Every figure has one panel per task and one colour per objective. A learning
curve is the mean over seeds, drawn where every seed has data (from the
latest first point to the earliest last point, so that no run is extended
past its own end), over each seed's own curve. A curve is a step function of
the values a run logged: each value holds until the next, and the mean
changes only at a logged point, so nothing is interpolated.

With :data:`~nip_like.analysis.statistics.MIN_RUNS_FOR_INTERVALS` seeds or
more the mean has a 95% bootstrap band (the runs resampled, as in
:func:`nip_like.analysis.statistics.mean_with_band`) and the seeds are drawn
thin; with fewer there is no band, which so few runs cannot estimate, and
each seed is drawn as clearly as the mean. A run that logged its metric at
step 0 (the initial policy) starts at frame 0 and second 0. Matplotlib runs
with its Agg backend: no display needed.
"""

from __future__ import annotations

from pathlib import Path
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from nip_like.analysis.groups import Group  # noqa: E402
from nip_like.analysis.statistics import MIN_RUNS_FOR_INTERVALS, mean_with_band  # noqa: E402

#: What a learning curve can be drawn against.
X_AXES = {
    "frames": "frames collected",
    "seconds": "train-loop wall time (s)",
}

#: Curves with at most this many points are drawn with markers.
FEW_POINTS = 30

#: How a seed's own curve is drawn: among many seeds, and when there are few (no band then).
RUN_STYLE = {"alpha": 0.3, "linewidth": 0.8}
FEW_RUNS_STYLE = {"alpha": 0.75, "linewidth": 1.4, "linestyle": "--"}


def run_style(runs: int) -> dict[str, float | str]:
    """The line style of each seed's curve in a group of ``runs`` runs."""
    return dict(FEW_RUNS_STYLE if runs < MIN_RUNS_FOR_INTERVALS else RUN_STYLE)


def objective_colors(tasks: dict[str, list[Group]]) -> dict[str, tuple]:
    """Give each objective one colour, the same in every panel and figure."""
    names = sorted({group.objective for groups in tasks.values() for group in groups})
    palette = plt.get_cmap("tab10")
    return {name: palette(index % 10) for index, name in enumerate(names)}


def _panels(count: int) -> tuple[plt.Figure, list[plt.Axes]]:
    figure, axes = plt.subplots(1, count, figsize=(5.2 * count, 3.8), squeeze=False)
    return figure, list(axes[0])


def _run_curve(run, metric: str, x_axis: str) -> tuple[np.ndarray, np.ndarray]:
    steps, values = run.curve(metric)
    x = run.frames_at(steps) if x_axis == "frames" else run.seconds_at(steps)
    return x, values


def held_values(grid: np.ndarray, x: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Return, at each grid point, the curve's last value logged at or before it.

    A metric is known only where it was logged (an evaluation); in between, a
    run stopped at that moment would have the last one. Points before the
    first logged value take the first.
    """
    index = np.searchsorted(x, grid, side="right") - 1
    return values[np.clip(index, 0, len(values) - 1)]


def common_grid(curves: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """The points at which the mean of ``curves`` is drawn: every logged x where every run has data.

    That is from the latest first point to the earliest last point of the
    runs, so that a run is never extended past its own end (a run that
    stopped early, or a wall-time curve that ends sooner). The mean of held
    values (:func:`held_values`) changes only at a logged point, so these
    points draw it exactly.
    """
    start = max(x[0] for x, _ in curves)
    end = min(x[-1] for x, _ in curves)
    points = np.unique(np.concatenate([x for x, _ in curves]))
    return points[(points >= start) & (points <= end)]


def learning_curve_figure(
    tasks: dict[str, list[Group]],
    metric: str,
    x_axis: str,
    confidence: float = 0.95,
    seed: int = 0,
) -> plt.Figure:
    """Draw ``metric`` against frames or wall time, per objective; return the figure.

    Parameters are those of :func:`plot_learning_curves`, but the path.
    """
    if x_axis not in X_AXES:
        raise ValueError(f"x_axis must be one of {sorted(X_AXES)}, got {x_axis!r}")
    colors = objective_colors(tasks)
    figure, axes = _panels(len(tasks))
    for axis, (task, groups) in zip(axes, tasks.items()):
        for group in groups:
            color = colors[group.objective]
            curves = [_run_curve(run, metric, x_axis) for run in group.runs]
            style = run_style(len(curves))
            for index, (x, values) in enumerate(curves):
                marker = "." if len(x) <= FEW_POINTS and len(curves) < MIN_RUNS_FOR_INTERVALS else None
                label = f"{group.objective}: each seed" if index == 0 and len(curves) < MIN_RUNS_FOR_INTERVALS else None
                axis.plot(x, values, color=color, drawstyle="steps-post", marker=marker, label=label, **style)
            grid = common_grid(curves)
            if len(grid) == 0:  # the runs share no stretch of x: no mean to draw
                continue
            aligned = np.stack([held_values(grid, x, values) for x, values in curves])
            center, low, high = mean_with_band(aligned, confidence=confidence, seed=seed)
            label = f"{group.objective} (mean of {_seeds(len(curves))})"
            marker = "o" if len(grid) <= FEW_POINTS else None
            mean_style = {"linewidth": 2.0, "marker": marker, "markersize": 3, "drawstyle": "steps-post"}
            axis.plot(grid, center, color=color, label=label, **mean_style)
            if len(curves) >= MIN_RUNS_FOR_INTERVALS:
                axis.fill_between(grid, low, high, color=color, alpha=0.2, linewidth=0, step="post")
        _label_axis(axis, task, X_AXES[x_axis], metric)
    counts = [len(group.runs) for groups in tasks.values() for group in groups]
    if min(counts) >= MIN_RUNS_FOR_INTERVALS:
        title = f"Mean over seeds where every seed has data, {confidence:.0%} bootstrap band;\nthin lines: seeds"
    else:
        title = (
            f"Mean over seeds where every seed has data; dashed: each seed\n"
            f"(no band below {MIN_RUNS_FOR_INTERVALS} seeds: too few to estimate one)"
        )
    figure.suptitle(title, fontsize="medium")
    return figure


def _seeds(count: int) -> str:
    return "1 seed" if count == 1 else f"{count} seeds"


def plot_learning_curves(
    tasks: dict[str, list[Group]],
    metric: str,
    x_axis: str,
    path: Path,
    confidence: float = 0.95,
    seed: int = 0,
) -> Path:
    """Draw ``metric`` against frames or wall time, per objective, and save a PNG.

    Parameters
    ----------
    tasks : dict
        ``{task: [group, ...]}`` as :func:`nip_like.analysis.groups.group_runs` returns.
    metric : str
        A logged metric, such as ``eval/reward``.
    x_axis : str
        ``frames`` or ``seconds`` (the running sum of ``timers/iteration``).
        Curves are steps: a run's value holds from one logged point to the
        next; the mean is drawn only where every run has data.
    path : Path
        The PNG to write.
    confidence : float
        Coverage of the band.
    seed : int
        Seed of the band's bootstrap.
    """
    return _save(learning_curve_figure(tasks, metric, x_axis, confidence, seed), path)


def plot_reward_against_kl(
    tasks: dict[str, list[Group]],
    reward_metric: str,
    kl_metric: str,
    path: Path,
) -> Path:
    """Draw each run's reward against its KL from the initial policy, iteration by iteration.

    Thin lines are the seeds (dashed and clearer when there are fewer than
    :data:`~nip_like.analysis.statistics.MIN_RUNS_FOR_INTERVALS`); the thick
    line joins the means over seeds of both quantities at each iteration that
    every seed logged, and its dot marks the last iteration.

    Parameters
    ----------
    tasks : dict
        ``{task: [group, ...]}``.
    reward_metric, kl_metric : str
        The metrics on the two axes (``train/reward``, ``objective/kl``).
    path : Path
        The PNG to write.
    """
    colors = objective_colors(tasks)
    figure, axes = _panels(len(tasks))
    for axis, (task, groups) in zip(axes, tasks.items()):
        for group in groups:
            color = colors[group.objective]
            joined = [_join(run, kl_metric, reward_metric) for run in group.runs]
            for _, kl, reward in joined:
                axis.plot(kl, reward, color=color, **run_style(len(joined)))
            common = joined[0][0]
            for steps, _, _ in joined[1:]:
                common = np.intersect1d(common, steps)
            if len(common):
                kl_mean = np.mean([kl[np.searchsorted(steps, common)] for steps, kl, _ in joined], axis=0)
                reward_mean = np.mean([reward[np.searchsorted(steps, common)] for steps, _, reward in joined], axis=0)
                label = f"{group.objective} (mean of {_seeds(len(joined))})"
                axis.plot(kl_mean, reward_mean, color=color, linewidth=2.0, label=label)
                axis.plot(kl_mean[-1:], reward_mean[-1:], "o", color=color)
        _label_axis(axis, task, f"KL from the initial policy ({kl_metric})", reward_metric)
    figure.suptitle("One point per iteration; thin lines: seeds, thick: mean over seeds", fontsize="medium")
    return _save(figure, path)


def _label_axis(axis: plt.Axes, title: str, x_label: str, y_label: str) -> None:
    axis.set_title(title)
    axis.set_xlabel(x_label)
    axis.set_ylabel(y_label)
    axis.grid(alpha=0.3)
    axis.legend(fontsize="small")


def _join(run, kl_metric: str, reward_metric: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Return the steps that both metrics logged, and their values there."""
    kl_steps, kl = run.curve(kl_metric)
    reward_steps, reward = run.curve(reward_metric)
    steps, kl_index, reward_index = np.intersect1d(kl_steps, reward_steps, return_indices=True)
    return steps, kl[kl_index], reward[reward_index]


def _save(figure: plt.Figure, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
