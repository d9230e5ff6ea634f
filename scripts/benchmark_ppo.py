"""Time the framework's PPO against a plain TorchRL loop doing the same work.

The framework side is :class:`nip_like.trainers.ppo.PpoTrainer`, built by
:func:`nip_like.experiment.build_trainer` from the Hydra config of the
repository (``configs/``) with evaluation, logging, progress bars and periodic
checkpoints turned off. The plain side is the CleanRL-style reference loop of
``docs/examples/plain_ppo_loop.py`` (``build_plain_loop`` and
``run_plain_loop``): it uses only the scenario's environment
(``scenario.make_env``), its agents (``scenario.make_agents()``), the
:class:`~nip_like.objectives.ppo.MultiAgentPPOLoss` and its GAE, and TorchRL's
``Collector`` and ``TensorDictReplayBuffer(LazyTensorStorage,
SamplerWithoutReplacement)``. Both sides take every hyper-parameter (frames per
batch, environments, epochs, minibatch size, Adam learning rate and betas,
per-agent gradient clipping, GAE gamma and lambda, PPO coefficients) from the
same composed config, seed the same generators in the same order, and so
compute the same updates: after the warm-up runs the script checks that both
end with bit-identical parameters and reports it
(``tests/test_reference_loop.py`` checks the same).

What is timed
-------------
Only the training iterations: collection, GAE, filling the replay buffer and
the epochs of minibatch updates. Construction (config, modules, environment,
collector) and the final test loop are left out on both sides.

* Framework: ``trainer._run_train_loop()`` inside
  ``with ExitStack() as stack: trainer._build_train_context(stack)``, which is
  exactly what ``trainer.train()`` runs before its test loop. This is the
  fairest cut: it is the user-visible train loop with all its bookkeeping
  (per-minibatch loss statistics, finiteness check, gradient norms, episode
  metrics, LR scheduler, the logger call, the progress-bar object and the one
  checkpoint the loop always writes after its last iteration), and nothing
  that the plain loop would not also need before training starts.
* Plain: ``run_plain_loop(loop)``, the ``for`` loop over iterations of the example.

Each measurement builds a fresh trainer / fresh plain-loop objects (untimed).
One untimed warm-up run of each side comes first; then ``--repeats`` timed
runs of each, alternating which side goes first (ABBA order) to cancel drift.
The table reports the median (and min / max) wall time, the median process
CPU time (less sensitive to other processes on a shared machine), the
throughput (SPS: environment frames per second at the median wall time) and
the overhead ratio framework / plain.

Run it from the repository root::

    python scripts/benchmark_ppo.py                      # defaults: 30 iterations, 3 repeats, 1 thread
    python scripts/benchmark_ppo.py --iterations 2 --repeats 1          # smoke (a few seconds)
    python scripts/benchmark_ppo.py --output benchmark.json             # also write the results as JSON
    python scripts/benchmark_ppo.py --profile /tmp/ppo                  # also cProfile one run of each loop

The target is an overhead ratio of at most 1.05 (the framework costs at most
5% more wall time than the plain loop).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import logging
import platform
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import tensordict
import torch
import torchrl
from omegaconf import DictConfig

# Use the nip_like of this checkout, whatever is installed, and the reference loop of its docs.
REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "docs" / "examples")]

from nip_like.checkpoint import write_text_atomic  # noqa: E402
from nip_like.cli import compose_config  # noqa: E402
from nip_like.experiment import build_trainer  # noqa: E402
from plain_ppo_loop import LoopSettings, build_plain_loop, ppo_options, run_plain_loop  # noqa: E402

#: Largest acceptable overhead ratio framework / plain (the issue's target).
TARGET_RATIO = 1.05

#: Overrides that switch off everything that is not training.
BASE_OVERRIDES = (
    "preset=none",
    "scenario=hidden_bits",
    "protocol=prover_verifier",
    "trainer=ppo",
    "logger=none",
    "run.progress_bar=false",
    "run.device=cpu",
    "run.checkpoint_every=0",
    "trainer.eval.every=0",
    # objective/kl and objective/entropy are logging-only measurements that the
    # plain loop does not make (about one extra policy forward per iteration).
    "logger.diagnostics_every=0",
)


# ------------------------------------------------------------------ config
def benchmark_overrides(args: argparse.Namespace) -> list[str]:
    """Return the Hydra overrides for the command-line options ``args``."""
    overrides = list(BASE_OVERRIDES)
    overrides += [f"trainer.num_iterations={args.iterations}", f"run.num_threads={args.num_threads}"]
    if args.frames_per_batch is not None:
        overrides.append(f"trainer.frames_per_batch={args.frames_per_batch}")
    if args.num_envs is not None:
        overrides.append(f"trainer.num_envs={args.num_envs}")
    if args.minibatch_size is not None:
        overrides.append(f"trainer.minibatch_size={args.minibatch_size}")
    return overrides


# ---------------------------------------------------------------- the runs
@dataclass
class RunResult:
    """One timed run: wall and CPU seconds of the training iterations, frames, final parameters."""

    seconds: float
    cpu_seconds: float
    frames: int
    parameters: list[torch.Tensor]


def run_framework(config: DictConfig, profiler: cProfile.Profile | None = None) -> RunResult:
    """Build a :class:`PpoTrainer` and time its train loop (no test loop).

    Parameters
    ----------
    config : DictConfig
        The composed experiment config.
    profiler : cProfile.Profile, optional
        If given, enabled around the timed part only.

    Returns
    -------
    RunResult
        Wall time of ``_run_train_loop`` (under the train context), frames
        collected, and the trained parameters.
    """
    with tempfile.TemporaryDirectory(prefix="nip_like_benchmark_") as run_dir:
        trainer = build_trainer(config, Path(run_dir))
        try:
            gc.collect()
            if profiler is not None:
                profiler.enable()
            started, cpu_started = time.perf_counter(), time.process_time()
            with ExitStack() as stack:
                trainer._build_train_context(stack)
                trainer._run_train_loop()
            seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
            if profiler is not None:
                profiler.disable()
            parameters = [p.detach().clone() for p in trainer.loss_module.parameters()]
            return RunResult(seconds, cpu_seconds, trainer.state.frames, parameters)
        finally:
            trainer.collector.shutdown()
            trainer.logger.close()


def run_plain(config: DictConfig, profiler: cProfile.Profile | None = None) -> RunResult:
    """Build the plain loop of ``docs/examples/plain_ppo_loop.py`` and time its iterations.

    Parameters
    ----------
    config : DictConfig
        The composed experiment config.
    profiler : cProfile.Profile, optional
        If given, enabled around the timed part only.

    Returns
    -------
    RunResult
        Wall time of :func:`run_plain_loop`, frames collected, and the trained parameters.
    """
    loop = build_plain_loop(config)
    try:
        gc.collect()
        if profiler is not None:
            profiler.enable()
        started, cpu_started = time.perf_counter(), time.process_time()
        frames = run_plain_loop(loop)
        seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
        if profiler is not None:
            profiler.disable()
    finally:
        loop.close()
    parameters = [p.detach().clone() for p in loop.loss_module.parameters()]
    return RunResult(seconds, cpu_seconds, frames, parameters)


def same_parameters(a: RunResult, b: RunResult) -> bool:
    """Return whether two runs ended with bit-identical parameters."""
    return len(a.parameters) == len(b.parameters) and all(
        x.shape == y.shape and torch.equal(x, y) for x, y in zip(a.parameters, b.parameters)
    )


# ----------------------------------------------------------------- report
def summarise(name: str, seconds: list[float], cpu_seconds: list[float], frames: int) -> dict[str, Any]:
    """Summarise the timed runs of one side.

    Parameters
    ----------
    name : str
        ``"framework"`` or ``"plain"``.
    seconds, cpu_seconds : list of float
        Wall and process-CPU seconds of each timed run.
    frames : int
        Environment frames collected per run.

    Returns
    -------
    dict
        The raw times, median / min / max wall time, median CPU time and the
        SPS (frames per second of median wall time).
    """
    median = statistics.median(seconds)
    return {
        "name": name,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "median_seconds": median,
        "min_seconds": min(seconds),
        "max_seconds": max(seconds),
        "median_cpu_seconds": statistics.median(cpu_seconds),
        "frames": frames,
        "sps": frames / median,
    }


def markdown_table(framework: dict[str, Any], plain: dict[str, Any]) -> str:
    """Format the results of both sides and their ratio as a small Markdown table."""
    lines = [
        "| loop | median wall (s) | min wall (s) | max wall (s) | median CPU (s) | SPS (frames/s) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, row in (("framework (PpoTrainer)", framework), ("plain TorchRL loop", plain)):
        lines.append(
            f"| {label} | {row['median_seconds']:.3f} | {row['min_seconds']:.3f} | "
            f"{row['max_seconds']:.3f} | {row['median_cpu_seconds']:.3f} | {row['sps']:,.0f} |"
        )
    wall = framework["median_seconds"] / plain["median_seconds"]
    cpu = framework["median_cpu_seconds"] / plain["median_cpu_seconds"]
    minimum = framework["min_seconds"] / plain["min_seconds"]
    lines.append(
        f"| **ratio framework / plain** | **{wall:.3f}** | {minimum:.3f} | "
        f"{framework['max_seconds'] / plain['max_seconds']:.3f} | {cpu:.3f} | |"
    )
    verdict = "meets" if wall <= TARGET_RATIO else "misses"
    lines.append("")
    lines.append(
        f"Overhead (median wall time): {(wall - 1) * 100:+.1f}%; {verdict} the target of at most "
        f"{(TARGET_RATIO - 1) * 100:.0f}%."
    )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=30, help="training iterations per run (default 30)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each loop (default 3)")
    parser.add_argument("--num-threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    parser.add_argument("--frames-per-batch", type=int, default=None, help="override trainer.frames_per_batch")
    parser.add_argument("--num-envs", type=int, default=None, help="override trainer.num_envs")
    parser.add_argument("--minibatch-size", type=int, default=None, help="override trainer.minibatch_size")
    parser.add_argument("--output", type=Path, default=None, help="write the results as JSON to this file")
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        metavar="PREFIX",
        help="after the timed runs, cProfile one more run of each loop; write PREFIX.framework.prof "
        "and PREFIX.plain.prof (read them with python -m pstats)",
    )
    args = parser.parse_args(argv)
    for name in ("iterations", "repeats", "num_threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print the table; return (and optionally write) the results."""
    args = parse_args(argv)
    logging.getLogger("torchrl").setLevel(logging.WARNING)
    torch.set_num_threads(args.num_threads)
    config = compose_config(benchmark_overrides(args))
    settings = LoopSettings.from_config(config)
    print(
        f"hidden_bits PPO: {settings.iterations} iterations x {settings.frames_per_batch} frames "
        f"({settings.num_envs} envs), {settings.num_epochs} epochs x "
        f"{settings.frames_per_batch // settings.minibatch_size} minibatches of {settings.minibatch_size}; "
        f"torch threads {torch.get_num_threads()}; {args.repeats} repeats",
        flush=True,
    )

    # Warm-up (untimed), which also checks that both loops do the same computation.
    warm_framework = run_framework(config)
    warm_plain = run_plain(config)
    identical = same_parameters(warm_framework, warm_plain)
    print(
        f"warm-up: framework {warm_framework.seconds:.3f}s, plain {warm_plain.seconds:.3f}s; "
        f"final parameters bit-identical: {identical}",
        flush=True,
    )

    times: dict[str, list[float]] = {"framework": [], "plain": []}
    cpu_times: dict[str, list[float]] = {"framework": [], "plain": []}
    frames = warm_framework.frames
    for repeat in range(args.repeats):
        order = ("framework", "plain") if repeat % 2 == 0 else ("plain", "framework")
        for side in order:
            result = run_framework(config) if side == "framework" else run_plain(config)
            if result.frames != frames:
                raise RuntimeError(f"{side} collected {result.frames} frames, expected {frames}")
            times[side].append(result.seconds)
            cpu_times[side].append(result.cpu_seconds)
            print(
                f"repeat {repeat + 1}/{args.repeats}: {side:<9} {result.seconds:.3f}s wall, "
                f"{result.cpu_seconds:.3f}s CPU",
                flush=True,
            )

    framework = summarise("framework", times["framework"], cpu_times["framework"], frames)
    plain = summarise("plain", times["plain"], cpu_times["plain"], frames)
    ratio = framework["median_seconds"] / plain["median_seconds"]
    print()
    print(markdown_table(framework, plain))

    results: dict[str, Any] = {
        "settings": {**asdict(settings), **ppo_options(config)},
        "num_threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "framework": framework,
        "plain": plain,
        "overhead_ratio": ratio,
        "cpu_overhead_ratio": framework["median_cpu_seconds"] / plain["median_cpu_seconds"],
        "target_ratio": TARGET_RATIO,
        "meets_target": ratio <= TARGET_RATIO,
        "parameters_identical": identical,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torchrl": torchrl.__version__,
            "tensordict": tensordict.__version__,
        },
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine()},
    }

    if args.profile is not None:
        args.profile.parent.mkdir(parents=True, exist_ok=True)
        for side, run in (("framework", run_framework), ("plain", run_plain)):
            profiler = cProfile.Profile()
            run(config, profiler)
            path = args.profile.with_name(f"{args.profile.name}.{side}.prof")
            profiler.dump_stats(str(path))
            print(f"cProfile stats of one {side} run written to {path}")

    if args.output is not None:
        write_text_atomic(json.dumps(results, indent=2) + "\n", args.output)
        print(f"results written to {args.output}")
    return results


if __name__ == "__main__":
    main()
