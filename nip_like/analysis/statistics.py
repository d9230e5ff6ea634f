"""Statistics over seeds: IQM, bootstrap confidence intervals, probability of improvement.

The choices follow Agarwal et al., "Deep Reinforcement Learning at the Edge of
the Statistical Precipice" (NeurIPS 2021) and its library rliable:

* the interquartile mean (IQM) is the mean of the middle half of the scores,
  ``scipy.stats.trim_mean(scores, 0.25)``: with ``n`` scores it drops the
  ``floor(n / 4)`` lowest and highest. It is less swayed by one odd seed than
  the mean and less noisy than the median. With 3 scores it is the mean;
* confidence intervals are percentile intervals of a stratified bootstrap:
  runs are resampled with replacement within each stratum (a task), the
  statistic is recomputed on every resample, and the interval is the central
  ``confidence`` fraction of those values;
* the probability of improvement ``P(X > Y)`` is the probability that a run of
  ``X`` scores higher than a run of ``Y``, ties counting one half (the
  Mann-Whitney U statistic divided by ``m n``).

Below :data:`MIN_RUNS_FOR_INTERVALS` runs a group is too small for either: a
bootstrap of two runs resamples only their minimum and maximum, and the
probability of improvement of 2 runs against 2 is the share of 4 pairs. A
report then gives the range of the runs (:func:`score_range`), labelled as
such, and says that it estimates no interval and no probability.

Every random draw comes from a generator seeded by the caller, so a report is
the same every time it is made from the same runs.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

#: Fraction cut from each end by the interquartile mean.
IQM_CUT = 0.25

#: Runs per group below which a report estimates no confidence interval and no probability of improvement.
MIN_RUNS_FOR_INTERVALS = 5


def score_range(scores: np.ndarray | Sequence[float]) -> tuple[float, float]:
    """Return the lowest and the highest of ``scores``: what a few runs can say about their spread.

    Parameters
    ----------
    scores : array_like
        One score per run, at least one.
    """
    values = np.asarray(scores, dtype=float).ravel()
    if len(values) == 0:
        raise ValueError("score_range needs at least one score")
    return (float(values.min()), float(values.max()))


def interquartile_mean(scores: np.ndarray | Sequence[float], axis: int = -1) -> np.ndarray | float:
    """Return the mean of the middle half of ``scores`` along ``axis``.

    Parameters
    ----------
    scores : array_like
        Scores, any shape.
    axis : int
        The axis of the runs.

    Returns
    -------
    float or ndarray
        ``scipy.stats.trim_mean(scores, 0.25, axis)``: the mean after dropping
        the ``floor(n / 4)`` lowest and highest of the ``n`` scores.
    """
    values = np.sort(np.asarray(scores, dtype=float), axis=axis)
    count = values.shape[axis]
    if count == 0:
        raise ValueError("interquartile_mean needs at least one score")
    cut = int(IQM_CUT * count)
    kept = np.take(values, np.arange(cut, count - cut), axis=axis)
    result = kept.mean(axis=axis)
    return float(result) if np.ndim(result) == 0 else result


def mean(scores: np.ndarray | Sequence[float], axis: int = -1) -> np.ndarray | float:
    """Return the mean of ``scores`` along ``axis`` (the same signature as :func:`interquartile_mean`)."""
    result = np.asarray(scores, dtype=float).mean(axis=axis)
    return float(result) if np.ndim(result) == 0 else result


def stratified_bootstrap_ci(
    strata: Sequence[np.ndarray | Sequence[float]],
    statistic: Callable[[np.ndarray], np.ndarray],
    reps: int = 10_000,
    confidence: float = 0.95,
    seed: int = 0,
) -> tuple[float, float]:
    """Return a percentile confidence interval of ``statistic`` by stratified bootstrap.

    Parameters
    ----------
    strata : sequence of array_like
        The scores of each stratum (task); one stratum for a single task.
    statistic : callable
        Takes an array ``(reps, n)`` of resampled scores (all strata side by
        side) and returns ``reps`` values, for example :func:`interquartile_mean`.
    reps : int
        Bootstrap resamples.
    confidence : float
        Coverage of the interval, in (0, 1).
    seed : int
        Seed of the resampling generator.

    Returns
    -------
    (float, float)
        The interval. With fewer than two scores in every stratum there is no
        spread to resample and the interval is ``(nan, nan)``. Equal scores
        give an interval of width 0.
    """
    arrays = [np.asarray(stratum, dtype=float).ravel() for stratum in strata]
    if not arrays or all(len(array) < 2 for array in arrays):
        return (float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    resampled = [array[rng.integers(0, len(array), size=(reps, len(array)))] for array in arrays]
    values = np.asarray(statistic(np.concatenate(resampled, axis=1)), dtype=float)
    tail = (1.0 - confidence) / 2.0 * 100.0
    low, high = np.percentile(values, [tail, 100.0 - tail])
    return (float(low), float(high))


def _comparison_matrix(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``[i, j]`` = 1 if ``x[i] > y[j]``, 0.5 if equal, 0 if lower."""
    return (x[:, None] > y[None, :]) + 0.5 * (x[:, None] == y[None, :])


def probability_of_improvement(x: np.ndarray | Sequence[float], y: np.ndarray | Sequence[float]) -> float:
    """Return ``P(X > Y) + P(X = Y) / 2`` for a random run of each.

    Parameters
    ----------
    x, y : array_like
        The scores of the runs of two objectives (one score per run).
    """
    x_values, y_values = np.asarray(x, dtype=float).ravel(), np.asarray(y, dtype=float).ravel()
    if len(x_values) == 0 or len(y_values) == 0:
        raise ValueError("probability_of_improvement needs at least one score on each side")
    return float(_comparison_matrix(x_values, y_values).mean())


def probability_of_improvement_ci(
    x: np.ndarray | Sequence[float],
    y: np.ndarray | Sequence[float],
    reps: int = 10_000,
    confidence: float = 0.95,
    seed: int = 0,
) -> tuple[float, float]:
    """Return a percentile bootstrap interval of :func:`probability_of_improvement`.

    The runs of ``x`` and of ``y`` are resampled independently. With fewer
    than two runs on both sides the interval is ``(nan, nan)``.
    """
    x_values, y_values = np.asarray(x, dtype=float).ravel(), np.asarray(y, dtype=float).ravel()
    if len(x_values) < 2 and len(y_values) < 2:
        return (float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    matrix = _comparison_matrix(x_values, y_values)
    rows = rng.integers(0, len(x_values), size=(reps, len(x_values)))
    columns = rng.integers(0, len(y_values), size=(reps, len(y_values)))
    values = matrix[rows[:, :, None], columns[:, None, :]].mean(axis=(1, 2))
    tail = (1.0 - confidence) / 2.0 * 100.0
    low, high = np.percentile(values, [tail, 100.0 - tail])
    return (float(low), float(high))


def first_crossing(
    steps: np.ndarray | Sequence[float],
    values: np.ndarray | Sequence[float],
    threshold: float,
    mode: str = "max",
) -> float | None:
    """Return the first step at which ``values`` reaches ``threshold``, or ``None``.

    Parameters
    ----------
    steps, values : array_like
        A curve, in the order of ``steps``.
    threshold : float
        The level to reach.
    mode : str
        ``max``: reaching means ``value >= threshold``; ``min``: ``value <= threshold``.
    """
    if mode not in ("max", "min"):
        raise ValueError(f"mode must be 'max' or 'min', got {mode!r}")
    step_values, curve = np.asarray(steps, dtype=float), np.asarray(values, dtype=float)
    reached = curve >= threshold if mode == "max" else curve <= threshold
    if not reached.any():
        return None
    return float(step_values[int(np.argmax(reached))])


def mean_with_band(
    curves: np.ndarray, reps: int = 2_000, confidence: float = 0.95, seed: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Return the mean over runs of aligned curves and a bootstrap band around it.

    Parameters
    ----------
    curves : ndarray
        ``(runs, points)``: each run's curve on a common grid.
    reps, confidence, seed
        As in :func:`stratified_bootstrap_ci`, applied at every point, with the
        same resampled runs at every point.

    Returns
    -------
    (ndarray, ndarray, ndarray)
        The mean, and the lower and upper band; the band is ``nan`` with a
        single run.
    """
    values = np.asarray(curves, dtype=float)
    center = values.mean(axis=0)
    if values.shape[0] < 2:
        return center, np.full_like(center, np.nan), np.full_like(center, np.nan)
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, values.shape[0], size=(reps, values.shape[0]))
    means = values[rows].mean(axis=1)
    tail = (1.0 - confidence) / 2.0 * 100.0
    low, high = np.percentile(means, [tail, 100.0 - tail], axis=0)
    return center, low, high
