"""scripts/benchmark_lm.py runs with tiny sizes and reports every figure it promises.

The script is imported and its ``main`` called in-process, on one thread, with
one repeat of everything: this checks the plumbing and the output's fields,
not the speed. The TRL part runs only where TRL (the ``bench`` extra) is
installed.
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from tests.script_modules import script_module

TINY = ["-B", "4", "-P", "5", "-T", "4", "-G", "2", "--repeats", "1", "--update-steps", "1", "--warmup", "1"]
TINY += ["--threads", "1"]  # one thread: much faster on a busy machine


@pytest.fixture(scope="module")
def benchmark():
    """The script as a module."""
    with script_module("benchmark_lm") as module:
        yield module


@pytest.fixture
def run_main(benchmark):
    """Call the script's main with the given arguments, restoring torch's thread count afterwards."""
    threads = torch.get_num_threads()

    def run(*arguments: str) -> dict:
        return benchmark.main([*TINY, *arguments])

    yield run
    torch.set_num_threads(threads)


def assert_positive_timing(row: dict) -> None:
    assert row["median_seconds"] > 0 and row["median_cpu_seconds"] >= 0
    assert row["tokens_per_second"] > 0


def assert_update(row: dict) -> None:
    assert_positive_timing(row)
    assert row["tokens"] > row["message_tokens"] > 0
    assert row["message_tokens_per_second"] > 0


def test_rollout_and_framework_updates(run_main, tmp_path, capsys):
    output = tmp_path / "lm.json"
    results = run_main("--skip-trl", "--output", str(output))

    rollout = results["rollout"]
    for side in ("nip_like", "generate"):
        assert_positive_timing(rollout[side])
        assert all(tokens > 0 for tokens in rollout[side]["tokens"])
        assert rollout[side]["median_seconds_per_token"] > 0
    assert rollout["ratio"] > 0 and rollout["target_ratio"] == pytest.approx(1.10)
    per_token = {side: rollout[side]["median_seconds_per_token"] for side in ("nip_like", "generate")}
    assert rollout["ratio"] == pytest.approx(per_token["nip_like"] / per_token["generate"])
    assert rollout["meets_target"] is (rollout["ratio"] <= rollout["target_ratio"])
    assert rollout["same_messages"] is True  # same distribution, same seed, on the CPU

    for objective in ("GRPO", "DPO"):
        sides = results["updates"][objective]
        assert set(sides) == {"nip_like"}
        assert_update(sides["nip_like"])
        assert sides["nip_like"]["peak_bytes"] > 0
    assert results["peak_rss_bytes"] > 0
    assert results["versions"]["trl"] is None
    assert json.loads(output.read_text())["updates"]["GRPO"]["nip_like"]["tokens"] == results["updates"]["GRPO"][
        "nip_like"
    ]["tokens"]

    printed = capsys.readouterr().out
    assert "LMPolicy.sample" in printed and "model.generate" in printed
    assert "GRPO, nip_like" in printed and "DPO, nip_like" in printed


@pytest.mark.slow
def test_trl_updates(run_main, monkeypatch):
    pytest.importorskip("trl")
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is used on purpose
    results = run_main()
    for objective in ("GRPO", "DPO"):
        sides = results["updates"][objective]
        assert_update(sides["trl"]["update"])
        assert sides["trl"]["peak_bytes"] > 0
        assert sides["trl"]["update"]["tokens"] == sides["nip_like"]["tokens"]  # the same batch on both sides
        assert sides["trl_over_nip_like"] > 0
        assert len(sides["nip_like"]["seconds"]) == len(sides["trl"]["update"]["seconds"]) == 1
    grpo = results["updates"]["GRPO"]["trl"]
    assert_update(grpo["step"])
    assert grpo["step"]["median_seconds"] >= grpo["update"]["median_seconds"]
    assert results["versions"]["trl"]


def test_refuses_a_group_size_that_does_not_divide_the_batch(benchmark, capsys):
    with pytest.raises(SystemExit):
        benchmark.parse_args(["-B", "6", "-G", "4"])
    assert "--group-size" in capsys.readouterr().err


def test_messages_are_counted_up_to_and_including_eos(benchmark):
    eos, pad = 2, 0
    tokens = torch.tensor([[5, 2, 0, 0], [5, 6, 7, 8], [2, 0, 0, 0]])
    assert benchmark.message_lengths(tokens, eos).tolist() == [2, 4, 1]
    mask = tokens != pad
    extended, extended_mask = benchmark.ending_with_eos(tokens, mask, eos, pad)
    assert extended.tolist() == [[5, 2, 0, 0, 0], [5, 6, 7, 8, 2], [2, 0, 0, 0, 0]]
    assert extended_mask.sum(-1).tolist() == [2, 5, 1]
