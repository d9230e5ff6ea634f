"""scripts/benchmark_shared_base.py runs at a tiny shape (``--smoke``) and reports every figure it promises.

In-process, one thread, a tiny Qwen2 folder built by the project's builder
into a temporary cache: this checks the plumbing and the invariants of the
output (the shared run holds exactly one base less), not the speed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from tests.script_modules import script_module

KINDS = ("frozen", "trained", "buffers", "gradients", "optimizer", "total")


@pytest.fixture(scope="module")
def benchmark():
    """The script as a module (it imports benchmark_lm and benchmark_lm_chat from scripts/)."""
    with script_module("benchmark_shared_base") as module:
        yield module


@pytest.mark.slow
def test_smoke_run_reports_every_figure_and_holds_one_base_less(benchmark, tmp_path, capsys):
    output = tmp_path / "shared_base.json"
    results = benchmark.main(["--smoke", "--iterations", "3", "--cache-dir", str(tmp_path / "cache"),
                              "--output", str(output)])
    written = json.loads(output.read_text())
    assert written.keys() == results.keys()
    for key in ("held", "cuda_memory_allocated", "update_peak", "seconds_per_iteration", "targets", "model",
                "versions", "device", "load_average", "same_work"):
        assert key in written, key
    model = written["model"]
    assert model["shape"] == "qwen2-tiny" and model["model_type"] == "qwen2" and model["parameters"] > 0
    assert Path(model["folder"]).parent == tmp_path / "cache"  # built once, into the cache
    assert written["verifier_base_owner"] == {"shared": "prover", "copies": None}
    assert set(written["versions"]) >= {"torch", "transformers", "peft"}
    assert len(written["load_average"]["start"]) == len(written["load_average"]["end"]) == 3

    # Memory held: the same adapters, value heads and optimiser state on both sides; the base once instead of twice.
    held = written["held"]
    for run in ("shared", "copies"):
        assert set(held[run]) == set(KINDS)
        assert held[run]["total"] == sum(held[run][kind] for kind in KINDS[:-1])
        assert held[run]["trained"] > 0 and held[run]["optimizer"] > 0
    assert held["shared"]["trained"] == held["copies"]["trained"]
    assert held["shared"]["optimizer"] == held["copies"]["optimizer"]
    assert held["shared"]["total"] < held["copies"]["total"]
    assert held["copies"]["total"] - held["shared"]["total"] == held["difference"] == model["base_bytes"]
    assert held["copies"]["frozen"] == 2 * held["shared"]["frozen"]
    assert held["ratio"] == pytest.approx(held["shared"]["total"] / held["copies"]["total"])
    assert held["target"] == pytest.approx(0.55) and held["met"] == (held["ratio"] <= 0.55)
    assert written["cuda_memory_allocated"] is None  # on the CPU

    peak = written["update_peak"]
    assert peak["shared"] > 0 and peak["copies"] > 0
    assert peak["ratio"] == pytest.approx(peak["shared"] / peak["copies"])

    timing = written["seconds_per_iteration"]
    assert len(timing["shared"]) == len(timing["copies"]) == 3
    assert all(seconds > 0 for seconds in (*timing["shared"], *timing["copies"]))
    assert timing["ratio"] == pytest.approx(timing["median_shared"] / timing["median_copies"])
    assert timing["target"] == pytest.approx(1.05) and timing["met"] == (timing["ratio"] <= 1.05)
    assert written["targets"]["held_ratio"]["met"] == held["met"]
    assert written["targets"]["time_ratio"]["met"] == timing["met"]

    # The same seed, the same samples and updates: the two runs did the same work at every iteration.
    assert written["same_work"] is True and len(written["iteration_metrics"]["shared"]) == 3 + 2
    assert written["threads"] == 1
    printed = capsys.readouterr().out
    assert "held between iterations" in printed and "median s per iteration" in printed


def test_the_two_runs_differ_only_in_sharing_the_base(benchmark):
    args = benchmark.parse_args(["--smoke"])
    shared, copies = (benchmark.game_overrides(Path("/models/m"), args, shared) for shared in (True, False))
    assert shared[0] == "preset=none" and "trainer=ppo" in shared and "scenario.view=chat" in shared
    different = [(a, b) for a, b in zip(shared, copies) if a != b]
    assert len(shared) == len(copies) and len(different) == 1
    assert "share_base_with: prover" in different[0][0] and "share_base_with" not in different[0][1]
    assert "pretrained_path: /models/m" in different[0][1] and "lora: {r: 8}" in different[0][1]
