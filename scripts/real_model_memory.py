"""The memory preflight's estimate of one update beside the measured peak, on a real model (Gemma 3 270M by default).

:func:`nip_like.lm.memory.check_lm_memory` refuses a run whose update
clearly cannot fit, from an estimate made before any model exists
(:func:`nip_like.lm.memory.estimate_lm_memory`): the weights, the gradients
and optimiser state, the activations of one micro-batch and one chunk's
logits. This script checks that estimate against what one update really
takes on the CPU, with LoRA adapters and with full fine-tuning.

Each configuration runs in its own subprocess, so that nothing of the one
before stays resident. The subprocess loads the model through the user path
(``pretrained_path``, a model folder or a ``.gguf`` file, with
``chat_template``), builds a batch of ``B`` rows of ``--prompt-tokens``
prompt tokens and ``T`` reply tokens (random ids), and makes one update as
the benchmarks do (:class:`benchmark_lm.FrameworkUpdate`: a policy-gradient
loss over the replies' log-probabilities, backward, gradient clipping, an
AdamW step, whose state is allocated in this first step). The token budget
(``max_tokens_per_micro_batch``) is the whole batch, so the update is one
micro-batch of ``B x (prompt + T)`` tokens, as the estimate assumes. The
measured peak is the peak resident memory of the update (Linux's ``VmHWM``,
reset through ``/proc/self/clear_refs`` just before it; where that cannot be
reset, a sampler of ``/proc/self/statm`` every millisecond) minus the
resident memory before it (the weights loaded, the batch built).

The table gives, per configuration, the estimate's parts, the estimated
update (state + activations + logits) and the measured peak, and their
ratio, then the whole figure (weights + update) both ways: the weights as
estimated from the folder's ``config.json`` against the bytes of the loaded
parameters. A last column gives the activation bytes a token as
:func:`nip_like.lm.memory.activation_bytes_per_token` measures them after the
update (the probe that sets the automatic token budget) beside the
estimate's.

Run it from the repository root::

    python scripts/real_model_memory.py                      # Gemma 3 270M (the test suite's GGUF), LoRA and full
    python scripts/real_model_memory.py --model models/my-qwen --chat-template chatml -B 8 --new-tokens 64
    python scripts/real_model_memory.py --configs lora --output memory.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "scripts")]

from lm_benchmark_env import set_script_environment  # noqa: E402

#: The test suite's real model (tests/real_model.py assembles it there).
DEFAULT_MODEL = "~/.cache/nip_like/real_model/gemma-3-270m-q4_k_m.gguf"
#: Configurations: LoRA adapters of rank --lora-r ("lora"), or every weight trains ("full").
CONFIGS = ("lora", "full")
#: Largest acceptable distance of the estimate from the measured peak, as a share of the peak.
TOLERANCE = 0.25
MIB = 2**20
PAGE = os.sysconf("SC_PAGE_SIZE")


# ------------------------------------------------------------------ resident memory
def resident_bytes() -> int:
    """The process's resident memory now (``/proc/self/statm``)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * PAGE


def reset_peak() -> bool:
    """Reset the process's peak resident memory (``VmHWM``); False where the kernel does not allow it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def peak_since_reset() -> int:
    """``VmHWM`` of ``/proc/self/status``: the peak resident memory since the last :func:`reset_peak`."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM line")


def peak_of(work: Callable[[], None]) -> tuple[int, str]:
    """The peak resident memory while ``work`` runs, and how it was measured."""
    if reset_peak():
        work()
        return peak_since_reset(), "VmHWM reset through /proc/self/clear_refs"
    peak, done = resident_bytes(), threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, resident_bytes())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        work()
    finally:
        done.set()
        sampler.join()
    return max(peak, resident_bytes()), "/proc/self/statm sampled every millisecond"


# ------------------------------------------------------------------ one configuration (in a subprocess)
def measure(args: argparse.Namespace, config_name: str) -> dict[str, Any]:
    """One update of ``config_name`` in this process: the estimate's parts and the measured peak, in bytes."""
    import torch

    import benchmark_lm as bench
    from nip_like.lm.lora import LoraOptions
    from nip_like.lm.memory import activation_bytes_per_token, estimate_lm_memory
    from nip_like.lm.models import LMAgentConfig, build_lm_policy, source_folder

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    folder = source_folder(str(Path(args.model).expanduser()), "--model")
    rows, prompt, reply = args.batch_size, args.prompt_tokens, args.new_tokens
    config = LMAgentConfig(
        pretrained_path=str(folder),
        chat_template=args.chat_template,
        max_new_tokens=reply,
        value_head=False,
        lora=LoraOptions(r=args.lora_r if config_name == "lora" else 0),
        max_tokens_per_micro_batch=rows * (prompt + reply),  # the whole batch in one pass, as the estimate assumes
    )
    estimate = estimate_lm_memory({"agent": ("agent", config, 0)}, sampling_batch=rows, minibatch_size=rows)["agent"]
    loading = resident_bytes()
    policy = build_lm_policy(config)
    loaded = resident_bytes()
    with torch.no_grad():  # weights mapped from the folder's file are read in now, not during the update
        for tensor in (*policy.parameters(), *policy.buffers()):
            tensor.sum()
    vocabulary = policy.model.get_input_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(args.seed)
    prompt_ids = torch.randint(vocabulary // 8, vocabulary // 2, (rows, prompt), generator=generator)
    tokens = torch.randint(vocabulary // 8, vocabulary // 2, (rows, reply), generator=generator)
    prompt_mask, token_mask = torch.ones_like(prompt_ids, dtype=torch.bool), torch.ones_like(tokens, dtype=torch.bool)
    advantages = torch.randn(rows, 1, generator=generator)

    def loss(policy) -> torch.Tensor:
        log_probs = policy.evaluate(prompt_ids, prompt_mask, tokens, token_mask, with_value=False)["token_log_probs"]
        return -(log_probs * advantages).mean()

    update = bench.FrameworkUpdate(policy, loss)
    weights = sum(t.numel() * t.element_size() for t in (*policy.parameters(), *policy.buffers()))
    gc.collect()
    before = resident_bytes()
    peak, method = peak_of(update.step)
    policy.max_tokens_per_micro_batch = None  # the probe's row (128 tokens) may exceed this update's budget
    probe = activation_bytes_per_token(policy)
    return {
        "config": config_name,
        "lora_r": config.lora.r,
        "trained_parameters": sum(p.numel() for p in policy.parameters() if p.requires_grad),
        "vocabulary": vocabulary,
        "scored_tokens": estimate.scored,
        "estimate": {
            "weights": estimate.weights, "state": estimate.state, "activations": estimate.activations,
            "logits": estimate.logits, "sampling": estimate.sampling, "update": estimate.update,
            "per_token": estimate.per_token,
        },
        "weights_bytes": weights,
        "resident_before_load": loading,
        "resident_after_load": loaded,
        "resident_before": before,
        "peak": peak,
        "measured_update": peak - before,
        "probe_per_token": probe,
        "method": method,
    }


# ------------------------------------------------------------------ the table
def load_average() -> list[float]:
    """The machine's load average over 1, 5 and 15 minutes."""
    return [round(value, 2) for value in os.getloadavg()]


def run_configuration(args: argparse.Namespace, config_name: str) -> dict[str, Any]:
    """:func:`measure` of ``config_name`` in a fresh Python process (its result is the last line it prints)."""
    command = [sys.executable, str(Path(__file__).resolve()), "--one", config_name, *args.passed]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT)
    if done.returncode != 0:
        raise SystemExit(f"{config_name}: the measuring process failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def ratios(row: dict[str, Any]) -> dict[str, float]:
    """Estimate over measurement: the update alone, and the whole (weights + update)."""
    estimate = row["estimate"]
    return {
        "update": estimate["update"] / row["measured_update"],
        "whole": (estimate["weights"] + estimate["update"]) / (row["weights_bytes"] + row["measured_update"]),
    }


def print_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """The table: one configuration a line, MiB."""
    print(f"\nOne update of {args.batch_size} rows x ({args.prompt_tokens} prompt + {args.new_tokens} reply) tokens, "
          f"vocabulary {rows[0]['vocabulary']:,}, {args.threads} threads, MiB; {rows[0]['method']}")
    print(f"{'config':<8} {'state':>8} {'activ.':>8} {'logits':>8} {'estimate':>9} {'measured':>9} {'ratio':>6}  "
          f"{'weights est/held':>17} {'whole ratio':>11}  {'act/token est/probe':>20}")
    for row in rows:
        estimate, ratio = row["estimate"], ratios(row)
        print(f"{row['config']:<8} {estimate['state'] / MIB:>8,.0f} {estimate['activations'] / MIB:>8,.0f} "
              f"{estimate['logits'] / MIB:>8,.0f} {estimate['update'] / MIB:>9,.0f} {row['measured_update'] / MIB:>9,.0f} "
              f"{ratio['update']:>6.2f}  {estimate['weights'] / MIB:>8,.0f}/{row['weights_bytes'] / MIB:<8,.0f} "
              f"{ratio['whole']:>11.2f}  {estimate['per_token'] / MIB:>9.3f}/{row['probe_per_token'] / MIB:<10.3f}")
    verdicts = [f"{row['config']} {'within' if abs(ratios(row)['update'] - 1) <= TOLERANCE else 'NOT within'}" for row in rows]
    print(f"estimate of the update within {TOLERANCE:.0%} of the measured peak: {', '.join(verdicts)}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line; ``passed`` keeps the options to hand to each subprocess."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"a model folder or a .gguf file ({DEFAULT_MODEL})")
    parser.add_argument("--chat-template", default="gemma", help="chatml, llama3, gemma, plain or a Jinja file (gemma)")
    parser.add_argument("-B", "--batch-size", type=int, default=4, help="rows of the update (4)")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="prompt tokens a row (64)")
    parser.add_argument("-T", "--new-tokens", type=int, default=16, help="reply tokens a row (16)")
    parser.add_argument("--lora-r", type=int, default=16, help="rank of the LoRA adapters of the lora configuration (16)")
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS), help="what to measure (lora full)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the batch")
    parser.add_argument("--output", type=Path, default=None, help="also write the results as JSON here")
    parser.add_argument("--one", choices=CONFIGS, default=None, help=argparse.SUPPRESS)  # the subprocess's mode
    args = parser.parse_args(argv)
    for name in ("batch_size", "prompt_tokens", "new_tokens", "lora_r", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if not Path(args.model).expanduser().exists():
        parser.error(f"--model {args.model}: no such file or folder")
    args.passed = [
        "--model", args.model, "--chat-template", args.chat_template, "-B", str(args.batch_size),
        "--prompt-tokens", str(args.prompt_tokens), "-T", str(args.new_tokens), "--lora-r", str(args.lora_r),
        "--threads", str(args.threads), "--seed", str(args.seed),
    ]
    return args


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Measure each configuration in its own process; print the table; return (and optionally write) the rows."""
    args = parse_args(argv)
    if args.one is not None:
        print(json.dumps(measure(args, args.one)))
        return []
    start = load_average()
    print(f"{args.model} ({args.chat_template}); load average {start}", flush=True)
    rows = []
    for name in args.configs:
        rows.append(run_configuration(args, name))
        print(f"{name}: done; load average {load_average()}", flush=True)
    print_table(rows, args)
    end = load_average()
    print(f"load average at the start {start}, at the end {end}")
    if args.output is not None:
        args.output.write_text(json.dumps({"rows": rows, "ratios": [ratios(row) for row in rows],
                                           "load_average": {"start": start, "end": end},
                                           "settings": {k: v for k, v in vars(args).items() if k not in ("output", "passed", "one")}},
                                          indent=2))
    return rows


if __name__ == "__main__":
    set_script_environment()
    main()
