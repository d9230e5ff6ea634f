"""scripts/benchmark_scaling.py runs 1 and 2 ranks through torchrun and reports the efficiency.

The smoke preset, two iterations: this checks the plumbing and the figures'
consistency, not the speed (the docs' figures come from the script itself).
"""

from __future__ import annotations

import json

import pytest

from tests.script_modules import script_module


@pytest.mark.slow
def test_the_scaling_benchmark_times_one_and_two_ranks(tmp_path):
    output = tmp_path / "scaling.json"
    with script_module("benchmark_scaling") as benchmark:
        result = benchmark.main(["--presets", "smoke", "--iterations", "3", "--skip", "1", "--output", str(output)])
        with pytest.raises(SystemExit):
            benchmark.main(["--presets", "smoke", "--ranks", "2"])  # no one-rank run to compare with
    assert json.loads(output.read_text()) == result
    one, two = result["rows"]
    assert (one["ranks"], two["ranks"]) == (1, 2) and result["grad_accumulation_steps"] == 2
    assert one["efficiency"] == 1.0 and two["efficiency"] == pytest.approx(two["sps"] / (2 * one["sps"]))
    assert all(row["sps"] > 0 and row["update_s"] > 0 and row["iterations_timed"] == 2 for row in (one, two))


@pytest.mark.slow
def test_the_scaling_benchmark_adds_a_sharded_row_with_fsdp():
    with script_module("benchmark_scaling") as benchmark:
        result = benchmark.main(["--presets", "lm_quick", "--iterations", "2", "--skip", "1", "--fsdp"])
    rows = [(row["ranks"], row["sharded"]) for row in result["rows"]]
    assert rows == [(1, False), (2, False), (2, True)]
    sharded = result["rows"][2]
    assert sharded["sps"] > 0 and sharded["efficiency"] == pytest.approx(sharded["sps"] / (2 * result["rows"][0]["sps"]))
