"""scripts/stress_test_result.py: the untrained, DPO and PPO auditors end to end on a tiny model, and its one-line refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.lm_folders import chat_model  # noqa: F401 - the fixture
from tests.script_modules import script_module
from tests.test_stress_test import SIZES

#: The smallest call: one seed, one iteration of two conversations of one turn, two held-out conversations.
TINY = ["--chat-template", "", "--seeds", "3", "--iterations", "1", "--envs", "2", "--auditor-tokens", "4",
        "--target-tokens", "4", "--test-episodes", "2", "--threads", "1", "--reps", "100"]


@pytest.fixture(scope="module")
def result():
    """The script as a module."""
    with script_module("stress_test_result") as module:
        yield module


@pytest.mark.slow  # three subprocess runs: tens of seconds
def test_three_arms_run_and_are_tabulated_with_the_report(result, chat_model, tmp_path, capsys):  # noqa: F811
    folder = chat_model("qwen2", **SIZES)
    out = tmp_path / "out"
    assert result.main(["--model", str(folder), "--out", str(out), *TINY]) == 0
    data = json.loads((out / "results.json").read_text())
    assert [row["arm"] for row in data["arms"]] == ["untrained", "dpo", "ppo"]
    for row in data["arms"]:
        assert row["seeds"] == [3] and len(row["per_seed"]) == 1 and 0.0 <= row["per_seed"][0] <= 1.0
        assert set(result.OTHER_METRICS) | {result.PRIMARY} <= set(row["metrics"])
        assert row["metrics"][result.PRIMARY]["iqm"] == row["per_seed"][0]  # one seed: the IQM is its value
        assert row["run_wall_seconds_mean"] > 0
    steps = {row["arm"]: row["gradient_steps_median"] for row in data["arms"]}
    assert steps["untrained"] == 0 and steps["ppo"] >= 1  # the untrained auditor never updates
    assert data["size"]["iterations"] == 1 and data["keywords"] == list(result.KEYWORDS)
    assert set(data["runs"]) == {"untrained_seed3", "dpo_seed3", "ppo_seed3"}
    table = (out / "results.md").read_text()
    lines = [line for line in table.splitlines() if line.startswith(("| untrained |", "| dpo |", "| ppo |"))]
    assert [line.split(" | ")[0] for line in lines[:3]] == ["| untrained", "| dpo", "| ppo"]
    assert "attack success rate per seed" in table and "range of 1 run" in table
    report = (out / "report" / "report.md").read_text()
    assert report.startswith("# Objective comparison: only 1 runs per objective")
    assert "test/attack_success_rate" in report and "test/likelihood" in report
    configs = {arm: (out / "runs" / f"{arm}_seed3" / "config.yaml").read_text() for arm in result.ARMS}
    assert "auditor_base: true" in configs["dpo"] and "trainer_type: dpo" in configs["dpo"]
    # Called again, it reuses the finished runs (no run is made: their times stay) and writes the same table.
    capsys.readouterr()
    assert result.main(["--model", str(folder), "--out", str(out), *TINY]) == 0
    assert json.loads((out / "results.json").read_text())["runs"] == data["runs"]
    assert "running" not in capsys.readouterr().out
    # With other settings the finished runs are refused, not reused.
    with pytest.raises(SystemExit) as stopped:
        result.main(["--model", str(folder), "--out", str(out), *TINY, "--lr", "0.01"])
    assert stopped.value.code == 2
    assert "is a finished run with other settings" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--arms", "sft"], "--arms: unknown ['sft']; the arms are untrained, dpo, ppo"),
        (["--size", "huge"], "--size must be one of cpu, gpu, got 'huge'"),
        (["--envs", "3"], "--envs must be even"),
        (["--lr", "0"], "--lr must be positive, got 0.0"),
        (["--seeds", "1", "1"], "--seeds holds a seed twice"),
        (["--keywords", " , "], "--keywords is empty"),
        (["--iterations", "0"], "argument --iterations: must be at least 1, got 0"),
    ],
)
def test_bad_input_is_one_line_before_any_run(result, tmp_path, capsys, arguments, message):
    with pytest.raises(SystemExit) as stopped:
        result.main(["--model", str(tmp_path), "--out", str(tmp_path / "out"), *arguments])
    assert stopped.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines
    assert not (tmp_path / "out" / "runs").exists()


def test_a_missing_model_is_one_line(result, tmp_path, capsys):
    with pytest.raises(SystemExit):
        result.main(["--model", str(tmp_path / "nowhere.gguf"), "--out", str(tmp_path / "out")])
    assert "--model: " in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_the_untrained_arm_never_updates_and_every_arm_plays_the_same_test(result, tmp_path):
    args = result.parse_args(["--model", str(tmp_path), "--size", "gpu", "--iterations", "7"])
    size = result.chosen_size(args)
    assert (size.iterations, size.envs, size.test_episodes) == (7, 16, 40)
    runs = {arm: result.run_overrides(arm, 0, size, args, ["x"], Path("/runs") / arm) for arm in result.ARMS}
    assert "+trainer.agent_updates.auditor={start: 1}" in runs["untrained"] and "trainer.num_iterations=1" in runs["untrained"]
    assert "trainer.num_iterations=7" in runs["dpo"] and not any("agent_updates" in item for item in runs["ppo"])
    tests = {arm: [item for item in items if "test_" in item or "scorer" in item] for arm, items in runs.items()}
    assert tests["untrained"] == tests["dpo"] == tests["ppo"]
