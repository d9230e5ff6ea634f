"""``python -m nip_like.evaluate``: a run's saved agents tested again reproduce its logged test metrics."""

from __future__ import annotations

import json

import pytest

from nip_like.errors import CheckpointError, ConfigError
from nip_like.evaluate import default_output, evaluate_run, main
from nip_like.experiment import SUMMARY_FILE, run_experiment
from nip_like.validation import build_scenario
from nip_like.scenarios.datasets import DatasetFileError
from tests.conftest import make_config, smoke_config, tiered
from tests.test_duplicates_scenario import DEV_EVAL, lm_smoke_config


def logged_test_metrics(run_dir):
    return json.loads((run_dir / SUMMARY_FILE).read_text())["test_metrics"]


def graph_config(tmp_path, *overrides):
    return smoke_config("preset=quick", f"scenario.cache_dir={tmp_path / 'data'}", "scenario.num_pairs=300",
                        "trainer.num_iterations=2", "trainer.num_envs=16", "trainer.frames_per_batch=96",
                        "trainer.minibatch_size=32", "trainer.num_test_episodes=64", "trainer.test_batch_episodes=32",
                        "trainer.eval.num_episodes=32", "trainer.pretrain.agents=[]", "trainer.eval.test_checkpoint=final",
                        *overrides)


@pytest.mark.parametrize(
    "kind",
    tiered(
        ["hidden_bits", "graph_isomorphism", "graph_isomorphism_best", "solo_agent", "language_models"],
        fast=["hidden_bits"],
    ),
)
def test_the_tested_checkpoint_reproduces_the_logged_test_metrics(tmp_path, kind):
    config = {
        "hidden_bits": lambda: smoke_config("preset=none", "trainer.num_iterations=2"),
        "graph_isomorphism": lambda: graph_config(tmp_path),
        "graph_isomorphism_best": lambda: graph_config(tmp_path, "trainer.eval.every=1", "trainer.eval.test_checkpoint=best"),
        "solo_agent": lambda: graph_config(tmp_path, "trainer=solo_agent", "trainer.num_iterations=2"),
        "language_models": lambda: lm_smoke_config(tmp_path, "trainer.eval.every=1", "trainer.eval.test_checkpoint=best", *DEV_EVAL),
    }[kind]()
    run_dir = tmp_path / "run"
    run_experiment(config, run_dir, handle_signals=False)
    result = evaluate_run(run_dir)
    assert result["metrics"] == logged_test_metrics(run_dir)
    assert result["checkpoint"] == ("best" if kind.endswith("best") or kind == "language_models" else "last")
    if kind != "hidden_bits":  # a game without data splits
        with pytest.raises(ConfigError, match="unknown data split 'dev'; the .* splits are"):
            evaluate_run(run_dir, split="dev")


@pytest.mark.slow
def test_other_splits_and_data_files_are_named_in_the_metrics(tmp_path):
    run_dir = tmp_path / "run"
    config = lm_smoke_config(tmp_path, *DEV_EVAL)
    run_experiment(config, run_dir, handle_signals=False)
    val = evaluate_run(run_dir, split="val", episodes=16)
    assert val["episodes"] == 16 and set(val["metrics"]) == {k.replace("test/", "val/") for k in logged_test_metrics(run_dir)}
    # The test split written as a data file plays exactly as the test split.
    scenario = build_scenario(config)
    path = tmp_path / "test_lists.pt"
    scenario.splits()["test"].save(path)
    data = evaluate_run(run_dir, data=path)
    assert data["data_examples"] == len(scenario.splits()["test"])
    assert {k.replace("data/", "test/"): v for k, v in data["metrics"].items()} == logged_test_metrics(run_dir)


@pytest.mark.slow
def test_the_command_prints_and_writes_the_metrics_and_transcripts(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_experiment(lm_smoke_config(tmp_path, *DEV_EVAL), run_dir, handle_signals=False)
    assert main([str(run_dir), "--checkpoint", "last"]) == 0
    out = run_dir / "evaluations" / "last-test.json"
    assert out.is_file() and "test/accuracy" in capsys.readouterr().out
    written = json.loads(out.read_text())
    assert written["metrics"] == logged_test_metrics(run_dir) and written["checkpoint"] == "last"
    assert out.with_suffix(".jsonl").read_text().count("\n") == 16  # trainer.eval.transcripts


@pytest.mark.slow
def test_bad_requests_fail_in_one_line(tmp_path, capsys):
    run_dir = tmp_path / "run"
    config = lm_smoke_config(tmp_path, "trainer.eval.every=0")  # no evaluations: no best checkpoint
    run_experiment(config, run_dir, handle_signals=False)
    with pytest.raises(ConfigError, match="--checkpoint must be one of"):
        evaluate_run(run_dir, checkpoint="newest")
    with pytest.raises(CheckpointError, match="has no best checkpoint"):
        evaluate_run(run_dir, checkpoint="best")
    with pytest.raises(ConfigError, match="unknown data split 'dev'"):
        evaluate_run(run_dir, split="dev")
    with pytest.raises(ConfigError, match="only run.. settings"):
        evaluate_run(run_dir, overrides=["seed=3"])
    with pytest.raises(DatasetFileError):
        evaluate_run(run_dir, data=tmp_path / "missing.pt")
    longer = build_scenario(lm_smoke_config(tmp_path, "scenario.length=6")).splits()["test"]
    longer.save(tmp_path / "longer.pt")
    with pytest.raises(ConfigError, match="lists of 6 values"):
        evaluate_run(run_dir, data=tmp_path / "longer.pt")
    with pytest.raises(CheckpointError, match="not a run folder"):
        evaluate_run(tmp_path / "nowhere")
    with pytest.raises(SystemExit) as exit_info:
        main([str(run_dir), "--split", "dev"])
    assert exit_info.value.code == 2 and capsys.readouterr().err.strip().count("\n") == 0
    assert default_output(run_dir, {"data": None, "split": "val", "checkpoint": "last"}).name == "last-val.json"
