"""Throughput of the language-model agents: sampling against ``generate``, updates against TRL.

Everything runs on one tiny Llama built from ``LMAgentConfig``'s default sizes
(hidden size 64, 2 layers, 4 heads, MLP width 128), randomly initialised,
with the word-level vocabulary of ``build_tokenizer`` over an alphabet like the
duplicates scenario's: value tokens ``v0`` to ``v15``, cell tokens ``c0`` to
``c7``, ``?``, ``|``, ``accept``, ``reject`` and the speaker tokens ``prover``
and ``verifier`` (34 tokens with the four special ones). Nothing is
downloaded. The batch is ``B`` prompts in groups of ``G`` equal prompts (GRPO's
groups), each up to ``P`` random alphabet tokens after ``<bos>``; prompt
lengths vary between ``P // 2`` and ``P``, so most rows are left-padded.

Three measurements:

1. **Rollout**: :meth:`LMPolicy.sample` (its own KV-cache loop) against a
   plain batched ``model.generate(do_sample=True, max_new_tokens=T,
   min_new_tokens=0)`` on the same model and prompts, with the same
   temperature, top-k and top-p, and ``suppress_tokens`` set to the tokens the
   policy bans (``<pad>``, ``<bos>``, ``<unk>``), so both sample from the same
   distribution. Both stop when every row has ended. Generated tokens are
   counted the same way on both sides: each row's tokens up to and including
   its first ``<eos>`` (all ``T`` if it has none). Seeds are fixed (the
   policy's ``torch.Generator`` and ``torch.manual_seed`` before
   ``generate``), so every repeat samples the same messages; on the CPU both
   sides draw the very same messages, which the script checks
   (``same_messages``). After ``--warmup`` untimed calls of each, ``--repeats``
   timed calls alternate which side goes first; the ratio is the median time
   per generated token of ``sample`` over that of ``generate`` (target: at most
   1.10).
2. **Update**: one optimiser step of a GRPO-style clipped token-level
   surrogate and one of DPO, on messages the policy sampled: the teacher-forced
   :meth:`LMPolicy.evaluate` forward pass, the loss
   (:func:`~nip_like.objectives.ppo.clipped_surrogate` averaged over each
   message's tokens and then over the batch; or
   :func:`~nip_like.objectives.dpo.preference_loss` on the summed
   log-probabilities of chosen and rejected messages, one forward pass over
   both), the backward pass, gradient clipping to norm 1 and a fused AdamW
   step (``nip_like.optimizers.fast_implementation``). This is the framework's LM
   scoring and objective functions driven by a few lines of loop, not a trainer
   iteration (``scripts/benchmark_lm_rollout.py`` times a whole rollout).
3. **The same update in TRL**: ``GRPOTrainer`` and ``DPOTrainer`` on a copy of
   the same initial model, with the same batch: GRPO gets the very messages
   through ``rollout_func`` (so TRL does not generate), and its rewards give
   the same group-normalised advantages; DPO gets the same prompts, chosen and
   rejected messages as text, and the script checks that TRL tokenizes them to
   the same ids. Both TRL configs use float32 without gradient checkpointing
   (TRL's defaults are bf16 autocast and gradient checkpointing), the fused
   AdamW, no weight decay, a constant learning rate of 1e-4, gradient clipping
   to norm 1, ``beta=0`` for GRPO (no reference model) and reference
   log-probabilities precomputed before training for DPO (the framework side
   computes them once too, untimed).

What is timed in an update: the framework side, from just before the forward
pass to just after the optimiser step. TRL, from its ``on_step_begin`` to its
``on_step_end`` callback (the whole ``training_step``, gradient clipping,
optimiser, scheduler, ``zero_grad`` and TRL's per-step bookkeeping; loading
the batch from the dataloader comes before and logging after, untimed); for
GRPO, minus the time of ``GRPOTrainer._prepare_inputs`` in that step (here:
the ``rollout_func`` call, reward and advantage computation, padding), which
the table also shows included. Tokens per second count the real tokens
(prompt and message, no padding) that the step trains on. Each side makes
``--warmup`` untimed steps, then ``--update-steps`` timed ones (median
reported), then one more step for the memory peak. With TRL, the two sides
alternate step by step (a framework step runs after each TRL step, outside
TRL's timed window), so that both see the same load from other processes.

Peak memory of an update step: on CUDA, ``torch.cuda.max_memory_allocated``
during the step minus what was allocated when it began. On the CPU, the
same quantity from PyTorch's allocator: the step runs under
``torch.profiler`` with ``profile_memory=True`` and the peak of the running
sum of its allocation and free events is taken. This counts tensor memory
only (not Python objects or libraries), is not disturbed by other processes,
and needs neither ``tracemalloc`` nor ``psutil``; the process's peak resident
memory (``resource.getrusage``) is reported once at the end, for scale.

Activation bytes per token of an update (``saved B/tok``): the bytes of the
tensors that the loss computation of one step saves for the backward pass,
over the step's real tokens. :class:`SavedTensorBytes` counts them with
``torch.autograd.graph.saved_tensors_hooks`` around the framework's loss
function and around TRL's ``compute_loss``, in the first (warm-up) step of
each side: each storage once, the parameters and buffers left out (a linear
layer saves its weight, which is held anyway). Unlike a peak, this is exact
and independent of the allocator and of other processes; on another device
it can differ only where other kernels save other tensors (attention, which
both sides share). ``activation_bytes_per_token`` in the results (with TRL)
holds both sides, their ratio, and the same ratio of the step peaks over
the real tokens; each side's ``saved_bytes`` are there in any case.

Run it from the repository root (TRL is the ``bench`` extra,
``pip install -e '.[bench]'``; without it the TRL rows are skipped)::

    python scripts/benchmark_lm.py                                   # defaults, about 20 s on 2 cores
    python scripts/benchmark_lm.py --batch-size 64 --prompt-length 32 --new-tokens 64
    python scripts/benchmark_lm.py --repeats 1 --update-steps 1 --warmup 1 --skip-trl   # smoke
    python scripts/benchmark_lm.py --output lm_benchmark.json       # also write the results as JSON
    python scripts/benchmark_lm.py --device cuda
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

# Use the nip_like of this checkout, whatever is installed, and the scripts beside this one.
REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "scripts")]

from lm_benchmark_env import SCRIPT_ENVIRONMENT, set_script_environment  # noqa: E402

if __name__ == "__main__":
    set_script_environment()

import torch  # noqa: E402
import transformers  # noqa: E402

from nip_like.checkpoint import write_text_atomic  # noqa: E402
from nip_like.lm import LMAgentConfig, LMPolicy, build_lm_policy, build_tokenizer  # noqa: E402
from nip_like.lm.tokenizer import SPECIAL_TOKENS  # noqa: E402
from nip_like.objectives.dpo import preference_loss  # noqa: E402
from nip_like.objectives.ppo import clipped_surrogate  # noqa: E402
from nip_like.optimizers import fast_implementation  # noqa: E402

#: The symbols of the benchmark's vocabulary, like the duplicates scenario's.
ALPHABET: tuple[str, ...] = (
    *(f"v{value}" for value in range(16)),
    *(f"c{cell}" for cell in range(8)),
    "?",
    "|",
    "accept",
    "reject",
    "prover",
    "verifier",
)
#: Largest acceptable ratio of sampling time per token, LMPolicy.sample / generate.
TARGET_ROLLOUT_RATIO = 1.10
LEARNING_RATE = 1e-4
MAX_GRAD_NORM = 1.0
CLIP_EPSILON = 0.2
DPO_BETA = 0.1
MIB = 2**20


# ------------------------------------------------------------------ the data
@dataclass
class Prompts:
    """A batch of prompts: ``(B, P)`` ids, left-padded, ``<bos>`` first, and their boolean mask."""

    ids: torch.Tensor
    mask: torch.Tensor


@dataclass
class GroupBatch:
    """What a GRPO update trains on: sampled messages with their log-probs and advantages."""

    prompts: Prompts
    tokens: torch.Tensor  # (B, T), <pad> after the message
    token_mask: torch.Tensor  # (B, T) bool
    sample_log_probs: torch.Tensor  # (B, T), the behaviour policy's
    rewards: torch.Tensor  # (B,)
    advantages: torch.Tensor  # (B,), normalised within each group
    group_size: int


@dataclass
class PreferenceBatch:
    """What a DPO update trains on: a chosen and a rejected message per prompt, with reference log-probs."""

    prompts: Prompts
    chosen: torch.Tensor  # (B, T + 1), every message ends with <eos>
    chosen_mask: torch.Tensor
    rejected: torch.Tensor
    rejected_mask: torch.Tensor
    reference_chosen: torch.Tensor  # (B,) summed log-probs under the initial policy
    reference_rejected: torch.Tensor


def parse_with_smoke(
    parser: argparse.ArgumentParser, argv: list[str] | None, smoke: dict[str, Any], positive: tuple[str, ...]
) -> argparse.Namespace:
    """Parse ``argv`` (default ``sys.argv[1:]``): with ``--smoke`` the ``smoke`` defaults first; each of ``positive`` at least 1."""
    if argv is None:
        argv = sys.argv[1:]
    if "--smoke" in argv:
        parser.set_defaults(**smoke)
    args = parser.parse_args(argv)
    for name in positive:
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def make_prompts(
    tokenizer, batch_size: int, prompt_length: int, group_size: int, seed: int, device: torch.device
) -> Prompts:
    """Random prompts in groups of ``group_size`` equal ones.

    Parameters
    ----------
    tokenizer : PreTrainedTokenizerBase
        From :func:`~nip_like.lm.tokenizer.build_tokenizer` (special tokens first).
    batch_size, prompt_length, group_size : int
        ``B``, ``P`` and ``G``; ``G`` divides ``B`` and ``P`` is at least 2.
    seed : int
        Seed of the prompts.
    device : torch.device
        Where the tensors go.

    Returns
    -------
    Prompts
        ``<bos>`` then random alphabet tokens, ``P // 2`` to ``P`` tokens in
        all (the first group exactly ``P``), left-padded with ``<pad>``.
    """
    generator = torch.Generator().manual_seed(seed)
    groups = batch_size // group_size
    lengths = torch.randint(max(2, prompt_length // 2), prompt_length + 1, (groups,), generator=generator)
    lengths[0] = prompt_length
    ids = torch.randint(len(SPECIAL_TOKENS), len(tokenizer), (groups, prompt_length), generator=generator)
    start = prompt_length - lengths
    mask = torch.arange(prompt_length).unsqueeze(0) >= start.unsqueeze(1)
    ids = ids.masked_fill(~mask, tokenizer.pad_token_id)
    ids[torch.arange(groups), start] = tokenizer.bos_token_id
    return Prompts(
        ids.repeat_interleave(group_size, dim=0).to(device), mask.repeat_interleave(group_size, dim=0).to(device)
    )


def message_lengths(tokens: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """Tokens of each message up to and including its first ``<eos>`` (all of them if none), ``(B,)``."""
    is_eos = tokens == eos_token_id
    first_eos = is_eos.int().argmax(dim=-1)
    return torch.where(is_eos.any(dim=-1), first_eos + 1, torch.full_like(first_eos, tokens.shape[-1]))


def ending_with_eos(tokens: torch.Tensor, mask: torch.Tensor, eos_token_id: int, pad_token_id: int):
    """Messages with one more column, ``<eos>`` put after each message cut at ``T`` without one.

    TRL's DPO appends ``<eos>`` to every completion that lacks it; doing it
    here gives both sides the same sequences.

    Returns
    -------
    tokens, mask : torch.Tensor
        ``(B, T + 1)``.
    """
    tokens = torch.cat([tokens, torch.full_like(tokens[:, :1], pad_token_id)], dim=-1)
    mask = torch.cat([mask, torch.zeros_like(mask[:, :1])], dim=-1)
    lengths = mask.sum(-1)
    unfinished = (tokens.gather(-1, (lengths - 1).unsqueeze(-1)).squeeze(-1) != eos_token_id).nonzero().flatten()
    tokens[unfinished, lengths[unfinished]] = eos_token_id
    mask[unfinished, lengths[unfinished]] = True
    return tokens, mask


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Rewards minus their group's mean, over the group's standard deviation plus 1e-4 (as TRL's GRPO)."""
    grouped = rewards.view(-1, group_size)
    advantages = (grouped - grouped.mean(-1, keepdim=True)) / (grouped.std(-1, keepdim=True) + 1e-4)
    return advantages.flatten()


def seeded_generator(seed: int, device: torch.device) -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded with ``seed``."""
    return torch.Generator(device=device).manual_seed(seed)


def make_group_batch(policy: LMPolicy, prompts: Prompts, group_size: int, seed: int) -> GroupBatch:
    """Sample one message per prompt and give each a random reward (standard normal) and its advantage."""
    message = policy.sample(prompts.ids, prompts.mask, generator=seeded_generator(seed, prompts.ids.device))
    rewards = torch.randn(prompts.ids.shape[0], generator=torch.Generator().manual_seed(seed)).to(prompts.ids.device)
    return GroupBatch(
        prompts,
        message["tokens"],
        message["token_mask"],
        message["token_log_probs"],
        rewards,
        group_advantages(rewards, group_size),
        group_size,
    )


@torch.no_grad()
def summed_log_probs(policy: LMPolicy, prompts: Prompts, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each message's log-probability under ``policy``, ``(B,)``, without gradients."""
    return policy.evaluate(prompts.ids, prompts.mask, tokens, mask, with_value=False)["token_log_probs"].sum(-1)


def make_preference_batch(policy: LMPolicy, prompts: Prompts, seed: int) -> PreferenceBatch:
    """Sample two messages per prompt (seeds ``seed`` and ``seed + 1``): the first is chosen, the second rejected."""
    pairs = []
    for offset in (0, 1):
        generator = seeded_generator(seed + offset, prompts.ids.device)
        message = policy.sample(prompts.ids, prompts.mask, generator=generator)
        tokens, mask = message["tokens"], message["token_mask"]
        pairs.append(ending_with_eos(tokens, mask, policy.eos_token_id, policy.pad_token_id))
    (chosen, chosen_mask), (rejected, rejected_mask) = pairs
    return PreferenceBatch(
        prompts,
        chosen,
        chosen_mask,
        rejected,
        rejected_mask,
        summed_log_probs(policy, prompts, chosen, chosen_mask),
        summed_log_probs(policy, prompts, rejected, rejected_mask),
    )


def real_tokens(prompts: Prompts, *masks: torch.Tensor) -> tuple[int, int]:
    """Real (unpadded) tokens of prompt plus messages, and of the messages alone, over the given message masks."""
    message = sum(int(mask.sum()) for mask in masks)
    return int(prompts.mask.sum()) * len(masks) + message, message


# ------------------------------------------------------------------ timing and memory
def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA), so that a timer sees it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_call(fn: Callable[[], Any], device: torch.device) -> tuple[float, float, Any]:
    """Wall seconds, process-CPU seconds and result of ``fn()``."""
    synchronize(device)
    started, cpu_started = time.perf_counter(), time.process_time()
    result = fn()
    synchronize(device)
    return time.perf_counter() - started, time.process_time() - cpu_started, result


@contextlib.contextmanager
def stderr_silenced() -> Iterator[None]:
    """Send file descriptor 2 to /dev/null inside the block (the profiler logs its start and stop there)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class MemoryProbe:
    """Peak tensor memory allocated between :meth:`start` and :meth:`stop`, over what was allocated at the start.

    Parameters
    ----------
    device : torch.device
        CUDA: ``torch.cuda.max_memory_allocated``. CPU: the allocation and
        free events that ``torch.profiler`` records with ``profile_memory=True``.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._profiler: torch.profiler.profile | None = None
        self._allocated_at_start = 0

    def start(self) -> None:
        """Begin watching."""
        synchronize(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._allocated_at_start = torch.cuda.memory_allocated(self.device)
        else:
            self._profiler = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
            )
            with stderr_silenced():
                self._profiler.start()

    def stop(self) -> int:
        """Stop watching; return the peak in bytes."""
        synchronize(self.device)
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) - self._allocated_at_start
        with stderr_silenced():
            self._profiler.stop()
        events = [event for event in self._profiler.profiler.kineto_results.events() if event.name() == "[memory]"]
        live = peak = 0
        for event in sorted(events, key=lambda event: event.start_ns()):
            live += event.nbytes()
            peak = max(peak, live)
        self._profiler = None
        return peak


class SavedTensorBytes:
    """Bytes of the tensors that autograd saves for the backward pass inside a ``with`` block, each storage once.

    ``torch.autograd.graph.saved_tensors_hooks`` is called with every tensor
    an operation saves for its backward pass. Each tensor's storage is counted
    once (by device and ``data_ptr``, at its whole size: a saved view keeps
    all of its storage), and only if the tensor is still saved when the block
    ends, i.e. held by the graph of what the block returns (a part of the
    graph dropped inside the block frees what it saved). Storages of the
    modules' parameters and buffers are counted apart (:attr:`parameter_bytes`):
    a linear layer saves its weight, which is held between steps anyway. This
    counts exactly, on any device, what the forward pass leaves for the
    backward pass; not the temporaries of the forward pass, nor what the
    backward pass allocates. Under activation checkpointing, a checkpoint's
    inputs are counted (it saves them) and what its region saves is not (the
    region's own hooks take it, and the backward pass recomputes it).

    Parameters
    ----------
    *modules : torch.nn.Module
        The modules whose parameters and buffers are not activations.
    """

    def __init__(self, *modules: torch.nn.Module) -> None:
        self._parameters = {
            self.key(tensor) for module in modules for tensor in (*module.parameters(), *module.buffers())
        }
        self._saved: list[tuple[tuple, int, weakref.ref]] = []
        self._hooks: Any = None
        #: Bytes of the storages saved and still held at the end of the block, parameters and buffers left out.
        self.bytes = 0
        #: Bytes of the parameters' and buffers' storages saved.
        self.parameter_bytes = 0

    @staticmethod
    def key(tensor: torch.Tensor) -> tuple:
        """What identifies a tensor's storage: its device and the address of its data."""
        return tensor.device, tensor.untyped_storage().data_ptr()

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        # The graph keeps a detached alias (same storage): kept as is, a saved output would hold its own grad_fn,
        # which holds it, a reference cycle that never frees it. The alias lives exactly as long as the graph's node.
        saved = tensor.detach()
        try:
            self._saved.append((self.key(saved), saved.untyped_storage().nbytes(), weakref.ref(saved)))
        except (RuntimeError, NotImplementedError, TypeError):  # a tensor without a plain storage
            pass
        return saved

    def __enter__(self) -> "SavedTensorBytes":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc_info) -> None:
        self._hooks.__exit__(*exc_info)
        storages: dict[tuple, int] = {}
        for key, nbytes, ref in self._saved:
            if ref() is not None:  # two live storages never share an address
                storages[key] = max(storages.get(key, 0), nbytes)
        self._saved.clear()
        self.bytes = sum(nbytes for key, nbytes in storages.items() if key not in self._parameters)
        self.parameter_bytes = sum(nbytes for key, nbytes in storages.items() if key in self._parameters)


def summarise(seconds: list[float], cpu_seconds: list[float], tokens: int, message_tokens: int) -> dict[str, Any]:
    """Median wall and CPU time of timed steps and the throughput at the median."""
    median = statistics.median(seconds)
    return {
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "median_seconds": median,
        "min_seconds": min(seconds),
        "max_seconds": max(seconds),
        "median_cpu_seconds": statistics.median(cpu_seconds),
        "tokens": tokens,
        "message_tokens": message_tokens,
        "tokens_per_second": tokens / median,
        "message_tokens_per_second": message_tokens / median,
    }


# ------------------------------------------------------------------ rollout
def generate_options(policy: LMPolicy) -> dict[str, Any]:
    """Keyword arguments of ``generate`` that sample from the policy's distribution, ``T`` tokens at most."""
    return {
        "do_sample": True,
        "max_new_tokens": policy.max_new_tokens,
        "min_new_tokens": 0,
        "temperature": policy.settings.temperature,
        "top_k": policy.settings.top_k,
        "top_p": policy.settings.top_p,
        "suppress_tokens": policy.banned.nonzero().flatten().tolist(),
        "pad_token_id": policy.pad_token_id,
        "eos_token_id": policy.eos_token_id,
    }


def sample_with_policy(policy: LMPolicy, prompts: Prompts, seed: int) -> torch.Tensor:
    """Messages drawn by :meth:`LMPolicy.sample`, ``(B, T)``."""
    return policy.sample(prompts.ids, prompts.mask, generator=seeded_generator(seed, prompts.ids.device))["tokens"]


def sample_with_generate(policy: LMPolicy, prompts: Prompts, seed: int, options: dict[str, Any]) -> torch.Tensor:
    """Messages drawn by ``model.generate``, ``(B, T')`` with ``T' <= T`` (it stops when every row has ended)."""
    torch.manual_seed(seed)
    output = policy.model.generate(input_ids=prompts.ids, attention_mask=prompts.mask.long(), **options)
    return output[:, prompts.ids.shape[1] :]


def messages_as_lists(tokens: torch.Tensor, eos_token_id: int) -> list[list[int]]:
    """Each row's tokens up to and including its first ``<eos>``."""
    lengths = message_lengths(tokens, eos_token_id).tolist()
    return [row[:length] for row, length in zip(tokens.tolist(), lengths)]


def measure_rollout(policy: LMPolicy, prompts: Prompts, args: argparse.Namespace) -> dict[str, Any]:
    """Time ``LMPolicy.sample`` against ``generate``; see the module docstring.

    Returns
    -------
    dict
        Per side (``"nip_like"``, ``"generate"``): the timed calls, tokens
        per call and tokens per second at the median time per token; the
        ratio of median times per token, whether it meets the target, and
        whether both sides drew the same messages.
    """
    policy.eval()
    options = generate_options(policy)
    sides: dict[str, Callable[[], torch.Tensor]] = {
        "nip_like": lambda: sample_with_policy(policy, prompts, args.seed),
        "generate": lambda: sample_with_generate(policy, prompts, args.seed, options),
    }
    for _ in range(args.warmup):
        for sample in sides.values():
            sample()
    messages = {name: messages_as_lists(sample(), policy.eos_token_id) for name, sample in sides.items()}
    runs: dict[str, dict[str, list]] = {name: {"seconds": [], "cpu_seconds": [], "tokens": []} for name in sides}
    for repeat in range(args.repeats):
        order = list(sides) if repeat % 2 == 0 else list(reversed(sides))
        for name in order:
            seconds, cpu_seconds, tokens = timed_call(sides[name], prompts.ids.device)
            runs[name]["seconds"].append(seconds)
            runs[name]["cpu_seconds"].append(cpu_seconds)
            runs[name]["tokens"].append(int(message_lengths(tokens, policy.eos_token_id).sum()))
    result: dict[str, Any] = {}
    for name, run in runs.items():
        per_token = statistics.median(s / n for s, n in zip(run["seconds"], run["tokens"]))
        result[name] = {
            **run,
            "median_seconds": statistics.median(run["seconds"]),
            "median_cpu_seconds": statistics.median(run["cpu_seconds"]),
            "median_seconds_per_token": per_token,
            "tokens_per_second": 1 / per_token,
        }
    ratio = result["nip_like"]["median_seconds_per_token"] / result["generate"]["median_seconds_per_token"]
    result.update(
        ratio=ratio,
        target_ratio=TARGET_ROLLOUT_RATIO,
        meets_target=ratio <= TARGET_ROLLOUT_RATIO,
        same_messages=messages["nip_like"] == messages["generate"],
    )
    return result


# ------------------------------------------------------------------ framework updates
def clone_policy(policy: LMPolicy) -> LMPolicy:
    """A policy with a deep copy of ``policy``'s model (adapters included), the same sampling settings, token budget and scoring chunks."""
    settings = policy.settings
    return LMPolicy(
        copy.deepcopy(policy.model),
        policy.tokenizer,
        max_new_tokens=policy.max_new_tokens,
        temperature=settings.temperature,
        top_k=settings.top_k,
        top_p=settings.top_p,
        max_tokens_per_micro_batch=policy.max_tokens_per_micro_batch,
        score_chunk_tokens=policy.score_chunk_tokens,
    )


def grpo_loss(policy: LMPolicy, batch: GroupBatch) -> torch.Tensor:
    """Clipped token-level surrogate, averaged over each message's tokens, then over the batch (TRL's ``grpo``)."""
    prompts = batch.prompts
    scores = policy.evaluate(prompts.ids, prompts.mask, batch.tokens, batch.token_mask, with_value=False)
    ratio = (scores["token_log_probs"] - batch.sample_log_probs).exp()
    surrogate = clipped_surrogate(ratio, batch.advantages.unsqueeze(-1), CLIP_EPSILON)
    mask = batch.token_mask.to(surrogate.dtype)
    return -((surrogate * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()


def dpo_loss(policy: LMPolicy, batch: PreferenceBatch) -> torch.Tensor:
    """DPO's sigmoid loss, chosen and rejected messages scored in one forward pass."""
    prompts = batch.prompts
    scores = policy.evaluate(
        torch.cat([prompts.ids, prompts.ids]),
        torch.cat([prompts.mask, prompts.mask]),
        torch.cat([batch.chosen, batch.rejected]),
        torch.cat([batch.chosen_mask, batch.rejected_mask]),
        with_value=False,
    )
    chosen, rejected = scores["token_log_probs"].sum(-1).chunk(2)
    logits = (chosen - batch.reference_chosen) - (rejected - batch.reference_rejected)
    return preference_loss(logits, DPO_BETA).mean()


class FrameworkUpdate:
    """One optimiser step of a loss of an :class:`LMPolicy`: forward, backward, clipping, fused AdamW.

    Parameters
    ----------
    policy : LMPolicy
        The policy trained (in place).
    loss : callable
        Maps the policy to a scalar loss with gradients.
    """

    def __init__(self, policy: LMPolicy, loss: Callable[[LMPolicy], torch.Tensor]) -> None:
        self.policy = policy.train()
        self.loss = loss
        self.parameters = [parameter for parameter in policy.parameters() if parameter.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.parameters, lr=LEARNING_RATE, weight_decay=0.0, **fast_implementation(torch.optim.AdamW)
        )
        self._saved: SavedTensorBytes | None = None

    def count_next_step(self) -> SavedTensorBytes:
        """Have the next step count what its loss computation saves for the backward pass (see :class:`SavedTensorBytes`)."""
        self._saved = SavedTensorBytes(self.policy)
        return self._saved

    def step(self) -> None:
        """Make one update; the gradients are freed after the step (as the Hugging Face Trainer does)."""
        saved, self._saved = self._saved, None
        with saved if saved is not None else contextlib.nullcontext():
            loss = self.loss(self.policy)
        loss.backward()
        del loss
        torch.nn.utils.clip_grad_norm_(self.parameters, MAX_GRAD_NORM)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class StepTimes:
    """Wall and process-CPU seconds of successive update steps, warm-up ones included."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.cpu_seconds: list[float] = []

    def add(self, seconds: float, cpu_seconds: float) -> None:
        """Record one step."""
        self.seconds.append(seconds)
        self.cpu_seconds.append(cpu_seconds)

    def summary(self, args: argparse.Namespace, tokens: tuple[int, int], minus: StepTimes | None = None) -> dict:
        """:func:`summarise` of the timed steps (after the warm-up, before the memory step), minus ``minus``'s."""
        steps = slice(args.warmup, args.warmup + args.update_steps)
        seconds, cpu_seconds = self.seconds[steps], self.cpu_seconds[steps]
        if minus is not None:
            seconds = [total - part for total, part in zip(seconds, minus.seconds[steps])]
            cpu_seconds = [total - part for total, part in zip(cpu_seconds, minus.cpu_seconds[steps])]
        return summarise(seconds, cpu_seconds, *tokens)


def timed_framework_step(update: FrameworkUpdate, times: StepTimes) -> Callable[[], None]:
    """A function that makes one timed step of ``update`` and records its times."""
    device = update.policy.banned.device

    def step() -> None:
        seconds, cpu_seconds, _ = timed_call(update.step, device)
        times.add(seconds, cpu_seconds)

    return step


def probed_step(update: FrameworkUpdate) -> int:
    """Make one more step of ``update``; return its peak memory in bytes (see :class:`MemoryProbe`)."""
    probe = MemoryProbe(update.policy.banned.device)
    probe.start()
    update.step()
    return probe.stop()


# ------------------------------------------------------------------ TRL updates
def trl_version() -> str | None:
    """TRL's version, or None if it is not installed."""
    if importlib.util.find_spec("trl") is None:
        return None
    import trl

    return trl.__version__


def trl_options(args: argparse.Namespace, output_dir: str) -> dict[str, Any]:
    """The TrainingArguments of both TRL trainers: optimiser, precision and clipping as on the framework side."""
    return {
        "output_dir": output_dir,
        "per_device_train_batch_size": args.batch_size,
        "max_steps": args.warmup + args.update_steps + 1,
        "learning_rate": LEARNING_RATE,
        "weight_decay": 0.0,
        "lr_scheduler_type": "constant",
        "optim": "adamw_torch_fused",
        "max_grad_norm": MAX_GRAD_NORM,
        "bf16": False,
        "fp16": False,
        "gradient_checkpointing": False,
        "use_cpu": args.device == "cpu",
        "report_to": "none",
        "save_strategy": "no",
        "logging_strategy": "no",
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "seed": args.seed,
    }


def step_clock(device: torch.device, memory_step: int, after_step: Callable[[], None]):
    """A ``TrainerCallback`` that times TRL's optimiser steps, interleaved with the framework's.

    Parameters
    ----------
    device : torch.device
        The device trained on.
    memory_step : int
        Index of the (last) step whose memory peak is probed.
    after_step : callable
        Called after each timing of a step before ``memory_step`` (outside
        TRL's timed window): one framework step, so that both sides share
        whatever the machine's other processes do.
    """
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        """Wall and CPU time from ``on_step_begin`` to ``on_step_end``; the memory peak of one step."""

        def __init__(self) -> None:
            self.times = StepTimes()
            self.peak_bytes = 0
            self._probe = MemoryProbe(device)
            self._started = (0.0, 0.0)

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == memory_step:
                self._probe.start()
            synchronize(device)
            self._started = (time.perf_counter(), time.process_time())

        def on_step_end(self, args, state, control, **kwargs):
            synchronize(device)
            self.times.add(time.perf_counter() - self._started[0], time.process_time() - self._started[1])
            step = state.global_step - 1  # global_step is counted before on_step_end
            if step == memory_step:
                self.peak_bytes = self._probe.stop()
            else:
                after_step()

    return StepClock()


class CountsSavedTensors:
    """Mixin of a TRL trainer: its first ``compute_loss`` with gradients counts what it saves for the backward pass.

    The count (:class:`SavedTensorBytes`, over the model's parameters) is
    around the loss computation of the first training step, as
    :meth:`FrameworkUpdate.count_next_step` on the framework side; calls
    without gradients (DPO's precomputed reference log-probs) are not counted.
    """

    saved_tensors: SavedTensorBytes | None = None

    def compute_loss(self, model, inputs, *args, **kwargs):
        if self.saved_tensors is not None or not torch.is_grad_enabled():
            return super().compute_loss(model, inputs, *args, **kwargs)
        self.saved_tensors = SavedTensorBytes(model)
        with self.saved_tensors:
            return super().compute_loss(model, inputs, *args, **kwargs)


def saved_tensor_figures(trainer) -> dict[str, int]:
    """``saved_bytes`` and ``saved_parameter_bytes`` of a :class:`CountsSavedTensors` trainer's counted step."""
    saved = trainer.saved_tensors
    return {"saved_bytes": saved.bytes, "saved_parameter_bytes": saved.parameter_bytes}


def quiet(trainer) -> None:
    """Remove the callbacks that print progress and logs."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    for callback in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(callback)


def prompt_texts(tokenizer, prompts: Prompts) -> list[str]:
    """The prompts as text, a leading ``<bos>`` left out (the tokenizer puts it back)."""
    rows = [ids[mask] for ids, mask in zip(prompts.ids.cpu(), prompts.mask.cpu())]
    bos = tokenizer.bos_token_id
    return [tokenizer.decode(row[1:] if bos is not None and int(row[0]) == bos else row) for row in rows]


def presampled_rollout(tokenizer, batch: GroupBatch) -> Callable:
    """A TRL ``rollout_func`` that hands out ``batch``'s messages instead of generating.

    TRL passes the prompts of a step (each of the ``B / G`` prompts ``G``
    times); each occurrence of a prompt gets the next of that prompt's rows of
    the batch, so every step trains on exactly the batch's messages.
    """
    texts = prompt_texts(tokenizer, batch.prompts)
    prompt_rows = [ids[mask].tolist() for ids, mask in zip(batch.prompts.ids.cpu(), batch.prompts.mask.cpu())]
    lengths = batch.token_mask.sum(-1).tolist()
    messages = [row[:length] for row, length in zip(batch.tokens.tolist(), lengths)]
    log_probs = [row[:length] for row, length in zip(batch.sample_log_probs.tolist(), lengths)]
    rewards = batch.rewards.tolist()

    def rollout(prompts: list[str], trainer) -> dict[str, list]:
        queues: dict[str, list[int]] = {}
        for row, text in enumerate(texts):
            queues.setdefault(text, []).append(row)
        rows = [queues[text].pop(0) for text in prompts]
        return {
            "prompt_ids": [prompt_rows[row] for row in rows],
            "completion_ids": [messages[row] for row in rows],
            "logprobs": [log_probs[row] for row in rows],
            "benchmark_reward": [rewards[row] for row in rows],
        }

    return rollout


def benchmark_reward(prompts, completions, benchmark_reward, **kwargs) -> list[float]:
    """TRL reward function: the batch's reward of each message, passed on by the rollout function."""
    return list(benchmark_reward)


def measure_trl_grpo(
    policy: LMPolicy, batch: GroupBatch, args: argparse.Namespace, after_step: Callable[[], None]
) -> dict[str, Any]:
    """TRL's GRPOTrainer on the batch's messages (no generation), ``after_step`` after each step.

    See the module docstring.

    Returns
    -------
    dict
        ``"update"``: each step minus its ``_prepare_inputs``; ``"step"``: the
        whole step; the memory peak of one whole step.
    """
    from datasets import Dataset, disable_progress_bars
    from trl import GRPOConfig, GRPOTrainer

    disable_progress_bars()

    class TimedGRPOTrainer(CountsSavedTensors, GRPOTrainer):
        """GRPOTrainer that records how long each ``_prepare_inputs`` (rollout, rewards, advantages) takes."""

        prepare_times: StepTimes

        def _prepare_inputs(self, generation_batch):
            started, cpu_started = time.perf_counter(), time.process_time()
            inputs = super()._prepare_inputs(generation_batch)
            synchronize(self.args.device)
            self.prepare_times.add(time.perf_counter() - started, time.process_time() - cpu_started)
            return inputs

    device = policy.banned.device
    tokens = real_tokens(batch.prompts, batch.token_mask)
    clock = step_clock(device, args.warmup + args.update_steps, after_step)
    dataset = Dataset.from_dict({"prompt": prompt_texts(policy.tokenizer, batch.prompts)[:: batch.group_size]})
    with tempfile.TemporaryDirectory(prefix="nip_like_lm_benchmark_") as output_dir:
        config = GRPOConfig(
            **trl_options(args, output_dir),
            num_generations=batch.group_size,
            max_completion_length=args.new_tokens,
            temperature=policy.settings.temperature,
            beta=0.0,
            loss_type="grpo",
            epsilon=CLIP_EPSILON,
        )
        trainer = TimedGRPOTrainer(
            model=copy.deepcopy(policy.model),
            reward_funcs=benchmark_reward,
            args=config,
            train_dataset=dataset,
            processing_class=policy.tokenizer,
            rollout_func=presampled_rollout(policy.tokenizer, batch),
            callbacks=[clock],
        )
        trainer.prepare_times = StepTimes()
        quiet(trainer)
        trainer.train()
    return {
        "update": clock.times.summary(args, tokens, minus=trainer.prepare_times),
        "step": clock.times.summary(args, tokens),
        "peak_bytes": clock.peak_bytes,
        **saved_tensor_figures(trainer),
    }


def check_trl_tokens(dataset, batch: PreferenceBatch) -> None:
    """Raise if TRL's tokenized preference data differ from the batch's token ids."""
    prompts = batch.prompts
    for row, example in enumerate(dataset):
        expected = {
            "prompt_ids": prompts.ids[row][prompts.mask[row]].tolist(),
            "chosen_ids": batch.chosen[row][batch.chosen_mask[row]].tolist(),
            "rejected_ids": batch.rejected[row][batch.rejected_mask[row]].tolist(),
        }
        for key, ids in expected.items():
            if list(example[key]) != ids:
                raise RuntimeError(f"TRL tokenized row {row}'s {key} as {list(example[key])}, expected {ids}")


def measure_trl_dpo(
    policy: LMPolicy,
    batch: PreferenceBatch,
    args: argparse.Namespace,
    after_step: Callable[[], None],
    pretokenized: bool = False,
) -> dict[str, Any]:
    """TRL's DPOTrainer on the batch's pairs, ``after_step`` after each step; see the module docstring.

    With ``pretokenized``, TRL gets the token ids themselves (columns
    ``prompt_ids``, ``chosen_ids``, ``rejected_ids``, which its collator
    reads) instead of text to tokenize: sampled sub-word tokens do not come
    back the same from their decoded text. Preparing the dataset happens
    before training, outside the timed steps, either way.
    """
    from datasets import Dataset, disable_progress_bars
    from trl import DPOConfig, DPOTrainer

    disable_progress_bars()

    class CountingDPOTrainer(CountsSavedTensors, DPOTrainer):
        """DPOTrainer that counts the tensors its first step saves for the backward pass."""

    class PretokenizedDPOTrainer(CountingDPOTrainer):
        """DPOTrainer whose dataset already holds the token ids of prompt, chosen and rejected messages."""

        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            return dataset

    device = policy.banned.device
    tokenizer = policy.tokenizer
    tokens = real_tokens(batch.prompts, batch.chosen_mask, batch.rejected_mask)
    clock = step_clock(device, args.warmup + args.update_steps, after_step)

    def as_text(messages: torch.Tensor, mask: torch.Tensor) -> list[str]:
        return [" " + tokenizer.decode(row[row_mask]) for row, row_mask in zip(messages.cpu(), mask.cpu())]

    def as_ids(messages: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
        return [row[row_mask].tolist() for row, row_mask in zip(messages.cpu(), mask.cpu())]

    if pretokenized:
        columns = {
            "prompt_ids": as_ids(batch.prompts.ids, batch.prompts.mask),
            "chosen_ids": as_ids(batch.chosen, batch.chosen_mask),
            "rejected_ids": as_ids(batch.rejected, batch.rejected_mask),
        }
    else:
        columns = {
            "prompt": prompt_texts(tokenizer, batch.prompts),
            "chosen": as_text(batch.chosen, batch.chosen_mask),
            "rejected": as_text(batch.rejected, batch.rejected_mask),
        }
    dataset = Dataset.from_dict(columns)
    with tempfile.TemporaryDirectory(prefix="nip_like_lm_benchmark_") as output_dir:
        config = DPOConfig(
            **trl_options(args, output_dir),
            beta=DPO_BETA,
            loss_type=["sigmoid"],
            precompute_ref_log_probs=True,
            max_length=None,
        )
        trainer = (PretokenizedDPOTrainer if pretokenized else CountingDPOTrainer)(
            model=copy.deepcopy(policy.model),
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[clock],
        )
        check_trl_tokens(trainer.train_dataset, batch)
        quiet(trainer)
        trainer.train()
    return {"update": clock.times.summary(args, tokens), "peak_bytes": clock.peak_bytes, **saved_tensor_figures(trainer)}


# ------------------------------------------------------------------ report
def parameter_count(policy: LMPolicy) -> int:
    """Parameters of the policy's model."""
    return sum(parameter.numel() for parameter in policy.model.parameters())


def print_rollout(rollout: dict[str, Any], args: argparse.Namespace) -> None:
    """The rollout table."""
    print(f"\nRollout: median of {args.repeats} calls after {args.warmup} warm-up calls")
    print(f"{'side':<22} {'tokens':>7} {'median s':>9} {'tokens/s':>10} {'CPU s':>7}")
    for name, label in (("nip_like", "LMPolicy.sample"), ("generate", "model.generate")):
        row = rollout[name]
        print(
            f"{label:<22} {statistics.median(row['tokens']):>7.0f} {row['median_seconds']:>9.4f} "
            f"{row['tokens_per_second']:>10,.0f} {row['median_cpu_seconds']:>7.3f}"
        )
    verdict = "meets" if rollout["meets_target"] else "misses"
    print(
        f"ratio sample / generate (time per token): {rollout['ratio']:.3f}, {verdict} the target of at most "
        f"{rollout['target_ratio']:.2f}; same messages: {rollout['same_messages']}"
    )


def print_updates(updates: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    """The update table and the TRL / framework speed-ups."""
    print(f"\nUpdate step: median of {args.update_steps} steps after {args.warmup} warm-up steps")
    print(
        f"{'objective, side':<34} {'median ms':>9} {'tokens/s':>10} {'msg tok/s':>10} {'CPU ms':>8} {'peak MiB':>9} "
        f"{'saved B/tok':>11}"
    )
    for objective, sides in updates.items():
        per_token = activation_bytes_per_token(sides, sides["nip_like"]["tokens"])
        rows = [("nip_like", sides["nip_like"], sides["nip_like"]["peak_bytes"], per_token["nip_like"])]
        if "trl" in sides:
            trl = sides["trl"]
            label = "TRL (step minus _prepare_inputs)" if "step" in trl else "TRL"
            rows.append((label, trl["update"], trl["peak_bytes"], per_token["trl"]))
            if "step" in trl:
                rows.append(("TRL (whole step)", trl["step"], None, None))
        for label, row, peak, saved in rows:
            peak_text = f"{peak / MIB:>9.2f}" if peak is not None else f"{'':>9}"
            saved_text = f"{saved:>11,.0f}" if saved is not None else f"{'':>11}"
            print(
                f"{objective + ', ' + label:<34} {row['median_seconds'] * 1e3:>9.2f} "
                f"{row['tokens_per_second']:>10,.0f} {row['message_tokens_per_second']:>10,.0f} "
                f"{row['median_cpu_seconds'] * 1e3:>8.2f} {peak_text} {saved_text}"
            )
    for objective, sides in updates.items():
        if "trl" in sides:
            per_token = sides["activation_bytes_per_token"]
            saved, peak = (row.get("ratio", float("nan")) for row in (per_token, per_token["peak"]))
            print(
                f"{objective}: TRL / nip_like median update time = {sides['trl_over_nip_like']:.2f}; nip_like / TRL "
                f"activation bytes per token = {saved:.3f} (saved for the backward pass), {peak:.3f} (step peak)"
            )


# ------------------------------------------------------------------ main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    defaults = LMAgentConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-B", "--batch-size", type=int, default=32, help="prompts per batch (default 32)")
    parser.add_argument("-P", "--prompt-length", type=int, default=24, help="longest prompt, <bos> in (default 24)")
    parser.add_argument("-T", "--new-tokens", type=int, default=32, help="max_new_tokens of a message (default 32)")
    parser.add_argument("-G", "--group-size", type=int, default=4, help="equal prompts per GRPO group (default 4)")
    parser.add_argument("--repeats", type=int, default=9, help="timed rollout calls per side (default 9)")
    parser.add_argument("--update-steps", type=int, default=20, help="timed update steps per side (default 20)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls or steps first (default 2)")
    parser.add_argument("--temperature", type=float, default=defaults.temperature, help="sampling temperature")
    parser.add_argument("--top-k", type=int, default=defaults.top_k, help="top-k, 0 = off")
    parser.add_argument("--top-p", type=float, default=defaults.top_p, help="top-p, 1 = off")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model, prompts and samples")
    parser.add_argument("--skip-trl", action="store_true", help="leave out the TRL updates")
    parser.add_argument("--output", "--json", type=Path, default=None, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    for name in ("batch_size", "new_tokens", "repeats", "update_steps", "warmup", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.prompt_length < 2:
        parser.error("--prompt-length must be at least 2 (<bos> and one token)")
    if args.group_size < 2 or args.batch_size % args.group_size:
        parser.error("--group-size must be at least 2 and divide --batch-size")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    return args


def measure_update(
    policy: LMPolicy,
    loss: Callable[[LMPolicy], torch.Tensor],
    tokens: tuple[int, int],
    args: argparse.Namespace,
    trl_measure: Callable[[Callable[[], None]], dict[str, Any]] | None,
) -> dict[str, Any]:
    """The framework's updates of one objective, alternating step by step with TRL's if ``trl_measure`` is given.

    Parameters
    ----------
    policy : LMPolicy
        The initial policy; each side trains a copy.
    loss : callable
        The framework's loss of a policy.
    tokens : tuple of int
        Real tokens of a step, in all and in messages.
    args : argparse.Namespace
        The command line.
    trl_measure : callable, optional
        Runs TRL's trainer, calling its argument after each of its steps but
        the last (see :func:`step_clock`), and returns TRL's results.

    Returns
    -------
    dict
        ``"nip_like"`` (and ``"trl"`` with ``"trl_over_nip_like"``, the ratio of median update times).
    """
    update = FrameworkUpdate(clone_policy(policy), loss)
    saved = update.count_next_step()  # the first (warm-up) step, as on TRL's side
    times = StepTimes()
    framework_step = timed_framework_step(update, times)
    result: dict[str, Any] = {}
    if trl_measure is None:
        for _ in range(args.warmup + args.update_steps):
            framework_step()
    else:
        result["trl"] = trl_measure(framework_step)
    result["nip_like"] = {
        **times.summary(args, tokens),
        "peak_bytes": probed_step(update),
        "saved_bytes": saved.bytes,
        "saved_parameter_bytes": saved.parameter_bytes,
    }
    if trl_measure is not None:
        result["trl_over_nip_like"] = result["trl"]["update"]["median_seconds"] / result["nip_like"]["median_seconds"]
        result["activation_bytes_per_token"] = activation_bytes_per_token(result, tokens[0])
    return result


def activation_bytes_per_token(sides: dict[str, Any], tokens: int) -> dict[str, Any]:
    """Bytes per real token of a step that each side keeps for its backward pass, and the ratio nip_like / TRL.

    ``nip_like`` and ``trl``: the bytes saved for the backward pass by the
    loss computation of one step (:class:`SavedTensorBytes`, parameters left
    out) over the step's real tokens (prompts and messages). ``peak``: the
    same sides' step peaks (:class:`MemoryProbe`: the most allocated during the
    step over what was allocated when it began; gradients and temporaries
    included) over the same tokens.
    """
    figures: dict[str, Any] = {"tokens": tokens, "peak": {}}
    for name in ("nip_like", "trl"):
        if name in sides:
            figures[name] = sides[name]["saved_bytes"] / tokens
            figures["peak"][name] = sides[name]["peak_bytes"] / tokens
    for row in (figures, figures["peak"]):
        if "trl" in row and row["trl"] > 0:
            row["ratio"] = row["nip_like"] / row["trl"]
    return figures


def measure_updates(
    policy: LMPolicy, prompts: Prompts, args: argparse.Namespace, with_trl: bool, pretokenized: bool = False
) -> dict[str, Any]:
    """GRPO and DPO updates of the framework and, if ``with_trl``, of TRL, all from the same initial model.

    ``pretokenized``: TRL's DPO gets token ids rather than text (see :func:`measure_trl_dpo`).
    """
    group = make_group_batch(policy, prompts, args.group_size, args.seed + 1)
    preference = make_preference_batch(policy, prompts, args.seed + 2)
    return {
        "GRPO": measure_update(
            policy,
            lambda trained: grpo_loss(trained, group),
            real_tokens(prompts, group.token_mask),
            args,
            (lambda after_step: measure_trl_grpo(policy, group, args, after_step)) if with_trl else None,
        ),
        "DPO": measure_update(
            policy,
            lambda trained: dpo_loss(trained, preference),
            real_tokens(prompts, preference.chosen_mask, preference.rejected_mask),
            args,
            (lambda after_step: measure_trl_dpo(policy, preference, args, after_step, pretokenized)) if with_trl else None,
        ),
    }


def run_quietly(
    measure: Callable[[argparse.Namespace], dict[str, Any]], args: argparse.Namespace, *ignored: type[Warning]
) -> dict[str, Any]:
    """``measure(args)`` with transformers' log level at error and warnings of the ``ignored`` categories hidden.

    ``FutureWarning`` is always hidden: TRL and transformers warn about
    deprecated names that the benchmarks do not use themselves. The warning
    filters and the log level are restored on return.
    """
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            for category in (FutureWarning, *ignored):
                warnings.simplefilter("ignore", category)
            return measure(args)
    finally:
        transformers.logging.set_verbosity(verbosity)


def write_results(results: dict[str, Any], output: Path | None) -> None:
    """Write ``results`` as JSON to ``output`` (atomically) and say so; nothing if ``output`` is None."""
    if output is not None:
        write_text_atomic(json.dumps(results, indent=2) + "\n", output)
        print(f"results written to {output}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print the tables; return (and optionally write) the results.

    It sets ``torch.set_num_threads(--threads)`` and leaves it so; the
    warning filters and transformers' log level are restored on return.
    """
    return run_quietly(run, parse_args(argv))


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The measurements of :func:`main`."""
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    version = None if args.skip_trl else trl_version()

    tokenizer = build_tokenizer(ALPHABET)
    torch.manual_seed(args.seed)
    config = LMAgentConfig(
        max_new_tokens=args.new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        value_head=False,
    )
    policy = build_lm_policy(config, tokenizer).to(device)
    prompts = make_prompts(tokenizer, args.batch_size, args.prompt_length, args.group_size, args.seed, device)
    print(
        f"tiny Llama (hidden {config.hidden_size}, {config.num_layers} layers, {config.num_heads} heads, MLP "
        f"{config.intermediate_size}; {parameter_count(policy):,} parameters, vocabulary {len(tokenizer)}); "
        f"B={args.batch_size} prompts of {int(prompts.mask.sum(-1).min())} to {args.prompt_length} tokens, "
        f"T={args.new_tokens}; temperature {args.temperature}, top-k {args.top_k}, top-p {args.top_p}; "
        f"{device}, {torch.get_num_threads()} threads",
        flush=True,
    )
    if version is None and not args.skip_trl:
        print("TRL is not installed (pip install -e '.[bench]'): its updates are left out")

    rollout = measure_rollout(policy, prompts, args)
    print_rollout(rollout, args)
    updates = measure_updates(policy, prompts, args, with_trl=version is not None)
    print_updates(updates, args)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"\nprocess peak resident memory (getrusage): {peak_rss / MIB:.0f} MiB")

    results: dict[str, Any] = {
        "settings": {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()},
        "model": {"parameters": parameter_count(policy), "vocabulary": len(tokenizer)},
        "threads": torch.get_num_threads(),
        "rollout": rollout,
        "updates": updates,
        "peak_rss_bytes": peak_rss,
        "memory_method": "torch.cuda.max_memory_allocated" if device.type == "cuda" else "torch.profiler memory events",
        "environment": {name: os.environ.get(name) for name in SCRIPT_ENVIRONMENT},
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "trl": version,
        },
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count()},
    }
    write_results(results, args.output)
    return results


if __name__ == "__main__":
    main()
