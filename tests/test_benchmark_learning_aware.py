"""scripts/benchmark_learning_aware.py runs its trainers side by side and reports every figure it promises.

On the ``smoke`` preset (hidden bits, seconds per run), one iteration: this
checks the plumbing and the output's fields, not the speed.
"""

from __future__ import annotations

import json

import pytest

from tests.script_modules import script_module


@pytest.fixture(scope="module")
def benchmark():
    """The script as a module."""
    with script_module("benchmark_learning_aware") as module:
        yield module


@pytest.mark.slow  # trains three trainers for a few iterations: seconds
def test_the_benchmark_reports_times_steps_frames_and_ratios(benchmark, tmp_path, capsys):
    output = tmp_path / "results.json"
    results = benchmark.main(
        ["--trainers", "ppo", "pola", "--seeds", "0", "--iterations", "1", "--preset", "smoke",
         "--work-dir", str(tmp_path / "runs"), "--output", str(output),
         "--override", "pola:trainer.objective.truncated_episodes=true"]  # PPO has no such option: pola's runs only
    )
    assert json.loads(output.read_text()) == results
    runs = {run["trainer"]: run for run in results["runs"]}
    assert set(runs) == {"ppo", "pola"}
    for run in runs.values():
        assert run["iterations"] == 1 and run["frames"] == 96  # the smoke preset's batch
        assert run["train_seconds"] > 0 and run["cpu_seconds"] > 0 and run["optimizer_steps"] > 0
        assert 0 < run["frames_used"] <= run["frames_laid_out"] <= 1
    assert runs["ppo"]["frames_laid_out"] == runs["ppo"]["frames_used"] == 1.0  # every transition
    assert runs["pola"]["frames_used"] == pytest.approx(runs["pola"]["frames_laid_out"])  # every episode, every epoch
    summary = {row["trainer"]: row for row in results["summary"]}
    assert summary["ppo"]["train_seconds_ratio"] == 1.0 and summary["pola"]["cpu_seconds_ratio"] > 0
    printed = capsys.readouterr().out
    assert "x train" in printed and "pola" in printed
