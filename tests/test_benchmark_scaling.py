"""scripts/benchmark_scaling.py runs 1 and 2 ranks through torchrun and reports the efficiency.

The smoke preset, two iterations: this checks the plumbing and the figures'
consistency, not the speed (the docs' figures come from the script itself).
"""

from __future__ import annotations

import json

import pytest

from tests.script_modules import script_module


@pytest.mark.slow
def test_the_scaling_benchmark_times_one_and_two_ranks_and_adds_a_sharded_row_with_fsdp(tmp_path):
    # One benchmark call gives all three rows (one rank, two ranks, two sharded ranks): each row is a torchrun
    # launch of its own, so one call checks what two did, at half the launches.
    output = tmp_path / "scaling.json"
    with script_module("benchmark_scaling") as benchmark:
        result = benchmark.main(["--presets", "lm_quick", "--iterations", "2", "--skip", "1", "--fsdp", "--output", str(output)])
        with pytest.raises(SystemExit):
            benchmark.main(["--presets", "smoke", "--ranks", "2"])  # no one-rank run to compare with
    assert json.loads(output.read_text()) == result
    rows = [(row["ranks"], row["sharded"]) for row in result["rows"]]
    assert rows == [(1, False), (2, False), (2, True)]
    one, two, sharded = result["rows"]
    assert result["grad_accumulation_steps"] == 2
    assert one["efficiency"] == 1.0
    for row in (two, sharded):
        assert row["efficiency"] == pytest.approx(row["sps"] / (2 * one["sps"]))
    assert all(row["sps"] > 0 and row["update_s"] > 0 and row["iterations_timed"] == 1 for row in (one, two, sharded))
