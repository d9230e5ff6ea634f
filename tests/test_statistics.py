"""The report's statistics on hand-built scores with known answers."""

import math

import numpy as np
import pytest

from nip_like.analysis.statistics import (
    first_crossing,
    interquartile_mean,
    mean,
    mean_with_band,
    probability_of_improvement,
    probability_of_improvement_ci,
    stratified_bootstrap_ci,
)


@pytest.mark.parametrize(
    "scores, expected",
    [
        ([7.0], 7.0),
        ([1.0, 2.0, 10.0], 13.0 / 3.0),  # n = 3 cuts nothing: the mean
        ([4.0, 1.0, 3.0, 2.0], 2.5),  # n = 4 cuts one from each end
        ([0.0, 0.0, 0.0, 0.0, 100.0], 0.0),  # one outlier is ignored
        ([8.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0], 4.5),  # n = 8 cuts two from each end
    ],
)
def test_interquartile_mean_matches_trim_mean(scores, expected):
    assert interquartile_mean(scores) == pytest.approx(expected)


def test_interquartile_mean_along_an_axis():
    scores = np.array([[4.0, 1.0, 3.0, 2.0], [0.0, 0.0, 0.0, 100.0]])
    np.testing.assert_allclose(interquartile_mean(scores, axis=1), [2.5, 0.0])
    with pytest.raises(ValueError):
        interquartile_mean([])


def test_bootstrap_of_equal_scores_has_zero_width_and_of_one_score_none():
    assert stratified_bootstrap_ci([[0.7, 0.7, 0.7]], mean) == pytest.approx((0.7, 0.7))
    low, high = stratified_bootstrap_ci([[0.7]], mean)
    assert math.isnan(low) and math.isnan(high)


def test_bootstrap_interval_contains_the_estimate_and_lies_within_the_scores():
    scores = np.random.default_rng(1).normal(0.5, 0.1, size=20)
    for statistic in (mean, interquartile_mean):
        low, high = stratified_bootstrap_ci([scores], statistic, reps=5000, seed=3)
        assert scores.min() <= low < statistic(scores) < high <= scores.max()


def test_bootstrap_interval_of_the_mean_covers_the_true_mean_about_95_percent_of_the_time():
    rng = np.random.default_rng(0)
    covered = 0
    trials = 200
    for trial in range(trials):
        scores = rng.normal(0.5, 0.1, size=15)
        low, high = stratified_bootstrap_ci([scores], mean, reps=2000, seed=trial)
        covered += low <= 0.5 <= high
    # The percentile bootstrap covers a little less than 95% with 15 runs.
    assert 0.85 <= covered / trials <= 0.99


def test_bootstrap_is_stratified_and_reproducible():
    # Resampling within each stratum keeps three zeros and three ones in every resample.
    assert stratified_bootstrap_ci([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]], mean) == pytest.approx((0.5, 0.5))
    scores = [0.1, 0.4, 0.35, 0.8]
    assert stratified_bootstrap_ci([scores], mean, seed=5) == stratified_bootstrap_ci([scores], mean, seed=5)


@pytest.mark.parametrize(
    "x, y, expected",
    [
        ([3.0, 4.0], [1.0, 2.0], 1.0),
        ([1.0, 2.0], [3.0, 4.0], 0.0),
        ([1.0, 1.0], [1.0, 1.0], 0.5),
        ([1.0, 2.0, 3.0], [0.0, 2.0, 4.0], 4.5 / 9.0),  # one tie counts one half
        ([2.0, 5.0, 1.0], [3.0], 1.0 / 3.0),
        ([0.1, 0.3, 0.5, 0.7], [0.2, 0.4, 0.6, 1.0], 6.0 / 16.0),
    ],
)
def test_probability_of_improvement_counts_pairs(x, y, expected):
    assert probability_of_improvement(x, y) == pytest.approx(expected)
    assert probability_of_improvement(y, x) == pytest.approx(1.0 - expected)


def test_probability_of_improvement_interval():
    assert probability_of_improvement_ci([3.0, 4.0, 5.0], [1.0, 2.0]) == (1.0, 1.0)
    low, high = probability_of_improvement_ci([1.0], [2.0])
    assert math.isnan(low) and math.isnan(high)
    x, y = [0.1, 0.3, 0.5, 0.7], [0.2, 0.4, 0.6, 1.0]
    low, high = probability_of_improvement_ci(x, y, seed=2)
    assert 0.0 <= low < probability_of_improvement(x, y) < high <= 1.0


def test_first_crossing():
    steps, values = [5, 10, 15, 20], [0.2, 0.95, 0.8, 1.0]
    assert first_crossing(steps, values, 0.9) == 10
    assert first_crossing(steps, values, 0.95) == 10
    assert first_crossing(steps, values, 1.01) is None
    assert first_crossing(steps, [3.0, 2.0, 0.5, 0.1], 1.0, mode="min") == 15
    with pytest.raises(ValueError):
        first_crossing(steps, values, 0.9, mode="up")


def test_mean_with_band():
    curves = np.array([[0.0, 1.0, 2.0], [0.0, 1.0, 2.0]])
    center, low, high = mean_with_band(curves)
    np.testing.assert_allclose(center, [0.0, 1.0, 2.0])
    np.testing.assert_allclose(low, center)
    np.testing.assert_allclose(high, center)
    center, low, high = mean_with_band(np.array([[0.0, 1.0, 4.0], [2.0, 1.0, 0.0]]))
    np.testing.assert_allclose(center, [1.0, 1.0, 2.0])
    assert np.all(low <= center) and np.all(center <= high) and high[0] > low[0]
    _, low, _ = mean_with_band(curves[:1])
    assert np.isnan(low).all()
