"""scripts/benchmark_scaling.py runs 1 and 2 ranks through torchrun and reports the efficiency.

The lm_quick preset made smaller, two iterations: this checks the plumbing and
the figures' consistency, not the speed (the docs' figures come from the script itself).
"""

from __future__ import annotations

import json

import pytest

from tests.script_modules import script_module

#: lm_quick's models on a smaller game, after the script's own options (the last value of a key wins): 400 lists
#: instead of 4000 to generate, and a global batch of 64 frames from 16 environments (8 of each per rank) with one
#: epoch of two 32-frame minibatches, one optimiser step (the script accumulates lcm(1, 2) = 2 minibatches), in
#: place of 512 frames, 64 environments and 2 epochs of 128-frame minibatches. Each row is still a timed torchrun
#: launch of its own: the rows, their flags and their figures' consistency are what is checked, not the speed.
SMALLER = ("scenario.num_lists=400", "trainer.num_envs=16", "trainer.frames_per_batch=64", "trainer.minibatch_size=32",
           "trainer.num_epochs=1")


@pytest.mark.slow
def test_the_scaling_benchmark_times_one_and_two_ranks_and_adds_a_sharded_row_with_fsdp(tmp_path):
    # One benchmark call gives all three rows (one rank, two ranks, two sharded ranks): each row is a torchrun
    # launch of its own, so one call checks what two did, at half the launches.
    output = tmp_path / "scaling.json"
    with script_module("benchmark_scaling") as benchmark:
        result = benchmark.main(["--presets", "lm_quick", "--iterations", "2", "--skip", "1", "--fsdp", "--output", str(output),
                                 *SMALLER])
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
