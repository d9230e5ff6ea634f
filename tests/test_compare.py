"""The comparison report on synthetic run folders whose answers are known."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from nip_like.analysis.budgets import GradientStepRule
from nip_like.analysis.report import ReportOptions, build_report, write_report
from nip_like.analysis.runs import find_runs
from nip_like.errors import ReportError
from tests.conftest import run_cli

FRAMES_PER_ITERATION = 100


def write_run(
    folder: Path,
    trainer: str,
    seed: int,
    reward: float,
    eval_curve: list[float],
    iteration_seconds: float = 0.5,
    iterations: int = 4,
    gradient_steps: int = 100,
    lr: float = 0.001,
    protocol: str = "prover_verifier",
    test_episodes: int = 64,
    objective: dict | None = None,
) -> Path:
    """Write a finished run folder: config, summary and the CSV curves the report reads.

    ``eval_curve`` has one value per iteration (steps 1, 2, ...).
    """
    folder.mkdir(parents=True)
    config = {
        "name": "synthetic",
        "seed": seed,
        "trainer": {
            "trainer_type": trainer,
            "num_iterations": iterations,
            "optimizer": {"lr": lr},
            **({"objective": objective} if objective is not None else {}),
        },
        "scenario": {"name": "hidden_bits"},
        "protocol": {"name": protocol},
        "run": {"test_run": False},
    }
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    summary = {
        "seed": seed,
        "trainer_type": trainer,
        "run_id": f"{trainer}-{seed}",
        "frames": iterations * FRAMES_PER_ITERATION,
        "iterations": iterations,
        "gradient_steps": gradient_steps,
        "train_seconds": iterations * iteration_seconds,
        "test_metrics": {"test/reward": reward, "test/accuracy": reward / 2, "test/episodes": test_episodes},
    }
    (folder / "summary.json").write_text(json.dumps(summary))
    steps = range(1, iterations + 1)
    curves = {
        "train/frames": [step * FRAMES_PER_ITERATION for step in steps],
        "timers/iteration": [iteration_seconds for _ in steps],
        "eval/reward": eval_curve,
        "train/reward": [value / 2 for value in eval_curve],
        "objective/kl": [0.01 * step for step in steps],
    }
    for name, values in curves.items():
        path = folder / "metrics" / "scalars" / f"{name}.csv"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(f"{step},{value}\n" for step, value in zip(steps, values)))
    return folder


#: PPO crosses 0.9 at iteration 2 on every seed; DPO at 1, 3 and 4, and one seed never.
PPO_REWARDS = [0.2, 0.4, 0.6, 1.0]
DPO_REWARDS = [0.1, 0.3, 0.5, 0.7]
DPO_CURVES = [[0.95, 1, 1, 1], [0.1, 0.5, 0.9, 1], [0.1, 0.2, 0.3, 0.92], [0.1, 0.1, 0.1, 0.1]]


@pytest.fixture
def sweep(tmp_path) -> Path:
    root = tmp_path / "sweep"
    for seed in range(4):
        ppo, dpo = root / f"seed={seed},trainer=ppo", root / f"seed={seed},trainer=dpo"
        write_run(ppo, "ppo", seed, PPO_REWARDS[seed], [0.5, 0.9, 1, 1], 0.5, gradient_steps=96)
        write_run(dpo, "dpo", seed, DPO_REWARDS[seed], DPO_CURVES[seed], 0.25, gradient_steps=40 + seed)
    return root


def options(**changes) -> ReportOptions:
    return ReportOptions(reps=2000, **changes)


def test_summary_has_the_known_statistics(sweep):
    report = build_report(find_runs([sweep]), options())
    (task,) = report.tasks
    assert task.task == "hidden_bits / prover_verifier"
    rows = {row["objective"]: row for row in task.summary}
    assert list(rows) == ["dpo", "ppo"]
    ppo, dpo = rows["ppo"], rows["dpo"]
    assert ppo["iqm"] == pytest.approx(0.5) and ppo["mean"] == pytest.approx(0.55)
    assert dpo["iqm"] == pytest.approx(0.4) and dpo["mean"] == pytest.approx(0.4)
    # Four runs each: too few for a bootstrap interval, so the interval is the range of the runs.
    for row, rewards in ((ppo, PPO_REWARDS), (dpo, DPO_REWARDS)):
        assert row["interval"] == "range of 4 runs"
        assert (row["iqm_low"], row["iqm_high"]) == (row["mean_low"], row["mean_high"]) == (min(rewards), max(rewards))
    # Threshold 0.9 on eval/reward: PPO at iteration 2 (200 frames, 2 x 0.5 s) on every seed.
    assert ppo["reached"] == 4
    assert ppo["frames_to_threshold_median"] == pytest.approx(200)
    assert ppo["seconds_to_threshold_median"] == pytest.approx(1.0)
    # DPO at 100, 300, 400 frames and never: the median is 350 frames, (0.75 + 1.0) / 2 s.
    assert dpo["reached"] == 3
    assert dpo["frames_to_threshold_median"] == pytest.approx(350)
    assert dpo["seconds_to_threshold_median"] == pytest.approx(0.875)
    assert dpo["gradient_steps_min"] == 40 and dpo["gradient_steps_max"] == 43
    assert ppo["frames_per_run"] == 400
    (pair,) = task.improvement
    assert (pair["x"], pair["y"]) == ("dpo", "ppo")
    assert pair["probability"] == pytest.approx(6 / 16)
    assert pair["interval"] == "not estimated" and math.isnan(pair["low"]) and math.isnan(pair["high"])
    assert "Matched budget: every run collected 400 frames" in task.notes[0]
    assert "dpo: median 42 (range 40 to 43); ppo: 96" in task.notes[1]


def test_threshold_that_most_runs_miss_is_not_reached(sweep):
    report = build_report(find_runs([sweep]), options(threshold=0.99))
    dpo = next(row for row in report.tasks[0].summary if row["objective"] == "dpo")
    assert dpo["reached"] == 2
    assert math.isinf(dpo["frames_to_threshold_median"])


def test_objectives_can_be_chosen_and_ordered(sweep):
    report = build_report(find_runs([sweep]), options(objectives=["ppo", "dpo"]))
    assert [row["objective"] for row in report.tasks[0].summary] == ["ppo", "dpo"]
    assert report.tasks[0].improvement[0]["probability"] == pytest.approx(10 / 16)
    with pytest.raises(ReportError, match=r"no runs of objectives \['grpo'\]"):
        build_report(find_runs([sweep]), options(objectives=["grpo"]))


def test_mixed_frames_are_refused_unless_allowed(sweep):
    write_run(sweep / "seed=4,trainer=dpo", "dpo", 4, 0.9, [1, 1, 1, 1, 1, 1], iterations=6)
    found = find_runs([sweep])
    with pytest.raises(ReportError) as error:
        build_report(found, options())
    message = str(error.value)
    assert "frames per run (dpo: 400, 600; ppo: 400)" in message and "--allow-mixed-budgets" in message
    assert "\n" not in message
    report = build_report(found, options(allow_mixed_budgets=True))
    assert report.tasks[0].notes[0].startswith("Budgets are NOT matched")


def test_mixed_test_episodes_are_refused(sweep):
    write_run(sweep / "seed=5,trainer=ppo", "ppo", 5, 0.9, [1, 1, 1, 1], test_episodes=32)
    with pytest.raises(ReportError, match="held-out test episodes"):
        build_report(find_runs([sweep]), options())


def test_gradient_step_rules(sweep):
    found = find_runs([sweep])
    build_report(found, options(gradient_steps=GradientStepRule.parse("within:2.5")))
    with pytest.raises(ReportError, match=r"median gradient steps \(dpo: 42; ppo: 96\) by more than the factor 2"):
        build_report(found, options(gradient_steps=GradientStepRule.parse("within:2")))
    with pytest.raises(ReportError, match="gradient steps per run"):
        build_report(found, options(gradient_steps=GradientStepRule.parse("equal")))
    for bad in ("within:0.5", "within:x", "same"):
        with pytest.raises(ReportError, match="--gradient-steps must be"):
            GradientStepRule.parse(bad)


def test_a_group_must_differ_only_in_seeds(sweep):
    write_run(sweep / "seed=4,trainer=ppo", "ppo", 4, 0.9, [1, 1, 1, 1], lr=0.01)
    with pytest.raises(ReportError, match=r"objective 'ppo' .* differ in trainer\.optimizer\.lr"):
        build_report(find_runs([sweep]), options())
    # Naming the learning rate as part of the objective splits the group.
    report = build_report(find_runs([sweep]), options(objective_keys=("trainer.trainer_type", "trainer.optimizer.lr")))
    assert [row["objective"] for row in report.tasks[0].summary] == [
        "trainer_type=dpo lr=0.001",
        "trainer_type=ppo lr=0.001",
        "trainer_type=ppo lr=0.01",
    ]


def test_runs_saved_before_an_option_existed_group_with_runs_that_have_it_at_its_neutral_value(sweep):
    import yaml as yaml_module

    folder = write_run(sweep / "seed=4,trainer=ppo", "ppo", 4, 0.9, [1, 1, 1, 1])
    for saved in sweep.glob("*/config.yaml"):  # every run warm-started alike, saved before agent_restarts existed
        earlier = yaml_module.safe_load(saved.read_text())
        earlier["trainer"]["pretrain"] = {"epochs": 10}
        saved.write_text(yaml_module.safe_dump(earlier))
    config = yaml_module.safe_load((folder / "config.yaml").read_text())
    config["trainer"]["pretrain"] = {"epochs": 10, "agent_restarts": {}}  # added later; empty behaves as before it existed
    config["scenario"]["cache_dir"] = "/elsewhere"  # where a cache lives is no hyper-parameter either
    (folder / "config.yaml").write_text(yaml_module.safe_dump(config))
    report = build_report(find_runs([sweep]), options())
    assert {row["objective"]: row["seeds"] for row in report.tasks[0].summary}["ppo"] == "0 1 2 3 4"
    config["trainer"]["pretrain"] = {"epochs": 10, "agent_restarts": {"verifier": 3}}  # set, it is a hyper-parameter
    (folder / "config.yaml").write_text(yaml_module.safe_dump(config))
    with pytest.raises(ReportError, match=r"differ in trainer\.pretrain\.agent_restarts"):
        build_report(find_runs([sweep]), options())


def test_duplicate_seeds_are_refused(tmp_path, sweep):
    write_run(tmp_path / "other" / "seed=0,trainer=ppo", "ppo", 0, 0.9, [1, 1, 1, 1])
    with pytest.raises(ReportError, match="more than one run of seed 0"):
        build_report(find_runs([sweep, tmp_path / "other"]), options())


def test_objectives_are_told_apart_by_their_variant(tmp_path):
    """The `objectives` sweep runs ppo and ppo_kl: one trainer type, two objectives (it failed with "more than one run")."""
    root = tmp_path / "objectives"
    for seed in range(2):
        write_run(root / f"seed={seed},trainer=ppo", "ppo", seed, 0.8, [1] * 4, objective={"variant": "clip"})
        write_run(root / f"seed={seed},trainer=ppo_kl", "ppo", seed, 0.6, [1] * 4, objective={"variant": "kl"})
        write_run(root / f"seed={seed},trainer=dpo", "dpo", seed, 0.5, [1] * 4, objective={"loss_type": "hinge"})
        write_run(root / f"seed={seed},trainer=ipo", "ipo", seed, 0.4, [1] * 4, objective={"beta": 0.1})
    report = build_report(find_runs([root]), options())
    assert sorted(row["objective"] for row in report.tasks[0].summary) == ["dpo_hinge", "ipo", "ppo", "ppo_kl"]
    # Naming the objective by the trainer type alone pools ppo and ppo_kl, and is refused.
    with pytest.raises(ReportError, match="more than one run of seed 0"):
        build_report(find_runs([root]), options(objective_keys=("trainer.trainer_type",)))


def test_tasks_are_compared_separately(sweep):
    for seed in range(2):
        folder = sweep / f"protocol=solo,seed={seed},trainer=ppo"
        write_run(folder, "ppo", seed, 0.25, [0.2] * 4, protocol="solo_verifier")
    report = build_report(find_runs([sweep]), options())
    assert [task.task for task in report.tasks] == ["hidden_bits / prover_verifier", "hidden_bits / solo_verifier"]
    assert report.tasks[1].improvement == []


def test_unfinished_folders_are_listed_not_used(sweep):
    unfinished = sweep / "seed=9,trainer=ppo"
    (unfinished / "checkpoints").mkdir(parents=True)
    (unfinished / "config.yaml").write_text("seed: 9\n")
    (sweep / "_incomplete" / "old").mkdir(parents=True)  # moved aside by the sweep script: ignored
    found = find_runs([sweep])
    assert found.unfinished == [unfinished]
    assert len(found.runs) == 8


def test_missing_metrics_are_named(sweep):
    with pytest.raises(ReportError, match="primary metric 'test/optimality'"):
        build_report(find_runs([sweep]), options(primary_metric="test/optimality"))
    with pytest.raises(ReportError, match="has no metric 'eval/accuracy'"):
        build_report(find_runs([sweep]), options(curve_metric="eval/accuracy"))
    with pytest.raises(ReportError, match="is not a folder"):
        find_runs([sweep / "nowhere"])


def test_report_files(sweep, tmp_path):
    report = build_report(find_runs([sweep]), options())
    written = write_report(report, tmp_path / "report")
    names = sorted(path.name for path in written)
    assert names == sorted(
        [
            "report.md",
            "summary.csv",
            "final_metrics.csv",
            "probability_of_improvement.csv",
            "curves_frames.png",
            "curves_wall_time.png",
            "reward_vs_kl.png",
        ]
    )
    with open(tmp_path / "report" / "final_metrics.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert {row["metric"] for row in rows} == {"test/reward", "test/accuracy"}  # test/episodes is a count
    ppo_accuracy = next(row for row in rows if row["objective"] == "ppo" and row["metric"] == "test/accuracy")
    assert float(ppo_accuracy["iqm"]) == pytest.approx(0.25)
    markdown = (tmp_path / "report" / "report.md").read_text()
    assert "| ppo | 4 | 0.500 (range of 4 runs: 0.200 to 1.000) |" in markdown
    assert "![eval/reward against frames](curves_frames.png)" in markdown
    for path in written:
        if path.suffix == ".png":
            assert path.read_bytes()[:4] == b"\x89PNG"


def test_runs_without_a_kl_metric_get_a_report_without_that_plot(sweep, tmp_path):
    # The text trainers measure no KL: the report leaves that plot out and says so.
    for path in sweep.rglob("objective/kl.csv"):
        path.unlink()
    report = build_report(find_runs([sweep]), options())
    written = write_report(report, tmp_path / "report")
    assert "reward_vs_kl.png" not in {path.name for path in written} and "curves_frames.png" in {p.name for p in written}
    assert "not every run logs objective/kl" in (tmp_path / "report" / "report.md").read_text()


@pytest.mark.slow  # a subprocess: seconds of start-up
def test_command_line_refuses_mixed_budgets_in_one_line_and_writes_nothing(sweep, tmp_path):
    write_run(sweep / "seed=4,trainer=dpo", "dpo", 4, 0.9, [1] * 6, iterations=6)
    out = tmp_path / "report"
    result = run_cli([str(sweep), "--out", str(out), "--reps", "200"], module="scripts.compare_objectives")
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("error: the runs on hidden_bits / prover_verifier differ in frames per run")
    assert not out.exists()
    result = run_cli(
        [str(sweep), "--out", str(out), "--reps", "200", "--allow-mixed-budgets", "--no-plots"],
        module="scripts.compare_objectives",
    )
    assert result.returncode == 0, result.stderr
    assert "Budgets are NOT matched" in (out / "report.md").read_text()
    assert not (out / "curves_frames.png").exists()


def test_curves_hold_their_last_logged_value():
    from nip_like.analysis.plots import held_values

    x, values = np.array([1.0, 3.0, 6.0]), np.array([0.1, 0.5, 0.9])
    grid = np.array([0.0, 1.0, 2.0, 3.0, 5.9, 6.0, 10.0])
    np.testing.assert_allclose(held_values(grid, x, values), [0.1, 0.1, 0.1, 0.5, 0.5, 0.9, 0.9])
