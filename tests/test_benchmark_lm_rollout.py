"""scripts/benchmark_lm_rollout.py times a real LM-agent collection and its generate replay.

Tiny sizes, one thread, in-process: this checks the plumbing and the figures'
consistency, not the speed.
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from tests.script_modules import script_module

TINY = [
    "--num-threads", "1", "--warmup", "1", "--repeats", "3",
    "scenario.num_lists=300", "trainer.num_envs=8", "trainer.frames_per_batch=32", "trainer.minibatch_size=32",
    "scenario.default_agent.hidden_size=16", "scenario.default_agent.num_layers=1",
    "scenario.default_agent.intermediate_size=32",
    "scenario.agents.verifier.hidden_size=16", "scenario.agents.verifier.num_layers=1",
    "scenario.agents.verifier.intermediate_size=32",
]


@pytest.fixture(scope="module")
def benchmark():
    """The script as a module (it imports benchmark_lm from scripts/)."""
    with script_module("benchmark_lm_rollout") as module:
        yield module


@pytest.mark.slow  # about a second or more: the fast tier keeps tests under ~0.8 s
def test_rollout_against_generate(benchmark, tmp_path, capsys):
    output = tmp_path / "rollout.json"
    result = benchmark.main([*TINY, "--output", str(output)])

    assert result["frames_per_batch"] == 32 and result["num_envs"] == 8
    # nip: the prover speaks, then the verifier decides; one generate call per step.
    assert result["generate_calls_per_batch"] == 32 // 8
    for side in ("nip_like", "generate"):
        figures = result[side]
        assert len(figures["seconds"]) == len(figures["tokens"]) == 3
        assert figures["median_seconds"] > 0 and figures["tokens_per_second"] > 0
        # Every turn of every environment produces 1 to max_new_tokens (3) tokens.
        assert all(32 <= tokens <= 3 * 32 for tokens in figures["tokens"])
    assert 0 < result["nip_like"]["sample_share"] <= 1
    assert result["ratio"] == pytest.approx(
        result["nip_like"]["median_seconds_per_token"] / result["generate"]["median_seconds_per_token"]
    )
    assert json.loads(output.read_text())["ratio"] == pytest.approx(result["ratio"])
    assert "ratio (time per token" in capsys.readouterr().out


def test_graph_agents_are_refused(benchmark):
    with pytest.raises(SystemExit, match="not language models"):
        benchmark.main(["--preset", "none", "--repeats", "1", "--warmup", "0", "--num-threads", "1", "scenario=hidden_bits"])
