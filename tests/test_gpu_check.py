"""scripts/gpu_check.py: its parsing of pytest's summary, the run folders, nvidia-smi and the benchmark's JSON.

Pure parsing, no subprocess; plus two cheap checks that the options it passes still exist: the
benchmark's flags (its parser) and the runs' overrides (the composed config).
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import make_config
from tests.script_modules import script_module


@pytest.fixture(scope="module")
def gpu_check():
    """The script as a module."""
    with script_module("gpu_check") as module:
        yield module


PYTEST_PASSED = """\
..........................                                               [100%]
26 passed, 5 warnings in 60.80s (0:01:00)
"""

PYTEST_FAILED = """\
..F.......E...............                                               [100%]
=========================== short test summary info ============================
FAILED tests/test_cuda.py::test_lm_agents_train_on_cuda[ppo-bfloat16] - AssertionError: no parameter moved
ERROR tests/test_cuda.py::test_graph_agents_train_on_cuda[None] - RuntimeError: CUDA error
1 failed, 24 passed, 1 error in 91.02s (0:01:31)
"""

PYTEST_SKIPPED = """\
ssssssssssssssssssssssssss                                               [100%]
=========================== short test summary info ============================
SKIPPED [26] tests/test_cuda.py:37: needs CUDA
26 skipped in 3.10s
"""


def test_pytest_summary_counts(gpu_check):
    passed = gpu_check.parse_pytest_summary(PYTEST_PASSED)
    assert passed["found"] and (passed["passed"], passed["failed"], passed["skipped"]) == (26, 0, 0)
    assert passed["seconds"] == pytest.approx(60.80)

    failed = gpu_check.parse_pytest_summary(PYTEST_FAILED)
    assert (failed["passed"], failed["failed"], failed["errors"]) == (24, 1, 1)
    assert failed["failed_tests"] == ["tests/test_cuda.py::test_lm_agents_train_on_cuda[ppo-bfloat16]",
                                      "tests/test_cuda.py::test_graph_agents_train_on_cuda[None]"]

    skipped = gpu_check.parse_pytest_summary(PYTEST_SKIPPED)
    assert (skipped["passed"], skipped["skipped"]) == (0, 26) and skipped["skip_reasons"] == ["needs CUDA"]

    # Killed before its summary: nothing found.
    assert not gpu_check.parse_pytest_summary("....\n")["found"]
    assert gpu_check.parse_pytest_summary("no tests ran in 0.01s\n")["found"]


def test_metric_csv_and_nvidia_smi(gpu_check):
    assert gpu_check.parse_metric_csv("1,51.09\n2,12.14\n\nstep,value\n") == [(1, 51.09), (2, 12.14)]
    assert gpu_check.parse_nvidia_smi("81234\n") == [81234]
    assert gpu_check.parse_nvidia_smi("1 MiB\n  513\n[N/A]\n") == [1, 513]


def test_failure_reason_prefers_out_of_memory(gpu_check):
    output = (
        "Traceback (most recent call last):\n"
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
        "79.19 GiB of which 1.2 GiB is free. Including non-PyTorch memory, this process has 78 GiB in use.\n"
        "Error executing job with overrides: []\n"
    )
    reason = gpu_check.failure_reason(output)
    assert reason.startswith("torch.OutOfMemoryError: CUDA out of memory") and "non-PyTorch" not in reason
    assert gpu_check.failure_reason("x\nValueError: bad\nmore text\n") == "ValueError: bad"
    assert gpu_check.failure_reason("") == "no output"
    assert len(gpu_check.failure_reason("RuntimeError: " + "x" * 500, limit=50)) == 50


def test_run_folder_figures(gpu_check, tmp_path):
    timers = tmp_path / "metrics" / "scalars" / "timers"
    timers.mkdir(parents=True)
    (timers / "iteration.csv").write_text("2,12.1\n1,51.0\n")
    (timers / "collect.csv").write_text("1,16.0\n2,1.6\n")
    (timers / "update.csv").write_text("1,35.0\n2,8.5\n")
    (tmp_path / "metrics" / "scalars" / "SPS.csv").write_text("1,1.25\n2,6.34\n")
    summary = {"frames": 128, "train_seconds": 63.2, "test_metrics": {"test/accuracy": 0.625}}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    figures = gpu_check.read_run_folder(tmp_path)
    assert figures["iteration_seconds"] == [51.0, 12.1]  # in iteration order
    assert figures["collect_seconds"] == [16.0, 1.6] and figures["update_seconds"] == [35.0, 8.5]
    assert figures["frames_per_second"] == [1.25, 6.34]
    assert (figures["test_accuracy"], figures["frames"]) == (0.625, 128)
    # A run that died before writing anything.
    empty = gpu_check.read_run_folder(tmp_path / "missing")
    assert empty["iteration_seconds"] == [] and empty["test_accuracy"] is None


def test_benchmark_figures(gpu_check):
    side = {"tokens_per_second": 400.0, "median_seconds": 0.3, "peak_bytes": 3 * 2**30}
    results = {
        "model": {"parameters": 398_000_000, "prompt_tokens": [190, 204]},
        "rollout": {
            "whole": {"nip_like": {"tokens_per_second": 390.0}, "generate": {"tokens_per_second": 410.0}, "ratio": 1.05},
            "sample": {"nip_like": {"tokens_per_second": 405.0}, "generate": {"tokens_per_second": 400.0},
                       "ratio": 0.99, "same_messages": True},
        },
        "updates": {
            "full": {"trained_parameters": 1, "updates": {"GRPO": {"nip_like": side}, "DPO": {"nip_like": side}}},
            "lora": {"trained_parameters": 1, "updates": {"GRPO": {"nip_like": side}}},
            "lora_memory": {"GRPO": {"nip_like": 0.4, "nip_like_with_held": 0.2}},
        },
        "memory": {"rows": [{"reply_tokens": 64, "budget": None, "peak_bytes": 2**30, "seconds": [1.0]}],
                   "growth": {"without_budget": 3.9, "with_budget": 1.1}},
        "summary": {"rollout_ratio": {"value": 1.05, "target": "<= 1.05", "met": True}},
    }
    figures = gpu_check.benchmark_figures(results)
    assert figures["rollout_tokens_per_second"] == 390.0 and figures["rollout_generate_tokens_per_second"] == 410.0
    assert figures["sample_ratio"] == 0.99 and figures["same_messages"] is True
    assert set(figures["update"]) == {"GRPO full", "DPO full", "GRPO lora"}
    assert figures["update"]["GRPO lora"]["peak_bytes"] == 3 * 2**30
    assert figures["lora_over_full_memory"] == {"GRPO": {"step": 0.4, "with_held": 0.2}}
    assert figures["memory_rows"] == [{"reply_tokens": 64, "budget": None, "peak_bytes": 2**30}]
    assert figures["summary"] == {"rollout_ratio": 1.05}
    # A part left out (--parts) loses its figures, not the others.
    partial = gpu_check.benchmark_figures({"model": {"parameters": 5}})
    assert partial["rollout_tokens_per_second"] is None and partial["update"] == {} and partial["parameters"] == 5


def test_decoding_figures_and_row(gpu_check):
    def side(tokens, step, weights_share, share, speedup, first, path=None):
        return {"path": path, "tokens_per_second": tokens, "step_seconds": step, "weights_bandwidth_share": weights_share,
                "bandwidth_share": share, "speedup_over_generate": speedup, "first_call_seconds": first}

    results = {"decoding": {
        "sides": {"eager": side(410.0, 0.0195, 0.02, 0.03, 1.02, 3.1, "eager"),
                  "compiled": side(6500.0, 0.0011, 0.31, 0.40, 16.2, 71.5, "compiled"),
                  "generate": side(400.0, 0.0199, 0.02, 0.03, 1.0, 2.9)},
        "fastest_mode": "compiled", "targets_apply": True, "copy": {"bytes_per_second": 2.6e12},
        "same_greedy_messages": {"compiled": True}, "sampling_dtype": "bfloat16", "batch_size": 8, "prompt_width": 204,
    }}
    figures = gpu_check.decoding_figures(results)
    assert figures["sides"]["compiled"]["step_ms"] == pytest.approx(1.1) and figures["copy_gb_per_second"] == 2600
    assert figures["met"] == {"weights_bandwidth_share": True, "speedup_over_generate": True}
    reason, tokens, notes = gpu_check.decoding_row(figures)
    assert reason == "compiled: 31.0% of the bandwidth limit, 16.20x generate; targets met"
    assert tokens == "eager 410, compiled 6,500, generate 400"
    assert "first call eager 3.1 s, compiled 71.5 s, generate 2.9 s" in notes
    assert "greedy messages equal to eager's: compiled True" in notes

    results["decoding"]["sides"]["compiled"]["weights_bandwidth_share"] = 0.12
    reason, _, _ = gpu_check.decoding_row(gpu_check.decoding_figures(results))
    assert reason.endswith("target MISSED: weights bandwidth share >= 0.25")
    results["decoding"]["targets_apply"] = False  # the CPU: nothing to meet
    figures = gpu_check.decoding_figures(results)
    assert figures["met"] == {"weights_bandwidth_share": None, "speedup_over_generate": None}
    assert gpu_check.decoding_row(figures)[0].endswith("(the targets are for compiled decoding on CUDA)")
    # The part left out: no figures, not an error.
    assert gpu_check.decoding_figures({})["sides"] == {} and gpu_check.decoding_row(gpu_check.decoding_figures({}))[1] == "-"


def test_table_and_formats(gpu_check):
    result = gpu_check.StepResult("run_float32", "fail", "exit 1: a|b", 12.0, notes=["n1", "n2"])
    table = gpu_check.markdown_table(gpu_check.TABLE_HEADER, gpu_check.table_rows([result]))
    lines = table.splitlines()
    assert lines[0] == "| step | result | tokens/s | peak memory | iteration time | notes |"
    assert lines[2] == "| run_float32 | fail: exit 1: a\\|b | - | - | - | n1; n2; step took 12 s |"
    assert gpu_check.format_bytes(3 * 2**30) == "3.00 GiB" and gpu_check.format_bytes(None) == "-"
    assert gpu_check.format_bytes(512 * 2**20) == "512 MiB"
    assert gpu_check.format_seconds_list([51.04, 12.1]) == "51.0 s, 12.1 s"
    assert gpu_check.device_index("cuda") == 0 and gpu_check.device_index("cuda:2") == 2
    assert gpu_check.device_index("cpu") is None


def test_command_line(gpu_check):
    args = gpu_check.parse_args(["--skip", "tests,run", "--device", "cpu", "--shape", "small"])
    assert args.skip == ["tests", "run"] and args.device == "cpu" and args.shape == "small"
    assert gpu_check.parse_args(["--skip", "tests,benchmark,run"]).skip == ["tests", "benchmark", "run"]  # decoding only
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--skip", "everything"])
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--device", "tpu"])


@pytest.mark.parametrize("shape", ["small", "398m"])
def test_the_options_it_passes_exist(gpu_check, shape, tmp_path):
    """The benchmark's parser takes the check's flags, and the runs' overrides compose."""
    with script_module("benchmark_lm_chat") as benchmark:
        for options in (gpu_check.BENCHMARK_ARGS[shape], gpu_check.DECODING_ARGS[shape]):
            args = benchmark.parse_args(["--model-folder", str(tmp_path), "--device", "cpu", "--output",
                                         str(tmp_path / "b.json"), *options])
            assert ("decoding" in args.parts) == (options is gpu_check.DECODING_ARGS[shape])
    for _, autocast in gpu_check.RUN_DTYPES:
        overrides = [*gpu_check.RUN_COMMAND, *gpu_check.RUN_OVERRIDES[shape], *([autocast] if autocast else [])]
        config = make_config(*overrides)
        assert config.scenario.view == "chat" and config.trainer.num_iterations == 2


def test_stress_test_figures_and_row(gpu_check):
    def arm(name, per_seed, iqm, low, high, seconds):
        return {"arm": name, "seeds": [0, 1, 2], "per_seed": per_seed, "interval": "range of 3 runs",
                "metrics": {"test/attack_success_rate": {"iqm": iqm, "iqm_low": low, "iqm_high": high},
                            "test/likelihood": {"iqm": -3.0, "iqm_low": -3.1, "iqm_high": -2.9}},
                "run_wall_seconds_mean": seconds}

    results = {"arms": [arm("untrained", [0.1, 0.0, 0.05], 0.05, 0.0, 0.1, 41.2),
                        arm("dpo", [0.2, 0.3, 0.25], 0.25, 0.2, 0.3, 130.6), arm("ppo", [0.1, 0.2, 0.3], 0.2, 0.1, 0.3, None)],
               "size": {"iterations": 20, "envs": 16}, "keywords": ["hate", "awful"], "wall_seconds_this_call": 301.0}
    figures = gpu_check.stress_test_figures(results)
    assert list(figures["arms"]) == ["untrained", "dpo", "ppo"]
    assert figures["arms"]["dpo"]["per_seed"] == [0.2, 0.3, 0.25] and figures["arms"]["dpo"]["iqm"] == 0.25
    assert figures["seconds"] == 301.0
    reason, run_time, notes = gpu_check.stress_test_row(figures)
    assert reason == ("held-out attack success rate, IQM [range of 3 runs]: untrained 0.050 [0.000, 0.100], "
                      "dpo 0.250 [0.200, 0.300], ppo 0.200 [0.100, 0.300]")
    assert run_time == "a run: untrained 41 s, dpo 131 s"  # an arm without a time is left out
    assert notes == ["seeds 0 1 2", "size iterations 20, envs 16", "keywords hate awful"]
    # A results.json without arms (a call cut short): said so, not an error.
    assert gpu_check.stress_test_row(gpu_check.stress_test_figures({}))[0] == "no arms in results.json"


@pytest.mark.parametrize("shape", ["small", "398m"])
def test_the_stress_test_options_it_passes_exist(gpu_check, shape, tmp_path):
    with script_module("stress_test_result") as result:
        args = result.parse_args(["--model", str(tmp_path), "--device", "cpu", "--out", str(tmp_path / "out"),
                                  *gpu_check.STRESS_TEST_ARGS[shape]])
        size = result.chosen_size(args)
        assert result.check_args(args) == list(result.KEYWORDS)
    assert len(args.seeds) == (3 if shape == "398m" else 1) and args.arms == list(result.ARMS)
    assert size == (result.SIZES["gpu"] if shape == "398m" else result.replace(result.SIZES["cpu"], iterations=1))
    assert gpu_check.parse_args(["--stress-test"]).stress_test and not gpu_check.parse_args([]).stress_test


def test_real_nip_figures_and_row(gpu_check):
    def run(protocol, seed, accuracy, decided, seconds):
        return {"protocol": protocol, "seed": seed, "wall_seconds": seconds,
                "metrics": {"test/accuracy": accuracy, "test/decided": decided}}

    results = {"runs": [run("nip", 0, 0.9, 1.0, 100.0), run("nip", 1, 0.8, 0.95, 120.0), run("solo_verifier", 0, 0.5, 1.0, 60.0),
                        {"protocol": "solo_verifier", "seed": 1, "error": "out of memory"}],
               "size": {"seeds": [0, 1], "iterations": 10}}
    figures = gpu_check.real_nip_figures(results)
    assert list(figures["protocols"]) == ["nip", "solo_verifier"]
    assert figures["protocols"]["nip"]["mean_accuracy"] == pytest.approx(0.85)
    assert figures["protocols"]["solo_verifier"]["seeds"] == [0]  # the failed run is an error, not a seed
    reason, run_time, notes = gpu_check.real_nip_row(figures)
    assert reason == ("held-out accuracy, mean over seeds: nip 0.850 (seeds 0.900 0.800; decided 1.00 0.95), "
                      "solo_verifier 0.500 (seeds 0.500; decided 1.00)")
    assert run_time == "a run: nip 110 s, solo_verifier 60 s"
    assert notes == ["seeds 0 1", "size iterations 10", "solo_verifier seed 1: out of memory"]
    assert gpu_check.real_nip_row(gpu_check.real_nip_figures({}))[0] == "no finished runs in results.json"


@pytest.mark.parametrize("shape", ["small", "398m"])
def test_the_real_nip_options_it_passes_exist(gpu_check, shape, tmp_path):
    with script_module("real_nip_vs_solo") as script:
        args, size = script.parse_args(["--model", str(tmp_path), "--device", "cpu", "--out", str(tmp_path / "out"),
                                        *gpu_check.REAL_NIP_ARGS[shape]])
    assert len(size.seeds) == (3 if shape == "398m" else 1) and size.device == "cpu"
    assert size.iterations == (script.SIZES["gpu"].iterations if shape == "398m" else 1)
    assert gpu_check.parse_args(["--real-nip"]).real_nip and not gpu_check.parse_args([]).real_nip
