"""Throughput of the graph-isomorphism scenario: the environment alone, and full training.

Two measurements, each for several numbers of parallel environments:

* **Environment steps per second**: the vectorised environment (protocol
  ``nip``, the ``paper`` preset's 3 to 8 rounds) stepped with uniformly random
  legal actions, no network; resets included.
* **Training frames per second**: PPO iterations of the ``paper`` preset
  (2048 frames per batch, 10 epochs of 256-frame minibatches, the preset's
  graph agents), collection and optimisation together, after one untimed
  warm-up iteration; with the split into collection and update time, the
  process's peak resident memory, the floating-point operations of one
  optimiser step (loss forward and backward on a minibatch, counted by
  ``torch.utils.flop_counter``) and the rate the update reaches (those
  operations times the optimiser steps, over the update time).

Each configuration runs in a fresh subprocess, so peak memory is its own.

Run it from the repository root::

    python scripts/benchmark_gi.py                                   # defaults
    python scripts/benchmark_gi.py --env-sizes 64 256 --train-sizes 128 --iterations 2   # quicker
    python scripts/benchmark_gi.py --output gi_benchmark.json

For scale (issue 3): the NIP reference framework, with the ``paper`` setting on
a 2-core CPU machine, took about 12 s per 2048-frame iteration (about 170
frames/s) and held about 11 GB.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent


def _common(args: argparse.Namespace) -> list[str]:
    return [
        "preset=paper",
        f"scenario.cache_dir={args.cache_dir}",
        f"run.num_threads={args.threads}",
        "run.progress_bar=false",
        "logger=none",
        "trainer.eval.every=0",
        "run.checkpoint_every=0",
    ]


def measure_env(args: argparse.Namespace, num_envs: int) -> dict[str, Any]:
    """Random legal actions through the environment: steps (episodes x steps) per second."""
    import torch

    from nip_like.cli import compose_config
    from nip_like.validation import build_scenario

    torch.set_num_threads(args.threads)
    env = build_scenario(compose_config(_common(args))).make_env(num_envs, "train", 0, "cpu")
    generator = torch.Generator().manual_seed(0)

    def random_legal(td):
        mask = td["agents", "action_mask"].float()
        flat = torch.multinomial(mask.reshape(-1, mask.shape[-1]), 1, generator=generator)
        td["agents", "action"] = flat.reshape(mask.shape[:-1])
        return td

    env.rollout(8, random_legal, break_when_any_done=False)  # warm-up
    started = time.perf_counter()
    env.rollout(args.env_steps, random_legal, break_when_any_done=False)
    seconds = time.perf_counter() - started
    return {"num_envs": num_envs, "steps": num_envs * args.env_steps, "seconds": seconds,
            "steps_per_second": num_envs * args.env_steps / seconds}


def measure_train(args: argparse.Namespace, num_envs: int) -> dict[str, Any]:
    """PPO iterations of the paper preset: frames per second, collection and update split, peak memory."""
    import torch

    from nip_like.cli import compose_config
    from nip_like.experiment import build_trainer

    torch.set_num_threads(args.threads)
    overrides = [*_common(args), f"trainer.num_envs={num_envs}", f"trainer.num_iterations={args.iterations + 1}"]
    config = compose_config(overrides)
    run_dir = Path(args.work_dir) / f"train_{num_envs}"
    trainer = build_trainer(config, run_dir)
    collect = update = 0.0
    trainer.train_iteration()  # warm-up, untimed
    started = time.perf_counter()
    for _ in range(args.iterations):
        metrics = trainer.train_iteration()
        collect += metrics["timers/collect"]
        update += metrics["timers/update"]
    seconds = time.perf_counter() - started
    frames = args.iterations * int(config.trainer.frames_per_batch)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step_flops = _step_flops(trainer)
    steps = args.iterations * trainer.state.gradient_steps // (args.iterations + 1)
    return {
        "num_envs": num_envs,
        "iterations": args.iterations,
        "frames": frames,
        "seconds": seconds,
        "frames_per_second": frames / seconds,
        "seconds_per_iteration": seconds / args.iterations,
        "collect_seconds_per_iteration": collect / args.iterations,
        "update_seconds_per_iteration": update / args.iterations,
        "peak_memory_mib": peak_kib / 1024,
        "gflop_per_step": step_flops / 1e9,
        "update_gflops_per_second": step_flops * steps / 1e9 / update,
    }


def _step_flops(trainer) -> float:
    """Floating-point operations of one optimiser step's loss, forward and backward, on a minibatch."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        losses = trainer.loss_module(trainer.buffer.sample())
        sum(losses.get(key) for key in losses.keys() if key.startswith("loss_")).backward()
    trainer.optimizer.zero_grad(set_to_none=True)
    return float(counter.get_total_flops())


def _in_subprocess(args: argparse.Namespace, kind: str, num_envs: int) -> dict[str, Any]:
    command = [sys.executable, __file__, "--worker", kind, "--worker-envs", str(num_envs), *_forwarded(args)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO_ROOT)
    if result.returncode:
        raise SystemExit(f"error: the {kind} measurement with {num_envs} environments failed: "
                         f"{result.stderr.strip().splitlines()[-1] if result.stderr.strip() else result.returncode}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _forwarded(args: argparse.Namespace) -> list[str]:
    return ["--threads", str(args.threads), "--iterations", str(args.iterations), "--env-steps",
            str(args.env_steps), "--cache-dir", str(args.cache_dir), "--work-dir", str(args.work_dir)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env-sizes", type=int, nargs="+", default=[16, 64, 256, 1024], help="environments for the env-only runs")
    parser.add_argument("--train-sizes", type=int, nargs="+", default=[32, 128, 512], help="environments for the training runs")
    parser.add_argument("--env-steps", type=int, default=64, help="steps per env-only run")
    parser.add_argument("--iterations", type=int, default=3, help="timed PPO iterations per training run")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--cache-dir", default=str(Path("~/.cache/nip_like/datasets").expanduser()), help="dataset cache")
    parser.add_argument("--work-dir", default="/tmp/nip_like_gi_benchmark", help="scratch run folders")
    parser.add_argument("--output", help="also write the results as JSON here")
    parser.add_argument("--worker", choices=["env", "train"], help=argparse.SUPPRESS)
    parser.add_argument("--worker-envs", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if min(args.env_sizes + args.train_sizes) < 1 or args.iterations < 1 or args.env_steps < 1:
        parser.error("sizes, --iterations and --env-steps must be at least 1")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run every measurement, print the tables, return (and optionally write) the results."""
    args = parse_args(argv)
    if args.worker:
        measure = measure_env if args.worker == "env" else measure_train
        print(json.dumps(measure(args, args.worker_envs)))
        return {}
    if Path(args.work_dir).exists():
        import shutil

        shutil.rmtree(args.work_dir)
    results: dict[str, Any] = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
                               "threads": args.threads, "env": [], "train": []}
    print(f"environment alone ({args.env_steps} steps, random legal actions, {args.threads} threads)")
    print(f"{'envs':>6} {'steps/s':>10}")
    for size in args.env_sizes:
        row = _in_subprocess(args, "env", size)
        results["env"].append(row)
        print(f"{size:>6} {row['steps_per_second']:>10.0f}")
    print(f"\nPPO training, paper preset ({args.iterations} timed iterations of 2048 frames, {args.threads} threads)")
    print(f"{'envs':>6} {'frames/s':>10} {'s/iter':>8} {'collect':>8} {'update':>8} {'peak MiB':>9} "
          f"{'GFLOP/step':>10} {'GFLOP/s':>8}")
    for size in args.train_sizes:
        row = _in_subprocess(args, "train", size)
        results["train"].append(row)
        print(f"{size:>6} {row['frames_per_second']:>10.0f} {row['seconds_per_iteration']:>8.2f} "
              f"{row['collect_seconds_per_iteration']:>8.2f} {row['update_seconds_per_iteration']:>8.2f} "
              f"{row['peak_memory_mib']:>9.0f} {row['gflop_per_step']:>10.2f} "
              f"{row['update_gflops_per_second']:>8.1f}")
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
