"""Language-model agents at a realistic shape: a 30M-parameter Qwen2 chat model, ~200-token prompts, 128-token replies.

``benchmark_lm.py`` and ``benchmark_lm_rollout.py`` measure the LM agents on
tiny models with a few dozen tokens. This script measures them on what a user
brings: a local chat-model folder, loaded only through the user path
(``pretrained_path``). By default it is a Qwen2-architecture model of 29.8M
parameters (hidden size 512, 8 blocks, 8 heads, MLP width 1408, tied
embeddings) with an 8,000-token byte-level BPE vocabulary and the Qwen2 chat
template, written once by the project's builder
(:func:`nip_like.lm.local_models.build_chat_model_folder`, random weights) into
a cache folder; ``--model-folder`` takes any other folder. The prompts are the
chat view of the duplicates game (``scenario.view=chat``) with lists of 28
cells in ``0 .. 63`` written with their indices (``list: 0=12 1=? ...``): about
200 tokens with the default system prompts. Replies have ``T = 128`` tokens at
most (with random weights nearly every reply uses all of them).

Four parts, each measured side by side in one run (``--parts``):

1. ``rollout``: the whole rollout of the chat view, i.e. TorchRL's collector
   stepping the duplicates environment, rendering every agent's prompt through
   its chat template and sampling with ``LMActor``, against a plain batched
   ``generate`` on the very prompts it built
   (:func:`benchmark_lm_rollout.run`; target: at most 1.05 times the time
   per token). Then ``LMPolicy.sample`` alone against ``generate`` on a batch
   of the same kind of prompts (:func:`benchmark_lm.measure_rollout`), which
   checks that both draw the same messages.
2. ``updates``: one GRPO and one DPO update of the framework against TRL's
   ``GRPOTrainer`` and ``DPOTrainer`` on the same model and batch
   (:func:`benchmark_lm.measure_updates`), with full fine-tuning and with LoRA
   adapters (``--lora-r``, peft's default targets for Qwen2: ``q_proj`` and
   ``v_proj``); TRL gets a copy of the same peft model, so both sides train the
   same adapters (target: TRL takes at least as long as the framework).
   With it, the activation bytes per token of each update, both sides
   (target: the framework's at most TRL's): the bytes that the loss
   computation of one step saves for the backward pass, counted with
   ``torch.autograd.graph.saved_tensors_hooks`` around the framework's loss
   function and TRL's ``compute_loss`` in the first step of each side (each
   storage once, the parameters left out; exact, whatever the allocator,
   :class:`benchmark_lm.SavedTensorBytes`), and the step's peak memory over
   what was allocated when it began, each over the step's real tokens
   (prompts and replies).
3. ``memory``: the peak memory of the framework's update with LoRA against
   full fine-tuning (from part 2; target: at most 0.5), and with and without
   a token budget (``--max-tokens-per-micro-batch``) as replies grow from 64
   to 512 tokens (``--reply-lengths``; target: flat with the budget). Each
   peak is :class:`benchmark_lm.MemoryProbe`'s: the tensor memory allocated
   during one step over what was allocated when it began. The memory held
   between steps (weights and optimiser state) and the bytes saved for the
   backward pass per token are reported beside it.

4. ``decoding``: ``LMPolicy.sample`` on each decoding path
   (:mod:`nip_like.lm.static_decoding`: eager, static and, on CUDA or with
   ``--decoding-modes``, compiled) against ``generate``, on one batch of
   chat prompts, sampling with the folder's weights or a bfloat16 copy
   (``--sampling-dtype``; ``generate`` gets the same): tokens per second,
   the time of a step (a forward pass after the prompt's), the bytes a step
   reads (the weights, each once; with the KV cache, plus the slots attended
   to) and their share of the memory-bandwidth limit, a device-to-device
   copy measured in the same run (``--copy-mib``), the speed-up over
   ``generate`` and whether greedy messages equal the eager path's
   (:func:`measure_decoding`; targets on CUDA for the compiled path: at
   least 0.25 of the limit and 5 times ``generate``).

Every part runs on the CPU (the default) or on CUDA (``--device cuda``): the
models, prompts and batches are put on the device, and the peaks are then
``torch.cuda.max_memory_allocated``'s.

The load average (``os.getloadavg``) is recorded at the start and the end of
each part, since the machine may be shared.

Run it from the repository root (TRL is the ``bench`` extra)::

    python scripts/benchmark_lm_chat.py --threads 1 --output lm_chat.json   # 23 minutes on 2 busy cores
    python scripts/benchmark_lm_chat.py --parts memory --threads 1
    python scripts/benchmark_lm_chat.py --model-folder models/my-qwen --lora-r 8
    python scripts/benchmark_lm_chat.py --smoke                         # a tiny model, seconds
    python scripts/benchmark_lm_chat.py --device cuda --model-folder models/qwen2-398m --parts updates memory
    python scripts/benchmark_lm_chat.py --device cuda --model-folder models/qwen2-398m --parts decoding --sampling-dtype bfloat16
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "scripts")]

from lm_benchmark_env import SCRIPT_ENVIRONMENT, set_script_environment  # noqa: E402

if __name__ == "__main__":
    set_script_environment()

import torch  # noqa: E402
import transformers  # noqa: E402

import benchmark_lm as bench  # noqa: E402
import benchmark_lm_rollout as rollout_bench  # noqa: E402
from nip_like.lm.local_models import build_chat_model_folder  # noqa: E402
from nip_like.lm.lora import LoraOptions  # noqa: E402
from nip_like.lm.models import LMAgentConfig, build_lm_policy  # noqa: E402
from nip_like.lm.padding import position_ids  # noqa: E402
from nip_like.lm.policy import LMPolicy  # noqa: E402
from nip_like.lm.sampling_copy import SAMPLING_DTYPES, sampling_model  # noqa: E402
from nip_like.lm.static_decoding import Decoder  # noqa: E402
from nip_like.scenarios.duplicates.chat_text import SYSTEM_PROMPTS, list_line
from nip_like.scenarios.chat_prompts import ChatSpeaker

#: Model shapes ``--build`` writes (Qwen2 architecture, tied embeddings): the benchmark's and a tiny one for tests.
SHAPES: dict[str, dict[str, int]] = {
    "qwen2-30m": {"vocab_size": 8000, "hidden_size": 512, "num_layers": 8, "num_heads": 8, "intermediate_size": 1408},
    "qwen2-tiny": {"vocab_size": 1000, "hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64},
}
#: Largest acceptable ratio of time per token, whole chat-view rollout over the plain generate loop.
TARGET_ROLLOUT_RATIO = 1.05
#: Largest acceptable ratio of peak update memory, LoRA over full fine-tuning.
TARGET_LORA_MEMORY_RATIO = 0.5
#: Smallest acceptable share of the memory-bandwidth limit of the compiled decoding step (on CUDA; issue 40).
TARGET_BANDWIDTH_SHARE = 0.25
#: Smallest acceptable speed-up of the compiled decoding over ``generate`` (tokens per second; on CUDA; issue 40).
TARGET_DECODING_SPEEDUP = 5.0
#: The parts of the benchmark, in the order they run.
PARTS = ("rollout", "updates", "memory", "decoding")
#: The game of the whole rollout: the prover speaks, the verifier answers, one episode per environment.
GAME_OVERRIDES = (
    "scenario=duplicates",
    "scenario.view=chat",
    "scenario.list_format=indexed",
    "protocol=nip",
    "protocol.first_speaker=prover",
    "protocol.max_rounds=2",
)
#: What ``--smoke`` sets: a tiny model and batch, one repeat of everything.
SMOKE = {
    "build": "qwen2-tiny",
    "batch_size": 4,
    "group_size": 2,
    "new_tokens": 8,
    "list_length": 6,
    "num_values": 12,
    "reply_lengths": [4, 8, 16],
    "max_tokens_per_micro_batch": 128,
    "lora_r": 4,
    "rollout_repeats": 2,
    "sample_repeats": 1,
    "update_steps": 1,
    "warmup": 1,
    "threads": 1,
    "copy_mib": 16,
}
MIB = 2**20


# ------------------------------------------------------------------ the model and the prompts
def model_folder(args: argparse.Namespace) -> Path:
    """``--model-folder``, or the cached folder of the ``--build`` shape (built by the project's builder if absent)."""
    if args.model_folder is not None:
        return Path(args.model_folder).expanduser()
    folder = Path(args.cache_dir).expanduser() / f"{args.build}-seed{args.seed}"
    if not (folder / "model.safetensors").is_file():
        print(f"building {args.build} into {folder}", flush=True)
        build_chat_model_folder(folder, "qwen2", seed=args.seed, **SHAPES[args.build])
    return folder


def load_policy(
    folder: Path,
    new_tokens: int,
    lora_r: int = 0,
    budget: int | None = None,
    gradient_checkpointing: bool = False,
    score_chunk_tokens: int | None = None,
    decoding: str = "auto",
    sampling_dtype: str = "model",
    chat_template: str | None = None,
) -> LMPolicy:
    """The policy of the model folder (or GGUF file) through the user path (``pretrained_path``), as an agent config builds it."""
    config = LMAgentConfig(
        pretrained_path=str(folder),
        chat_template=chat_template,
        max_new_tokens=new_tokens,
        value_head=False,
        lora=LoraOptions(r=lora_r),
        max_tokens_per_micro_batch=budget,
        gradient_checkpointing=gradient_checkpointing,
        score_chunk_tokens=score_chunk_tokens,
        decoding=decoding,
        sampling_dtype=sampling_dtype,
    )
    return build_lm_policy(config)


def chat_prompts(tokenizer, args: argparse.Namespace, device: torch.device) -> bench.Prompts:
    """``B`` prover prompts of the chat view in groups of ``G`` equal ones, left-padded.

    Each group's prompt is what the chat view shows the prover at its first
    turn (:class:`~nip_like.scenarios.chat_prompts.ChatSpeaker`): the
    tokenizer's chat template over the prover's system prompt and the
    ``list:`` line of a random list of ``--list-length`` cells in
    ``0 .. --num-values - 1``, written with their indices.
    """
    rng = random.Random(args.seed)
    speaker = ChatSpeaker("prover", tokenizer, SYSTEM_PROMPTS["accept"])
    rows = []
    for _ in range(args.batch_size // args.group_size):
        values = [rng.randrange(args.num_values) for _ in range(args.list_length)]
        rows += [speaker.render(list_line(values, [True] * len(values), list_format="indexed"), [])] * args.group_size
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), speaker.pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for index, row in enumerate(rows):
        ids[index, width - len(row) :] = torch.tensor(row)
        mask[index, width - len(row) :] = True
    return bench.Prompts(ids.to(device), mask.to(device))


def parameter_count(policy: LMPolicy) -> tuple[int, int]:
    """All parameters of the policy's model, and those that train."""
    parameters = list(policy.model.parameters())
    return sum(p.numel() for p in parameters), sum(p.numel() for p in parameters if p.requires_grad)


def load_average() -> list[float]:
    """The 1-, 5- and 15-minute load averages of the machine."""
    return [round(value, 2) for value in os.getloadavg()]


def timed_part(name: str, results: dict[str, Any], measure: Callable[[], dict[str, Any]]) -> None:
    """Run one part, storing its results with its wall time and the load average before and after."""
    before, started = load_average(), time.perf_counter()
    print(f"\n=== {name} (load average {before[0]:.2f})", flush=True)
    results[name] = {**measure(), "wall_seconds": time.perf_counter() - started, "load_average": [before, load_average()]}


# ------------------------------------------------------------------ part 1: the rollout
def measure_whole_rollout(folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The chat view's collection against the plain ``generate`` replay (see :mod:`benchmark_lm_rollout`)."""
    overrides = [
        *GAME_OVERRIDES,
        f"scenario.default_agent.pretrained_path={folder}",
        *([f"scenario.default_agent.chat_template={args.chat_template}"] if args.chat_template else []),
        f"scenario.default_agent.max_new_tokens={args.new_tokens}",
        f"scenario.length={args.list_length}",
        f"scenario.num_values={args.num_values}",
        f"scenario.num_lists={max(200, 20 * args.batch_size)}",
        f"scenario.cache_dir={Path(args.cache_dir).expanduser() / 'datasets'}",
        f"trainer.num_envs={args.batch_size}",
        # One episode per environment and batch: the prover's turn, then the verifier's.
        f"trainer.frames_per_batch={2 * args.batch_size}",
        f"trainer.minibatch_size={2 * args.batch_size}",
    ]
    rollout_args = argparse.Namespace(
        preset="none",
        device=args.device,
        num_threads=args.threads,
        warmup=args.warmup,
        repeats=args.rollout_repeats,
        seed=args.seed,
        overrides=overrides,
    )
    result = rollout_bench.run(rollout_args)
    # This benchmark's target (the tiny model's script has its own), before the table that states it.
    result.update(target_ratio=TARGET_ROLLOUT_RATIO, meets_target=result["ratio"] <= TARGET_ROLLOUT_RATIO)
    rollout_bench.print_result(result)
    return result


def measure_sampling(folder: Path, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """``LMPolicy.sample`` against ``generate`` on one batch of chat prompts (see :func:`benchmark_lm.measure_rollout`)."""
    policy = load_policy(folder, args.new_tokens, chat_template=args.chat_template).to(device)
    prompts = chat_prompts(policy.tokenizer, args, device)
    sample_args = argparse.Namespace(warmup=args.warmup, repeats=args.sample_repeats, seed=args.seed)
    result = bench.measure_rollout(policy, prompts, sample_args)
    result.update(target_ratio=TARGET_ROLLOUT_RATIO, meets_target=result["ratio"] <= TARGET_ROLLOUT_RATIO)
    bench.print_rollout(result, sample_args)
    return result


# ------------------------------------------------------------------ part 2: the updates
def update_arguments(args: argparse.Namespace, new_tokens: int) -> argparse.Namespace:
    """The options :func:`benchmark_lm.measure_updates` reads."""
    return argparse.Namespace(
        batch_size=args.batch_size,
        group_size=args.group_size,
        new_tokens=new_tokens,
        warmup=args.warmup,
        update_steps=args.update_steps,
        seed=args.seed,
        device=args.device,
    )


def measure_all_updates(folder: Path, args: argparse.Namespace, device: torch.device, with_trl: bool) -> dict[str, Any]:
    """GRPO and DPO updates, framework against TRL, with full fine-tuning and with LoRA."""
    update_args = update_arguments(args, args.new_tokens)
    results: dict[str, Any] = {}
    for name, lora_r in (("full", 0), ("lora", args.lora_r)):
        policy = load_policy(
            folder,
            args.new_tokens,
            lora_r,
            budget=args.update_token_budget,
            gradient_checkpointing=args.gradient_checkpointing,
            score_chunk_tokens=args.score_chunk_tokens,
            chat_template=args.chat_template,
        ).to(device)
        total, trained = parameter_count(policy)
        print(f"\n{name}: {trained:,} of {total:,} parameters train", flush=True)
        prompts = chat_prompts(policy.tokenizer, args, device)
        updates = bench.measure_updates(policy, prompts, update_args, with_trl, pretokenized=True)
        bench.print_updates(updates, update_args)
        results[name] = {"trained_parameters": trained, "updates": updates}
    return results


# ------------------------------------------------------------------ part 3: memory
def held_bytes(update: bench.FrameworkUpdate) -> int:
    """Tensor memory held between steps: the model's parameters and buffers and the optimiser's state."""
    model = update.policy.model
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [value for state in update.optimizer.state.values() for value in state.values() if torch.is_tensor(value)]
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def truncated(batch: bench.GroupBatch, length: int) -> bench.GroupBatch:
    """The batch with every message cut to its first ``length`` tokens (a sample of the shorter length)."""
    return bench.GroupBatch(
        batch.prompts,
        batch.tokens[:, :length],
        batch.token_mask[:, :length],
        batch.sample_log_probs[:, :length],
        batch.rewards,
        batch.advantages,
        batch.group_size,
    )


def probe_update(policy: LMPolicy, batch: bench.GroupBatch, steps: int) -> dict[str, Any]:
    """``steps`` timed GRPO steps of a copy of ``policy``, then one probed step: times, peak and held memory."""
    update = bench.FrameworkUpdate(bench.clone_policy(policy), lambda trained: bench.grpo_loss(trained, batch))
    device = policy.banned.device
    seconds = [bench.timed_call(update.step, device)[0] for _ in range(steps)]
    saved = update.count_next_step()
    peak = bench.probed_step(update)
    tokens = bench.real_tokens(batch.prompts, batch.token_mask)[0]
    return {"seconds": seconds, "median_seconds": statistics.median(seconds), "peak_bytes": peak,
            "held_bytes": held_bytes(update), "tokens": tokens, "saved_bytes": saved.bytes,
            "saved_bytes_per_token": saved.bytes / tokens}


def measure_memory(folder: Path, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Peak memory of a GRPO update with LoRA, with and without the token budget, as replies grow.

    The messages are sampled once at the longest reply length and cut to
    each shorter one. Each configuration makes one timed step (the first,
    which also creates the adapters' small optimiser state) and one probed
    step. With the budget, the policy scores rows in micro-batches of at most
    ``--max-tokens-per-micro-batch`` padded tokens, recomputing each one's
    activations in the backward pass.
    """
    longest = max(args.reply_lengths)
    policy = load_policy(folder, longest, args.lora_r, chat_template=args.chat_template).to(device)
    prompts = chat_prompts(policy.tokenizer, args, device)
    batch = bench.make_group_batch(policy, prompts, args.group_size, args.seed + 3)
    rows = []
    print(f"{'reply tokens':>12} {'budget':>7} {'step s':>8} {'peak MiB':>9} {'held MiB':>9} {'saved B/tok':>11}")
    for length in args.reply_lengths:
        for budget in (None, args.max_tokens_per_micro_batch):
            policy.max_tokens_per_micro_batch = budget
            row = {"reply_tokens": length, "budget": budget, **probe_update(policy, truncated(batch, length), 1)}
            rows.append(row)
            print(f"{length:>12} {budget or '-':>7} {row['median_seconds']:>8.2f} {row['peak_bytes'] / MIB:>9.1f} "
                  f"{row['held_bytes'] / MIB:>9.1f} {row['saved_bytes_per_token']:>11,.0f}", flush=True)
    growth = {}
    for budget in (None, args.max_tokens_per_micro_batch):
        peaks = [row["peak_bytes"] for row in rows if row["budget"] == budget]
        growth["with_budget" if budget else "without_budget"] = peaks[-1] / peaks[0]
    for name, value in growth.items():
        print(f"peak at {longest} reply tokens over peak at {min(args.reply_lengths)}, {name.replace('_', ' ')}: "
              f"{value:.2f}")
    return {"rows": rows, "growth": growth, "lora_r": args.lora_r, "budget": args.max_tokens_per_micro_batch}


def held_between_steps(base_parameters: int, trained_parameters: int, lora: bool) -> int:
    """Bytes of float32 weights (the base model's, plus the adapters with LoRA) and AdamW's two moments."""
    weights = base_parameters + (trained_parameters if lora else 0)
    return 4 * (weights + 2 * trained_parameters)


def lora_memory_ratios(results: dict[str, Any]) -> dict[str, Any]:
    """Memory of an update with LoRA over full fine-tuning, per objective, from the updates part.

    ``nip_like`` and ``trl``: the ratio of the step's peaks (each
    :class:`benchmark_lm.MemoryProbe`'s, over what was allocated when the step
    began). ``nip_like_with_held``: the same with the memory held between
    steps added on each side (:func:`held_between_steps`), i.e. the peak of
    all the tensor memory of training.
    """
    updates, base = results["updates"], results["model"]["parameters"]
    held = {name: held_between_steps(base, updates[name]["trained_parameters"], name == "lora") for name in ("full", "lora")}
    ratios: dict[str, Any] = {}
    for objective in ("GRPO", "DPO"):
        full, lora = updates["full"]["updates"][objective], updates["lora"]["updates"][objective]
        peaks = {"full": full["nip_like"]["peak_bytes"], "lora": lora["nip_like"]["peak_bytes"]}
        row = {
            "nip_like": peaks["lora"] / peaks["full"],
            "nip_like_with_held": (peaks["lora"] + held["lora"]) / (peaks["full"] + held["full"]),
            "held_bytes": held,
        }
        if "trl" in full:
            row["trl"] = lora["trl"]["peak_bytes"] / full["trl"]["peak_bytes"]
        ratios[objective] = row
    return ratios


def activation_table(results: dict[str, Any]) -> dict[str, Any]:
    """Activation bytes per token of each update of the updates part, by setting and objective; printed as a table.

    Each entry is :func:`benchmark_lm.activation_bytes_per_token`'s:
    ``nip_like`` and ``trl``, the bytes that the loss computation of one step
    saves for the backward pass per real token of the step (parameters left
    out), and their ``ratio``; ``peak``, the same from the step's peak memory
    over what was allocated when it began.
    """
    table = {name: {objective: bench.activation_bytes_per_token(sides, sides["nip_like"]["tokens"])
                    for objective, sides in results["updates"][name]["updates"].items()}
             for name in ("full", "lora")}
    print("\nActivation bytes per token of the update (per real token of the step: saved = kept for the backward "
          "pass by the loss computation, parameters left out; peak = the step's peak over what it began with)")
    print(f"{'setting, objective':<20} {'tokens':>7} {'nip_like saved':>14} {'TRL saved':>10} {'ratio':>6} "
          f"{'nip_like peak':>13} {'TRL peak':>10} {'ratio':>6}")

    def text(row: dict[str, Any], key: str, width: int, form: str) -> str:
        return f"{row[key]:>{width}{form}}" if key in row else f"{'-':>{width}}"

    for name, objectives in table.items():
        for objective, row in objectives.items():
            print(f"{name + ', ' + objective:<20} {row['tokens']:>7,} {text(row, 'nip_like', 14, ',.0f')} "
                  f"{text(row, 'trl', 10, ',.0f')} {text(row, 'ratio', 6, '.3f')} "
                  f"{text(row['peak'], 'nip_like', 13, ',.0f')} {text(row['peak'], 'trl', 10, ',.0f')} "
                  f"{text(row['peak'], 'ratio', 6, '.3f')}")
    return table


# ------------------------------------------------------------------ part 4: decoding
def copy_bandwidth(device: torch.device, size: int, repeats: int = 10) -> dict[str, Any]:
    """The device's memory bandwidth as a device-to-device copy reaches it: ``2 x size`` bytes moved over the median time.

    A copy reads ``size`` bytes and writes as many; what a decoding step
    needs is mostly reads, and a copy is the fastest a kernel can stream
    memory in practice, so it is the limit the steps are compared with.
    """
    source = torch.ones(size // 4, dtype=torch.float32, device=device)
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    seconds = [bench.timed_call(lambda: target.copy_(source), device)[0] for _ in range(repeats)]
    median = statistics.median(seconds)
    return {"bytes": source.numel() * 4, "median_seconds": median, "bytes_per_second": 2 * source.numel() * 4 / median}


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters, each storage once (tied embeddings count once): what a forward pass reads."""
    storages: dict[tuple, int] = {}
    for parameter in model.parameters():
        storage = parameter.untyped_storage()
        storages[(parameter.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


def kv_bytes_per_slot(model: torch.nn.Module, element_bytes: int) -> int:
    """Bytes of one token's keys and values over all layers (what attention reads per slot and row)."""
    config = model.config.get_text_config()
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * element_bytes


def decoding_modes(args: argparse.Namespace, device: torch.device) -> list[str]:
    """``--decoding-modes``, or eager, static and compiled on CUDA, eager and static on the CPU."""
    if args.decoding_modes:
        return list(args.decoding_modes)
    return ["eager", "static", "compiled"] if device.type == "cuda" else ["eager", "static"]


def measure_decoding(folder: Path, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """``LMPolicy.sample`` on each decoding path against ``generate``: tokens/s, step time, share of the bandwidth limit.

    One policy (``--sampling-dtype``: its own weights, or its bfloat16 copy,
    which ``generate`` then uses as well), one batch of chat prompts; per
    side ``--warmup`` untimed calls (the compiled path compiles in the first,
    whose time is reported) then ``--sample-repeats`` timed ones, sampling
    with a seeded generator. A side's *step* is one forward pass after the
    prompt's: the median call time less the prompt's pass (timed on its own,
    eager) over the passes after it. Bytes read per step: the weights, each
    once; with the KV cache, plus the slots attended to (the static cache's
    capacity on the static paths, the mean context on the others). The
    share of the limit is those bytes per second over the device-to-device
    copy bandwidth measured in the same run. Greedy messages of each path
    are compared with eager's.
    """
    policy = load_policy(folder, args.new_tokens, decoding="eager", sampling_dtype=args.sampling_dtype, chat_template=args.chat_template).to(device)
    policy.eval()
    prompts = chat_prompts(policy.tokenizer, args, device)
    model = sampling_model(policy.model, args.sampling_dtype)
    weights = weight_bytes(model)
    element = next(model.parameters()).element_size()
    per_slot = kv_bytes_per_slot(model, element)
    batch_size = prompts.ids.shape[0]
    width = int(prompts.mask.any(0).sum())  # the trimmed prompt: padding columns of every row go
    limit = copy_bandwidth(device, args.copy_mib * MIB)

    last_logits = {"logits_to_keep": 1} if policy._keeps_logits else {}

    @torch.no_grad()
    def prefill() -> None:
        model(input_ids=prompts.ids, attention_mask=prompts.mask.long(), position_ids=position_ids(prompts.mask),
              use_cache=True, **last_logits)

    prefill()
    prefill_seconds = statistics.median(bench.timed_call(prefill, device)[0] for _ in range(3))
    options = bench.generate_options(policy)

    def sample(mode: str) -> Callable[[], tuple[torch.Tensor, int, int]]:
        def call() -> tuple[torch.Tensor, int, int]:
            policy.decoder = decoders[mode]
            messages = policy.sample(prompts.ids, prompts.mask, bench.seeded_generator(args.seed, device))
            return messages["tokens"], decoders[mode].last_passes, decoders[mode].last_capacity
        return call

    @torch.no_grad()
    def generate() -> tuple[torch.Tensor, int, int]:
        torch.manual_seed(args.seed)
        output = model.generate(input_ids=prompts.ids, attention_mask=prompts.mask.long(), **options)
        new = output[:, prompts.ids.shape[1]:]
        return new, new.shape[1], 0

    modes = decoding_modes(args, device)
    decoders = {mode: Decoder(mode, args.sampling_dtype) for mode in modes}
    sides: dict[str, Callable[[], tuple[torch.Tensor, int, int]]] = {mode: sample(mode) for mode in modes}
    sides["generate"] = generate
    runs: dict[str, dict[str, Any]] = {name: {"seconds": [], "tokens": [], "passes": [], "slots": []} for name in sides}
    for name, call in sides.items():
        for index in range(args.warmup):
            seconds = bench.timed_call(call, device)[0]
            if index == 0:
                runs[name]["first_call_seconds"] = seconds
    for repeat in range(args.sample_repeats):
        for name in (list(sides) if repeat % 2 == 0 else list(reversed(sides))):
            seconds, _, (tokens, passes, slots) = bench.timed_call(sides[name], device)
            runs[name]["seconds"].append(seconds)
            runs[name]["tokens"].append(int(bench.message_lengths(tokens, policy.eos_token_id).sum()))
            runs[name]["passes"].append(passes)
            runs[name]["slots"].append(slots)
    for mode in modes:
        runs[mode]["path"] = decoders[mode].last_path
    result: dict[str, Any] = {"modes": modes, "sampling_dtype": args.sampling_dtype, "weight_bytes": weights,
                              "kv_bytes_per_slot": per_slot, "batch_size": batch_size, "prompt_width": width,
                              "prefill_seconds": prefill_seconds, "copy": limit, "sides": runs}
    for name, run in runs.items():
        per_token = statistics.median(s / n for s, n in zip(run["seconds"], run["tokens"]))
        median = statistics.median(run["seconds"])
        passes = statistics.median(run["passes"])
        step = max(median - prefill_seconds, 1e-9) / max(passes - 1, 1)
        slots = statistics.median(run["slots"]) or width + passes / 2  # the eager caches grow: their mean context
        step_bytes = weights + batch_size * slots * per_slot
        run.update(
            median_seconds=median,
            tokens_per_second=1 / per_token,
            step_seconds=step,
            step_bytes=step_bytes,
            bandwidth_share=step_bytes / step / limit["bytes_per_second"],
            weights_bandwidth_share=weights / step / limit["bytes_per_second"],
        )
    for name, run in runs.items():
        run["speedup_over_generate"] = run["tokens_per_second"] / runs["generate"]["tokens_per_second"]
    greedy = {}
    for mode in modes:
        policy.decoder = decoders[mode]
        greedy[mode] = policy.sample(prompts.ids, prompts.mask, greedy=True)["tokens"]
    result["same_greedy_messages"] = {mode: bool(torch.equal(greedy[mode], greedy["eager"])) for mode in modes if mode != "eager"}
    result["greedy_rows_equal"] = {mode: float((greedy[mode] == greedy["eager"]).all(-1).float().mean())
                                   for mode in modes if mode != "eager"}
    fastest = "compiled" if "compiled" in modes else modes[-1]
    result["fastest_mode"] = fastest
    result["targets_apply"] = device.type == "cuda" and fastest == "compiled"
    result["meets_targets"] = (runs[fastest]["weights_bandwidth_share"] >= TARGET_BANDWIDTH_SHARE
                               and runs[fastest]["speedup_over_generate"] >= TARGET_DECODING_SPEEDUP)
    print_decoding(result, args)
    return result


def print_decoding(result: dict[str, Any], args: argparse.Namespace) -> None:
    """The decoding table."""
    copy = result["copy"]
    print(f"\nDecoding (B={result['batch_size']}, prompt {result['prompt_width']} tokens, T={args.new_tokens}, "
          f"weights {result['weight_bytes'] / MIB:,.1f} MiB ({result['sampling_dtype']}), KV "
          f"{result['kv_bytes_per_slot'] / 1024:,.1f} KiB a slot; copy bandwidth "
          f"{copy['bytes_per_second'] / 1e9:,.1f} GB/s; prompt pass {result['prefill_seconds'] * 1e3:.2f} ms; "
          f"median of {args.sample_repeats} calls after {args.warmup} warm-up)")
    print(f"{'side':<10} {'path':<9} {'tokens/s':>10} {'step ms':>8} {'GB/step':>8} {'share':>6} {'weights':>7} "
          f"{'x gen':>6} {'1st call s':>10}")
    for name, run in result["sides"].items():
        first = run.get("first_call_seconds")
        print(f"{name:<10} {run.get('path', '-'):<9} {run['tokens_per_second']:>10,.0f} {run['step_seconds'] * 1e3:>8.3f} "
              f"{run['step_bytes'] / 1e9:>8.3f} {run['bandwidth_share']:>6.3f} {run['weights_bandwidth_share']:>7.3f} "
              f"{run['speedup_over_generate']:>6.2f} {first if first is not None else float('nan'):>10.2f}")
    equal = ", ".join(f"{mode} {value}" for mode, value in result["same_greedy_messages"].items())
    verdict = ("met" if result["meets_targets"] else "MISSED") if result["targets_apply"] else "apply to compiled on CUDA only"
    print(f"greedy messages equal to eager's: {equal}; targets (weights share >= {TARGET_BANDWIDTH_SHARE}, "
          f">= {TARGET_DECODING_SPEEDUP:g}x generate): {verdict}")


# ------------------------------------------------------------------ the summary
def summary(results: dict[str, Any]) -> dict[str, Any]:
    """The ratios the benchmark reports, with their targets."""
    figures: dict[str, Any] = {}
    if "rollout" in results:
        whole = results["rollout"]["whole"]
        figures["rollout_ratio"] = {"value": whole["ratio"], "target": f"<= {TARGET_ROLLOUT_RATIO}",
                                    "met": whole["meets_target"]}
        figures["sample_ratio"] = {"value": results["rollout"]["sample"]["ratio"],
                                   "same_messages": results["rollout"]["sample"]["same_messages"]}
    if "updates" in results:
        for name in ("full", "lora"):
            for objective, sides in results["updates"][name]["updates"].items():
                if "trl_over_nip_like" in sides:
                    ratio = sides["trl_over_nip_like"]
                    figures[f"trl_over_nip_like_{objective}_{name}"] = {"value": ratio, "target": ">= 1",
                                                                        "met": ratio >= 1}
        for name, objectives in results["updates"]["activation_bytes_per_token"].items():
            for objective, row in objectives.items():
                for key, figures_of in (("activation_bytes_per_token", row), ("peak_bytes_per_token", row["peak"])):
                    if "ratio" in figures_of:
                        figures[f"{key}_{objective}_{name}"] = {
                            "value": figures_of["ratio"], "nip_like": figures_of["nip_like"],
                            "trl": figures_of["trl"], "target": "<= 1", "met": figures_of["ratio"] <= 1,
                        }
        for objective, row in results["updates"]["lora_memory"].items():
            for key in ("nip_like", "nip_like_with_held"):
                figures[f"lora_over_full_memory_{objective}" + key[len("nip_like"):]] = {
                    "value": row[key], "target": f"<= {TARGET_LORA_MEMORY_RATIO}",
                    "met": row[key] <= TARGET_LORA_MEMORY_RATIO,
                }
    if "memory" in results:
        for name, value in results["memory"]["growth"].items():
            figures[f"memory_growth_{name}"] = {"value": value}
    if "decoding" in results:
        decoding = results["decoding"]
        fastest = decoding["sides"][decoding["fastest_mode"]]
        for name, value, target in (
            ("decoding_weights_bandwidth_share", fastest["weights_bandwidth_share"], TARGET_BANDWIDTH_SHARE),
            ("decoding_speedup_over_generate", fastest["speedup_over_generate"], TARGET_DECODING_SPEEDUP),
        ):
            figure: dict[str, Any] = {"value": value, "mode": decoding["fastest_mode"]}
            if decoding["targets_apply"]:
                figure.update(target=f">= {target:g}", met=value >= target)
            figures[name] = figure
        for mode, share in decoding["greedy_rows_equal"].items():
            figures[f"decoding_greedy_rows_equal_{mode}"] = {"value": share}
    return figures


def print_summary(figures: dict[str, Any]) -> None:
    """One line per reported ratio."""
    print("\nSummary")
    for name, figure in figures.items():
        value = figure["value"]
        verdict = "" if "met" not in figure else f"  target {figure['target']}: {'met' if figure['met'] else 'MISSED'}"
        sides = f"  ({figure['nip_like']:,.0f} against {figure['trl']:,.0f} bytes)" if "trl" in figure else ""
        print(f"  {name:<40} {value:.3f}{verdict}{sides}")


# ------------------------------------------------------------------ main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line (``--smoke`` replaces the defaults of the sizes by tiny ones)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", "--model-folder", dest="model_folder", type=Path, default=None,
                        help="a chat-model folder or a .gguf file (default: build --build)")
    parser.add_argument("--chat-template", default=None,
                        help="the model's chat template: chatml, llama3, gemma, plain or a Jinja file (default: the folder's own)")
    parser.add_argument("--build", choices=sorted(SHAPES), default="qwen2-30m", help="shape built when no folder")
    parser.add_argument("--cache-dir", default="~/.cache/nip_like/benchmark", help="where built folders are kept")
    parser.add_argument("-B", "--batch-size", type=int, default=8, help="prompts per batch and environments (8)")
    parser.add_argument("-G", "--group-size", type=int, default=4, help="equal prompts per GRPO group (4)")
    parser.add_argument("-T", "--new-tokens", type=int, default=128, help="longest reply, in tokens (128)")
    parser.add_argument("--list-length", type=int, default=28, help="cells of a list; sets the prompt length (28)")
    parser.add_argument("--num-values", type=int, default=64, help="values are 0 .. this - 1 (64)")
    parser.add_argument("--lora-r", type=int, default=16, help="rank of the LoRA adapters (16)")
    parser.add_argument("--reply-lengths", type=int, nargs="+", default=[64, 128, 256, 512],
                        help="reply lengths of the memory part (64 128 256 512)")
    parser.add_argument("--max-tokens-per-micro-batch", type=int, default=1024,
                        help="token budget of the memory part (1024; at least prompt + longest reply)")
    parser.add_argument("--rollout-repeats", type=int, default=4, help="timed rounds of the whole rollout (4)")
    parser.add_argument("--sample-repeats", type=int, default=3, help="timed sample/generate calls per side (3)")
    parser.add_argument("--update-steps", type=int, default=3, help="timed update steps per side (3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed batches, calls or steps first (1)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (2)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model, prompts and samples")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="what to measure (all)")
    parser.add_argument("--skip-trl", action="store_true", help="leave out TRL's updates")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="the updates' policies recompute each block's activations in the backward pass (both sides)")
    parser.add_argument("--update-token-budget", type=int, default=None,
                        help="max_tokens_per_micro_batch of nip_like's updates in the updates part (none)")
    parser.add_argument("--score-chunk-tokens", type=int, default=None,
                        help="nip_like's updates score replies this many positions at a time (default: automatic, as an agent's "
                             "default; 0: all logits at once)")
    parser.add_argument("--decoding-modes", nargs="+", choices=("eager", "static", "compiled"), default=None,
                        help="decoding paths of the decoding part (default: eager static compiled on CUDA, eager static on the CPU)")
    parser.add_argument("--sampling-dtype", choices=SAMPLING_DTYPES, default="model",
                        help="weights the decoding part samples with, generate too (model: the folder's; bfloat16: a copy)")
    parser.add_argument("--copy-mib", type=int, default=256,
                        help="MiB copied to measure the device-to-device bandwidth in the decoding part (256)")
    parser.add_argument("--smoke", action="store_true", help="tiny model and sizes, one repeat (for tests)")
    parser.add_argument("--output", "--json", type=Path, default=None, help="also write the results as JSON here")
    args = bench.parse_with_smoke(
        parser, argv, SMOKE, ("batch_size", "new_tokens", "list_length", "lora_r", "rollout_repeats", "sample_repeats",
                              "update_steps", "warmup", "threads", "max_tokens_per_micro_batch", "copy_mib"),
    )
    if args.group_size < 2 or args.batch_size % args.group_size:
        parser.error("--group-size must be at least 2 and divide --batch-size")
    if args.list_length > args.num_values:
        parser.error("--list-length must be at most --num-values (lists without a duplicate must exist)")
    if min(args.reply_lengths) < 1:
        parser.error("--reply-lengths must be at least 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The measurements of :func:`main`."""
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    version = None if args.skip_trl else bench.trl_version()
    folder = model_folder(args)
    policy = load_policy(folder, args.new_tokens, chat_template=args.chat_template)
    prompts = chat_prompts(policy.tokenizer, args, torch.device("cpu"))
    lengths = prompts.mask.sum(-1)
    model = {"folder": str(folder), "model_type": policy.model.config.model_type,
             "parameters": parameter_count(policy)[0], "vocabulary": len(policy.tokenizer),
             "prompt_tokens": [int(lengths.min()), int(lengths.max())]}
    del policy
    print(f"{model['model_type']} from {folder}: {model['parameters']:,} parameters, vocabulary {model['vocabulary']}; "
          f"B={args.batch_size} (groups of {args.group_size}), prompts of {model['prompt_tokens'][0]} to "
          f"{model['prompt_tokens'][1]} tokens, replies of at most {args.new_tokens}; {device}, "
          f"{args.threads} threads; load average {load_average()}", flush=True)
    if version is None and not args.skip_trl:
        print("TRL is not installed (pip install -e '.[bench]'): its updates are left out")

    results: dict[str, Any] = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                               "model": model}
    if "rollout" in args.parts:
        timed_part("rollout", results, lambda: {"whole": measure_whole_rollout(folder, args),
                                                "sample": measure_sampling(folder, args, device)})
    if "updates" in args.parts:
        timed_part("updates", results, lambda: measure_all_updates(folder, args, device, version is not None))
        results["updates"]["lora_memory"] = lora_memory_ratios(results)
        results["updates"]["activation_bytes_per_token"] = activation_table(results)
    if "memory" in args.parts:
        timed_part("memory", results, lambda: measure_memory(folder, args, device))
    if "decoding" in args.parts:
        timed_part("decoding", results, lambda: measure_decoding(folder, args, device))
    results["summary"] = summary(results)
    print_summary(results["summary"])
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"\nprocess peak resident memory (getrusage): {peak_rss / MIB:.0f} MiB; load average {load_average()}")
    results.update(
        threads=torch.get_num_threads(),
        peak_rss_bytes=peak_rss,
        memory_method="torch.cuda.max_memory_allocated" if device.type == "cuda" else "torch.profiler memory events",
        environment={name: os.environ.get(name) for name in SCRIPT_ENVIRONMENT},
        versions={"python": platform.python_version(), "torch": torch.__version__,
                  "transformers": transformers.__version__, "trl": version},
        machine={"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                 "cpus": os.cpu_count()},
    )
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print the tables; return (and optionally write) the results.

    It sets ``torch.set_num_threads(--threads)`` and leaves it so; the
    warning filters and transformers' log level are restored on return.
    """
    args = parse_args(argv)
    # peft and transformers warn (UserWarning) about settings of the random model folder, once per load.
    results = bench.run_quietly(run, args, UserWarning)
    bench.write_results(results, args.output)
    return results


if __name__ == "__main__":
    main()
