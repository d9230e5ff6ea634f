"""Throughput of a whole LM-agent rollout of the duplicates game against a plain ``generate`` loop.

``scripts/benchmark_lm.py`` times :meth:`LMPolicy.sample` against ``generate``
on one batch of prompts. This script times what a trainer really does to
collect: the TorchRL ``Collector`` of :class:`~nip_like.trainers.rl.TensorDictRlTrainer`
stepping the duplicates environment with :class:`~nip_like.lm.actor_critic.LMActor`
(building each turn's prompts, revealing the cells a message names, sampling
each acting agent's message batched over the environments, writing the
action, its mask and log-probabilities, resets). The baseline is the least a
plain script could do to produce the same messages: for every step of the
collected batch and every agent that acts at it, one batched
``model.generate(do_sample=True)`` call on exactly the prompts the framework
built, with the same sampling settings and banned tokens (as in
``benchmark_lm.py``), and nothing else (no environment, no bookkeeping).

The ratio is the framework's median time per generated message token over
the baseline's (target: at most 1.10). Tokens are counted alike on both sides:
each message's tokens up to and including its first ``<eos>``. The framework
side also reports how much of its time was spent in ``LMPolicy.sample`` (the
rest is the environment, the prompts and the collector).

The run is built by :func:`nip_like.experiment.build_trainer` from the preset
(default ``lm_long``: 64 environments, 512 frames per batch, a 96x3 prover
and a 64x2 verifier, messages of at most 3 tokens) without its warm start
(randomly initialised agents; the throughput does not depend on the weights
beyond the message lengths, which are counted), with evaluation, logging and
checkpoints off. After ``--warmup`` untimed batches, each of ``--repeats``
rounds collects one batch (timed) and replays its prompts through
``generate`` (timed), alternating which goes first (the replay of an odd round
uses the previous round's batch).

Run it from the repository root::

    python scripts/benchmark_lm_rollout.py                              # lm_long, about a minute on 2 cores
    python scripts/benchmark_lm_rollout.py --repeats 2 --warmup 1 scenario.num_lists=2000   # smoke
    python scripts/benchmark_lm_rollout.py --output rollout.json --device cuda
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "scripts")]

from lm_benchmark_env import set_script_environment  # noqa: E402

if __name__ == "__main__":
    # Offline; idle OpenMP threads sleep rather than spin (see lm_benchmark_env).
    set_script_environment()

import torch  # noqa: E402
import transformers  # noqa: E402
from tensordict import TensorDictBase  # noqa: E402

from benchmark_lm import generate_options, message_lengths, synchronize  # noqa: E402

from nip_like import keys  # noqa: E402
from nip_like.checkpoint import write_text_atomic  # noqa: E402
from nip_like.cli import compose_config  # noqa: E402
from nip_like.experiment import build_trainer  # noqa: E402
from nip_like.lm.actor_critic import LMActor  # noqa: E402
from nip_like.lm.policy import LMPolicy  # noqa: E402

#: Largest acceptable ratio of time per token, framework rollout over the plain generate loop.
TARGET_ROLLOUT_RATIO = 1.10

#: Overrides that leave only collection: no warm start, evaluation, logging, bars or checkpoints.
BASE_OVERRIDES = (
    "trainer.pretrain.agents=[]",
    "logger=none",
    "run.progress_bar=false",
    "run.checkpoint_every=0",
    "trainer.eval.every=0",
)


class SampleClock:
    """Adds up the wall time spent in each policy's :meth:`LMPolicy.sample` while installed."""

    def __init__(self, policies: list[LMPolicy], device: torch.device) -> None:
        self.seconds = 0.0
        self.device = device
        for policy in policies:
            policy.sample = self._timed(policy.sample)

    def _timed(self, sample: Callable[..., dict]) -> Callable[..., dict]:
        def timed(*args: Any, **kwargs: Any) -> dict:
            synchronize(self.device)
            started = time.perf_counter()
            result = sample(*args, **kwargs)
            synchronize(self.device)
            self.seconds += time.perf_counter() - started
            return result

        return timed


def framework_tokens(batch: TensorDictBase) -> int:
    """Message tokens the acting agents produced in a collected batch (``<eos>`` included)."""
    mask = batch.get(keys.TOKEN_MASK_KEY) & batch.get(keys.ACTIVE_KEY).unsqueeze(-1)
    return int(mask.sum())


def replay_with_generate(actor: LMActor, batch: TensorDictBase, seed: int) -> tuple[float, int, int]:
    """Sample every turn of ``batch`` again with ``generate`` on the same prompts.

    Returns
    -------
    tuple of (float, int, int)
        Wall seconds of the ``generate`` calls, message tokens they produced,
        and the number of calls.
    """
    active = batch.get(keys.ACTIVE_KEY)
    if active.ndim != 3:
        raise ValueError(f"expected a collected batch of shape (envs, steps), got {tuple(active.shape[:-1])}")
    steps = active.shape[1]
    prompt_ids = batch.get(keys.PROMPT_IDS_KEY)
    prompt_mask = batch.get(keys.PROMPT_MASK_KEY)
    device = prompt_ids.device
    options = {name: generate_options(actor.policy(name)) for name in actor.agent_names}
    seconds, tokens, calls = 0.0, 0, 0
    torch.manual_seed(seed)
    for step in range(steps):
        for index, name in enumerate(actor.agent_names):
            where = active[:, step, index]
            if not bool(where.any()):
                continue
            ids = prompt_ids[:, step, index][where]
            mask = prompt_mask[:, step, index][where]
            policy = actor.policy(name)
            synchronize(device)
            started = time.perf_counter()
            output = policy.model.generate(input_ids=ids, attention_mask=mask.long(), **options[name])
            synchronize(device)
            seconds += time.perf_counter() - started
            tokens += int(message_lengths(output[:, ids.shape[1] :], policy.eos_token_id).sum())
            calls += 1
    return seconds, tokens, calls


def median_per_token(seconds: list[float], tokens: list[int]) -> float:
    """Median over rounds of seconds per token."""
    return statistics.median(s / n for s, n in zip(seconds, tokens))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; anything else is a Hydra override of the run's config."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="lm_long", help="the run's preset (default: lm_long)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--num-threads", type=int, default=2, help="torch CPU threads (default: 2)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed batches first (default: 2)")
    parser.add_argument("--repeats", type=int, default=8, help="timed rounds (default: 8)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, help="also write the results to this JSON file")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. trainer.num_envs=128")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be at least 1 and --warmup at least 0")
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Build the run, time collection against the generate replay, and return the figures."""
    torch.set_num_threads(args.num_threads)
    # The environment's prompts are a fixed layout whose masked slots can come last; generate warns
    # about "right-padding" on each call, although the attention mask and the position ids it derives
    # from it (as LMPolicy does) make the sampled distribution the same.
    transformers.logging.set_verbosity_error()
    overrides = [
        f"preset={args.preset}",
        *BASE_OVERRIDES,
        f"run.device={args.device}",
        f"seed={args.seed}",
        *args.overrides,
    ]
    config = compose_config(overrides)
    with tempfile.TemporaryDirectory(prefix="nip_like_rollout_") as run_dir:
        trainer = build_trainer(config, Path(run_dir))
        actor = trainer.policy
        if not isinstance(actor, LMActor):
            raise SystemExit(f"error: the preset's agents are not language models (policy: {type(actor).__name__})")
        device = trainer.device
        for name in actor.agent_names:
            actor.policy(name).eval()
        clock = SampleClock([actor.policy(name) for name in actor.agent_names], device)

        def collect() -> tuple[float, TensorDictBase]:
            synchronize(device)
            started = time.perf_counter()
            batch = next(trainer._collector_iterator)
            synchronize(device)
            return time.perf_counter() - started, batch

        for _ in range(args.warmup):
            _, batch = collect()
            replay_with_generate(actor, batch, args.seed)
        sides: dict[str, dict[str, list]] = {
            name: {"seconds": [], "tokens": []} for name in ("nip_like", "generate")
        }
        sample_seconds: list[float] = []
        calls = 0
        previous = None
        for repeat in range(args.repeats):
            if repeat % 2 == 1 and previous is not None:
                seconds, tokens, calls = replay_with_generate(actor, previous, args.seed + repeat)
                sides["generate"]["seconds"].append(seconds)
                sides["generate"]["tokens"].append(tokens)
            clock.seconds = 0.0
            seconds, batch = collect()
            sides["nip_like"]["seconds"].append(seconds)
            sides["nip_like"]["tokens"].append(framework_tokens(batch))
            sample_seconds.append(clock.seconds)
            if repeat % 2 == 0:
                seconds, tokens, calls = replay_with_generate(actor, batch, args.seed + repeat)
                sides["generate"]["seconds"].append(seconds)
                sides["generate"]["tokens"].append(tokens)
            previous = batch
        frames = batch.numel()
        num_envs = int(trainer.trainer_config.num_envs)
    result: dict[str, Any] = {}
    for name, side in sides.items():
        per_token = median_per_token(side["seconds"], side["tokens"])
        result[name] = {
            **side,
            "median_seconds": statistics.median(side["seconds"]),
            "median_seconds_per_token": per_token,
            "tokens_per_second": 1 / per_token,
        }
    result["nip_like"]["sample_seconds"] = sample_seconds
    result["nip_like"]["sample_share"] = statistics.median(
        s / t for s, t in zip(sample_seconds, sides["nip_like"]["seconds"])
    )
    ratio = result["nip_like"]["median_seconds_per_token"] / result["generate"]["median_seconds_per_token"]
    result.update(
        ratio=ratio,
        target_ratio=TARGET_ROLLOUT_RATIO,
        meets_target=ratio <= TARGET_ROLLOUT_RATIO,
        frames_per_batch=frames,
        num_envs=num_envs,
        generate_calls_per_batch=calls,
        overrides=overrides,
        machine={
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "device": str(device),
            "cuda": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "num_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
    )
    return result


def print_result(result: dict[str, Any]) -> None:
    """The table of the two sides and the ratio."""
    print(f"{result['frames_per_batch']} frames per batch over {result['num_envs']} environments; "
          f"{result['generate_calls_per_batch']} generate calls per batch on the plain side")
    print(f"{'side':<10} {'median s/batch':>15} {'tokens/batch':>13} {'tokens/s':>10}")
    for name in ("nip_like", "generate"):
        side = result[name]
        tokens = statistics.median(side["tokens"])
        print(f"{name:<10} {side['median_seconds']:>15.3f} {tokens:>13.0f} {side['tokens_per_second']:>10.0f}")
    share = result["nip_like"]["sample_share"]
    print(f"share of the framework's rollout spent in LMPolicy.sample: {share:.0%}")
    verdict = "meets" if result["meets_target"] else "misses"
    print(f"ratio (time per token, framework / generate): {result['ratio']:.2f} ({verdict} the target "
          f"{result['target_ratio']:.2f})")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark from the command line; print the table and optionally write JSON."""
    args = parse_args(argv)
    result = run(args)
    print_result(result)
    if args.output is not None:
        write_text_atomic(json.dumps(result, indent=2) + "\n", args.output)
    return result


if __name__ == "__main__":
    main()
