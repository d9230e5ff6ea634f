"""scripts/real_nip_vs_solo.py end to end on a tiny random-weight chat model folder (never the real model: CI time)."""

from __future__ import annotations

import json

import pytest

from tests.lm_folders import chat_model  # noqa: F401 - fixture
from tests.script_modules import script_module

pytestmark = pytest.mark.slow

#: One seed, one iteration, the smallest sizes the game takes.
TINY = (
    "--chat-template", "none", "--seeds", "0", "--iterations", "1", "--num-lists", "40", "--pretrain-epochs", "1",
    "--pretrain-minibatch", "8", "--num-envs", "2", "--frames-per-batch", "8", "--minibatch-size", "8",
    "--test-episodes", "4", "--threads", "1",
)


def test_the_script_runs_both_protocols_with_the_warm_start_and_compares_them(chat_model, tmp_path, capsys):
    folder = chat_model("qwen2", hidden_size=32, num_layers=1, intermediate_size=64)
    out = tmp_path / "out"
    with script_module("real_nip_vs_solo") as script:
        results = script.main(["--model", str(folder), "--out", str(out), *TINY])
        written = json.loads((out / "results.json").read_text())
        assert written["runs"] == results["runs"]
        assert [(row["protocol"], row["seed"]) for row in results["runs"]] == [("nip", 0), ("solo_verifier", 0)]
        for row in results["runs"]:
            assert "error" not in row, row
            assert set(script.METRICS) <= set(row["metrics"])
            assert 0.0 <= row["metrics"]["test/accuracy"] <= 1.0
            # Every run made its verifier's warm start (none was cached before this call).
            assert row["warm_start"]["pretrain/verifier/from_cache"] == 0.0
            assert row["wall_seconds"] > 0
        nip, solo = results["runs"]
        assert "pretrain/prover/from_cache" in nip["warm_start"]
        assert not any("prover" in name for name in solo["warm_start"]), "the solo verifier's game has no prover"
        assert set(results["mean_test_accuracy"]) == {"nip", "solo_verifier"}
        assert {row["objective"] for row in results["report"]["summary"]} == {"nip", "solo_verifier"}
        assert {row["metric"] for row in results["report"]["metrics"]} >= {"test/accuracy", "test/decided"}
        table = (out / "results.md").read_text()
        assert "| nip | 0 |" in table and "| solo_verifier | 0 |" in table
        assert "too few for confidence intervals" in table  # one run per protocol: the report says so
        assert (out / "report" / "report.md").is_file()
        # A second call reuses the finished runs: nothing runs again.
        again = script.main(["--model", str(folder), "--out", str(out), *TINY])
        assert again["runs"] == results["runs"]
        assert "running" not in capsys.readouterr().out.split("solo_verifier seed 0", 1)[1]


def test_a_missing_model_is_refused_in_one_line(tmp_path, capsys):
    with script_module("real_nip_vs_solo") as script, pytest.raises(SystemExit) as stopped:
        script.main(["--model", str(tmp_path / "nothing.gguf"), "--out", str(tmp_path / "out")])
    assert stopped.value.code == 2
    assert "--model" in capsys.readouterr().err.strip().splitlines()[-1]
