"""scripts/benchmark_lm_chat.py runs at a tiny shape (``--smoke``) and reports every ratio it promises.

In-process, one thread, one repeat of everything, a tiny Qwen2 folder built by
the project's builder into a temporary cache: this checks the plumbing and
the invariants of the output, not the speed.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from tests.lm_folders import chat_model  # noqa: F401 - the fixture
from tests.script_modules import script_module


@pytest.fixture(scope="module")
def benchmark():
    """The script as a module (it imports benchmark_lm and benchmark_lm_rollout from scripts/)."""
    with script_module("benchmark_lm_chat") as module:
        yield module


@pytest.mark.slow
def test_smoke_run_reports_every_ratio(benchmark, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is used on purpose
    with_trl = importlib.util.find_spec("trl") is not None
    output = tmp_path / "chat.json"
    results = benchmark.main(
        ["--smoke", "--cache-dir", str(tmp_path / "cache"), "--output", str(output),
         *([] if with_trl else ["--skip-trl"])]
    )
    assert json.loads(output.read_text())["summary"].keys() == results["summary"].keys()
    assert results["model"]["model_type"] == "qwen2" and results["model"]["vocabulary"] == 1000
    assert Path(results["model"]["folder"]).parent == tmp_path / "cache"  # built once, into the cache

    whole = results["rollout"]["whole"]
    # One episode per environment and batch (prover, then verifier): 2 x 4 replies of 1 to 8 tokens.
    assert whole["num_envs"] == 4 and whole["frames_per_batch"] == 8 and whole["generate_calls_per_batch"] == 2
    for side in ("nip_like", "generate"):
        assert all(8 <= tokens <= 8 * 8 for tokens in whole[side]["tokens"])
    assert whole["ratio"] > 0 and whole["target_ratio"] == pytest.approx(1.05)
    sample = results["rollout"]["sample"]
    assert sample["same_messages"] is True and sample["ratio"] > 0  # same distribution, same seed, on the CPU

    updates = results["updates"]
    assert updates["lora"]["trained_parameters"] < updates["full"]["trained_parameters"]
    for name in ("full", "lora"):
        for objective in ("GRPO", "DPO"):
            sides = updates[name]["updates"][objective]
            assert sides["nip_like"]["median_seconds"] > 0 and sides["nip_like"]["peak_bytes"] > 0
            if with_trl:
                assert sides["trl"]["update"]["tokens"] == sides["nip_like"]["tokens"]  # the same batch
                assert sides["trl_over_nip_like"] > 0
    for objective in ("GRPO", "DPO"):
        assert 0 < updates["lora_memory"][objective]["nip_like"] < 1.5

    memory = results["memory"]
    rows = memory["rows"]
    assert [(row["reply_tokens"], row["budget"]) for row in rows] == [
        (length, budget) for length in (4, 8, 16) for budget in (None, 128)
    ]
    assert all(row["peak_bytes"] > 0 and row["held_bytes"] > 0 for row in rows)
    longest = [row["peak_bytes"] for row in rows if row["reply_tokens"] == 16]
    assert longest[1] < longest[0]  # the budget lowers the peak of the longest replies
    assert set(memory["growth"]) == {"without_budget", "with_budget"}

    for part in ("rollout", "updates", "memory"):
        assert len(results[part]["load_average"]) == 2 and results[part]["wall_seconds"] > 0
    assert results["threads"] == 1
    printed = capsys.readouterr().out
    assert "Summary" in printed and "rollout_ratio" in printed


def test_chat_prompts_come_in_groups_of_equal_left_padded_prompts(benchmark, chat_model):  # noqa: F811
    args = benchmark.parse_args(["--smoke", "-B", "6", "-G", "3"])
    policy = benchmark.load_policy(chat_model("qwen2"), 8)
    prompts = benchmark.chat_prompts(policy.tokenizer, args, torch.device("cpu"))
    assert prompts.ids.shape[0] == 6
    assert torch.equal(prompts.ids[0], prompts.ids[2]) and not torch.equal(prompts.ids[0], prompts.ids[3])
    assert bool(prompts.mask[:, -1].all())  # padded on the left
    text = policy.tokenizer.decode(prompts.ids[0][prompts.mask[0]])
    assert "list: 0=" in text and text.endswith("<|im_start|>assistant\n")


def test_a_message_cut_short_keeps_its_first_tokens(benchmark):
    prompts = benchmark.bench.Prompts(torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.bool))
    tokens = torch.arange(10).view(2, 5)
    batch = benchmark.bench.GroupBatch(prompts, tokens, tokens > 0, tokens.float(), torch.zeros(2), torch.zeros(2), 2)
    cut = benchmark.truncated(batch, 3)
    assert cut.tokens.tolist() == [[0, 1, 2], [5, 6, 7]] and cut.sample_log_probs.shape == (2, 3)


def test_refuses_a_group_size_that_does_not_divide_the_batch(benchmark, capsys):
    with pytest.raises(SystemExit):
        benchmark.parse_args(["-B", "6", "-G", "4"])
    assert "--group-size" in capsys.readouterr().err
