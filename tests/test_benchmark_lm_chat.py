"""scripts/benchmark_lm_chat.py runs at a tiny shape (``--smoke``) and reports every ratio it promises.

In-process, one thread, one repeat of everything, a tiny Qwen2 folder built by
the project's builder into a temporary cache: this checks the plumbing and
the invariants of the output, not the speed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import weakref
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

    # Activation bytes per token of each update: both sides, positive, and the ratio and verdict in the summary.
    for name in ("full", "lora"):
        for objective in ("GRPO", "DPO"):
            sides = updates[name]["updates"][objective]
            per_token = updates["activation_bytes_per_token"][name][objective]
            assert per_token["tokens"] == sides["nip_like"]["tokens"]
            if with_trl:
                assert per_token == sides["activation_bytes_per_token"]
            assert per_token["nip_like"] == sides["nip_like"]["saved_bytes"] / per_token["tokens"] > 0
            assert per_token["peak"]["nip_like"] == sides["nip_like"]["peak_bytes"] / per_token["tokens"] > 0
            assert sides["nip_like"]["saved_parameter_bytes"] > 0  # the weights the linear layers save, apart
            if with_trl:
                assert per_token["trl"] > 0 and per_token["peak"]["trl"] > 0
                assert per_token["ratio"] == pytest.approx(per_token["nip_like"] / per_token["trl"])
                assert per_token["peak"]["ratio"] == pytest.approx(per_token["peak"]["nip_like"] / per_token["peak"]["trl"])
                figure = results["summary"][f"activation_bytes_per_token_{objective}_{name}"]
                assert figure["value"] == per_token["ratio"] and figure["met"] == (per_token["ratio"] <= 1)
                assert f"peak_bytes_per_token_{objective}_{name}" in results["summary"]
    lora_grpo = updates["activation_bytes_per_token"]["lora"]["GRPO"]["nip_like"]
    assert lora_grpo < updates["activation_bytes_per_token"]["full"]["GRPO"]["nip_like"]  # frozen layers save less

    memory = results["memory"]
    rows = memory["rows"]
    assert [(row["reply_tokens"], row["budget"]) for row in rows] == [
        (length, budget) for length in (4, 8, 16) for budget in (None, 128)
    ]
    assert all(row["peak_bytes"] > 0 and row["held_bytes"] > 0 and row["saved_bytes_per_token"] > 0 for row in rows)
    longest = [row["peak_bytes"] for row in rows if row["reply_tokens"] == 16]
    assert longest[1] < longest[0]  # the budget lowers the peak of the longest replies
    for length in (4, 8, 16):  # with the budget, a micro-batch's activations are recomputed: only its inputs are saved
        saved = [row["saved_bytes_per_token"] for row in rows if row["reply_tokens"] == length]
        assert saved[1] < saved[0] / 10
    assert set(memory["growth"]) == {"without_budget", "with_budget"}

    for part in ("rollout", "updates", "memory"):
        assert len(results[part]["load_average"]) == 2 and results[part]["wall_seconds"] > 0
    assert results["threads"] == 1
    printed = capsys.readouterr().out
    assert "Summary" in printed and "rollout_ratio" in printed and "Activation bytes per token" in printed


@pytest.mark.slow  # about a second or more: the fast tier keeps tests under ~0.8 s
def test_decoding_part_compares_the_paths_with_generate_against_the_copy_bandwidth(benchmark, tmp_path, capsys):
    results = benchmark.main(["--smoke", "--parts", "decoding", "--cache-dir", str(tmp_path / "cache"), "--skip-trl"])
    decoding = results["decoding"]
    assert decoding["modes"] == ["eager", "static"] and set(decoding["sides"]) == {"eager", "static", "generate"}
    assert [decoding["sides"][mode]["path"] for mode in decoding["modes"]] == ["eager", "static"]
    assert decoding["same_greedy_messages"] == {"static": True} and decoding["greedy_rows_equal"] == {"static": 1.0}
    assert decoding["copy"]["bytes_per_second"] > 0 and decoding["weight_bytes"] > 0
    for name, side in decoding["sides"].items():
        assert side["tokens_per_second"] > 0 and side["step_seconds"] > 0 and len(side["seconds"]) == 1, name
        assert 0 < side["weights_bandwidth_share"] < side["bandwidth_share"], name  # the KV cache adds bytes
        assert side["step_bytes"] > decoding["weight_bytes"]
    static = decoding["sides"]["static"]
    assert static["slots"] == [decoding["prompt_width"] + 8]  # prompt plus T slots, uncompiled: not rounded up
    assert decoding["sides"]["generate"]["speedup_over_generate"] == 1.0
    # On the CPU the targets (compiled decoding on CUDA) do not apply; the figures are reported all the same.
    assert not decoding["targets_apply"] and decoding["fastest_mode"] == "static"
    summary = results["summary"]
    assert "met" not in summary["decoding_weights_bandwidth_share"] and summary["decoding_greedy_rows_equal_static"]["value"] == 1
    printed = capsys.readouterr().out
    assert "Decoding (B=4" in printed and "copy bandwidth" in printed


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


def test_saved_tensor_bytes_counts_what_the_graph_keeps_once_parameters_apart(benchmark):
    layer = torch.nn.Linear(16, 16)
    x = torch.randn(8, 16, requires_grad=True)
    block = 8 * 16 * 4  # bytes of one (8, 16) float32 activation

    def two_layers(h):
        return torch.relu(layer(torch.relu(layer(h))))

    with benchmark.bench.SavedTensorBytes(layer) as saved:
        output = two_layers(x)
        dropped = x.exp().sum()  # its graph (the output of exp, saved) is gone before the block ends
        del dropped
    # x (saved by the first layer), the first relu's output (saved by it and by the second layer: one storage)
    # and the second relu's output; the weight, saved by both layers, counted apart, once.
    assert saved.bytes == 3 * block and saved.parameter_bytes == 16 * 16 * 4
    output.sum().backward()

    # Under checkpointing the checkpoint's input is counted; what its region saves is recomputed, not kept.
    with benchmark.bench.SavedTensorBytes(layer) as checkpointed:
        output = torch.utils.checkpoint.checkpoint(two_layers, x, use_reentrant=False)
    assert checkpointed.bytes == block
    output.sum().backward()


def test_saved_tensor_bytes_frees_a_saved_output_with_its_graph(benchmark):
    # A pack hook that returned the output itself would make a cycle (output -> its node -> output) never freed.
    x = torch.randn(8, requires_grad=True)
    with benchmark.bench.SavedTensorBytes():
        y = x.exp()  # exp saves its output
        total = (y * 2).sum()
    y_ref = weakref.ref(y)
    del y, total
    assert y_ref() is None
