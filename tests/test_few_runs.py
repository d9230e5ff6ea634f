"""Reports that know their sample size: two runs per objective against six (synthetic run folders)."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np
import pytest
from matplotlib.collections import PolyCollection

from nip_like.analysis.plots import FEW_RUNS_STYLE, RUN_STYLE, learning_curve_figure
from nip_like.analysis.report import ReportOptions, build_report, write_report
from nip_like.analysis.runs import find_runs
from tests.test_compare import write_run

#: Final rewards of each objective's runs, by seed.
REWARDS = {"ppo": [0.506, 0.251, 0.40, 0.45, 0.30, 0.35], "dpo": [0.2, 0.1, 0.15, 0.12, 0.18, 0.11]}


def sweep_of(root: Path, seeds: int) -> Path:
    """``seeds`` runs per objective; PPO's iterations last 0.5 s, DPO's 0.5 s to 1 s by seed (wall-time curves end apart)."""
    for seed in range(seeds):
        for trainer, rewards in REWARDS.items():
            curve = [rewards[seed] * step / 4 for step in range(1, 5)]
            seconds = 0.5 if trainer == "ppo" else 0.5 + 0.1 * seed
            write_run(root / f"seed={seed},trainer={trainer}", trainer, seed, rewards[seed], curve, seconds)
    return root


def report_of(root: Path, out: Path) -> str:
    """Write the report (its tables) of the runs under ``root`` into ``out``; return its Markdown."""
    report = build_report(find_runs([root]), ReportOptions(reps=500, plots=False))
    write_report(report, out)
    return (out / "report.md").read_text()


def tables(markdown: str) -> list[list[str]]:
    """The Markdown tables of a report, each as its lines."""
    blocks, current = [], []
    for line in markdown.splitlines():
        if line.startswith("|"):
            current.append(line)
        elif current:
            blocks.append(current)
            current = []
    return blocks + ([current] if current else [])


def test_two_runs_per_objective_say_so_first_and_in_every_table(tmp_path):
    markdown = report_of(sweep_of(tmp_path / "sweep", 2), tmp_path / "report")
    first = markdown.splitlines()[0]
    assert first.startswith("# Objective comparison: only 2 runs per objective, too few for confidence intervals")
    found = tables(markdown)
    assert len(found) == 3  # summary, final metrics, probability of improvement
    for table in found:
        assert "fewer than 5" in table[0], table[0]
        assert "CI]" not in table[0]  # no column claims a confidence interval
    # The interval of two runs is their range, labelled so; P(X > Y) is a share of pairs, not an estimate.
    assert "| ppo | 2 | 0.379 (range of 2 runs: 0.251 to 0.506) |" in markdown
    assert "| dpo | ppo | 2 vs 2 | 0.000 (0 of 4 run pairs; not estimated) |" in markdown
    assert "percentile-bootstrap" not in found[0][0]
    with open(tmp_path / "report" / "probability_of_improvement.csv") as handle:
        (row,) = csv.DictReader(handle)
    assert row["interval"] == "not estimated" and math.isnan(float(row["low"]))
    with open(tmp_path / "report" / "summary.csv") as handle:
        assert {row["interval"] for row in csv.DictReader(handle)} == {"range of 2 runs"}


def test_six_runs_per_objective_get_bootstrap_intervals(tmp_path):
    markdown = report_of(sweep_of(tmp_path / "sweep", 6), tmp_path / "report")
    assert markdown.splitlines()[0] == "# Objective comparison"
    for table in tables(markdown):
        assert "[95% CI]" in table[0] and "fewer than" not in table[0]
    assert "range of" not in markdown and "not estimated" not in markdown
    with open(tmp_path / "report" / "probability_of_improvement.csv") as handle:
        (row,) = csv.DictReader(handle)
    assert row["interval"] == "95% bootstrap CI"
    assert 0.0 <= float(row["low"]) <= float(row["probability"]) == 0.0 <= float(row["high"]) <= 1.0


def test_mixed_group_sizes_mark_the_small_group_only(tmp_path):
    root = sweep_of(tmp_path / "sweep", 6)
    for seed in range(2, 6):  # DPO keeps two runs
        for path in sorted((root / f"seed={seed},trainer=dpo").rglob("*"), reverse=True):
            path.unlink() if path.is_file() else path.rmdir()
        (root / f"seed={seed},trainer=dpo").rmdir()
    markdown = report_of(root, tmp_path / "report")
    assert markdown.splitlines()[0].startswith("# Objective comparison: only 2 to 6 runs per objective")
    summary = tables(markdown)[0]
    assert "[95% CI] or (range of the runs: fewer than 5, no CI)" in summary[0]
    assert any(line.startswith("| dpo | 2 | ") and "range of 2 runs" in line for line in summary)
    assert any(line.startswith("| ppo | 6 | ") and "range" not in line for line in summary)


def curve_lines(figure, objective_runs: int):
    """The lines of the first panel: each run's curve and the means (labelled 'mean of ...')."""
    lines = figure.axes[0].get_lines()
    means = [line for line in lines if "mean of" in str(line.get_label())]
    runs = [line for line in lines if line not in means]
    return runs, means


@pytest.mark.parametrize("seeds", [2, 6])
def test_plot_shows_each_run_and_a_band_only_where_it_means_something(tmp_path, seeds):
    report = build_report(find_runs([sweep_of(tmp_path / "sweep", seeds)]), ReportOptions(reps=200, plots=True))
    figure = learning_curve_figure(report.groups, "eval/reward", "seconds")
    runs, means = curve_lines(figure, seeds)
    assert len(runs) == 2 * seeds and len(means) == 2
    style = FEW_RUNS_STYLE if seeds < 5 else RUN_STYLE
    assert all(line.get_alpha() == style["alpha"] and line.get_linewidth() == style["linewidth"] for line in runs)
    bands = [item for item in figure.axes[0].collections if isinstance(item, PolyCollection)]
    assert len(bands) == (0 if seeds < 5 else 2)
    # The mean stops where the shortest run ends: DPO's runs end at 2 s (seed 0) to 4 s; no run is extended.
    dpo_mean = next(line for line in means if line.get_label().startswith("dpo"))
    run_ends = [line.get_xdata()[-1] for line in runs if line.get_color() == dpo_mean.get_color()]
    assert max(dpo_mean.get_xdata()) == pytest.approx(min(run_ends))
    for band in bands:
        low_high = band.get_paths()[0].vertices[:, 1]
        assert low_high.min() >= 0.0 and low_high.max() <= max(REWARDS["ppo"])  # within the runs' values: no spike


def test_a_run_that_logged_the_initial_policy_starts_at_frame_zero(tmp_path):
    root = sweep_of(tmp_path / "sweep", 2)
    for folder in root.iterdir():
        path = folder / "metrics" / "scalars" / "eval" / "reward.csv"
        path.write_text("0,0.05\n" + path.read_text())
    report = build_report(find_runs([root]), ReportOptions(reps=200))
    for axis in ("frames", "seconds"):
        runs, means = curve_lines(learning_curve_figure(report.groups, "eval/reward", axis), 2)
        assert all(line.get_xdata()[0] == 0 and line.get_ydata()[0] == 0.05 for line in runs + means)
    run = report.tasks[0].groups[0].runs[0]
    np.testing.assert_allclose(run.frames_at(np.array([0.0, 1.0])), [0.0, 100.0])
