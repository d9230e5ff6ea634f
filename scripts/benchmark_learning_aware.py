"""Train time of the learning-aware trainers against PPO on graph isomorphism (the ``quick`` preset).

For each seed, every trainer (by default :data:`DEFAULT_TRAINERS`: PPO and two learning-aware ones)
trains for the same number of iterations of the same frames (the preset's
1024 per iteration) from the same warm-started agents, on ``--threads``
threads. The trainers of a seed share one process and take their iterations
in turn (the first trainer's iteration 1, the second's, the third's, then
the first's iteration 2, ...), each with its own
random generators (saved and restored around each of its iterations, so each
run draws what it would draw alone): on a machine that other work shares, a
change in the load meets every trainer alike. Each seed runs in a fresh
subprocess. What a run reports:

* **train seconds**: the wall time of the train loop's iterations (what
  ``summary.json``'s ``train_seconds`` counts: collection, advantages, the
  update and the periodic evaluation, 512 episodes every 10 iterations and
  after the last one in the preset), without building the trainer (the warm
  start, cached on disk after the first build of a seed, and the start-up
  checks), the checkpoints of the last iteration and the final test;
* **CPU seconds**: the process's CPU time over the same iterations (steadier
  than wall time on a busy machine);
* the split of the wall time into collection, update (advantages, layout,
  epochs x minibatches) and evaluation;
* **optimiser steps** and the **frames collected**;
* **frames laid out**: the share of the collected frames that the loss's
  layout holds (PPO: every transition; the learning-aware losses: whole
  episodes, so the steps of episodes cut by the batch's ends are left out);
* **frames used**: the share of the collected frames in one epoch's
  minibatches, the mean over iterations (minibatches of exactly
  ``minibatch_size`` items leave the remainder out of each epoch);
* the ratios of the train and CPU seconds to those of the first trainer
  (PPO) of the same seed.

Run it from the repository root::

    python scripts/benchmark_learning_aware.py                       # 20 iterations, seeds 0 and 1 (about 10 min)
    python scripts/benchmark_learning_aware.py --iterations 100 --seeds 0 1 2 3 4   # the preset's full length
    python scripts/benchmark_learning_aware.py --override pola:trainer.objective.truncated_episodes=true

``--override`` passes a Hydra override to every run (after the preset's), or,
prefixed with a trainer's name and a colon, to that trainer's runs only (an
objective option that PPO does not have); ``--output`` also writes every
figure as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from statistics import median
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent


#: The trainers compared by default, PPO (the baseline) first.
DEFAULT_TRAINERS = ("ppo",
                    "pola", "pspg")

def _overrides_of(overrides: list[str], trainer: str) -> list[str]:
    """The overrides for ``trainer``: every one without a ``name:`` prefix, and those prefixed with its name."""
    mine = []
    for item in overrides:
        name, colon, rest = item.partition(":")
        if not colon or "=" in name:  # no prefix (a value may hold a colon)
            mine.append(item)
        elif name == trainer:
            mine.append(rest)
    return mine


def _generators() -> tuple:
    import numpy as np
    import torch

    return torch.get_rng_state(), np.random.get_state(), random.getstate()


def _set_generators(state: tuple) -> None:
    import numpy as np
    import torch

    torch.set_rng_state(state[0])
    np.random.set_state(state[1])
    random.setstate(state[2])


def measure(args: argparse.Namespace, seed: int) -> list[dict[str, Any]]:
    """Train every trainer of ``args.trainers`` on ``seed`` in this process, iterations in turn; their figures."""
    import torch

    from nip_like.cli import compose_config
    from nip_like.experiment import build_trainer

    torch.set_num_threads(args.threads)
    runs = []
    for name in args.trainers:
        overrides = [
            f"preset={args.preset}",
            f"trainer={name}",
            f"seed={seed}",
            f"trainer.num_iterations={args.iterations}",
            f"run.num_threads={args.threads}",
            "run.progress_bar=false",
            "logger=none",
            *_overrides_of(args.override, name),
        ]
        config = compose_config(overrides)
        run_dir = Path(args.work_dir) / f"{name}_seed{seed}"
        shutil.rmtree(run_dir, ignore_errors=True)
        started = time.perf_counter()
        trainer = build_trainer(config, run_dir)  # seeds the generators first, as a run of its own does
        runs.append({"name": name, "config": config, "trainer": trainer, "build": time.perf_counter() - started,
                     "generators": _generators(), "records": [], "wall": 0.0, "cpu": 0.0})
    for iteration in range(1, args.iterations + 1):
        for run in runs:
            trainer, eval_config = run["trainer"], run["config"].trainer.eval
            _set_generators(run["generators"])
            wall, cpu = time.perf_counter(), time.process_time()
            # One iteration of TensorDictRlTrainer._run_train_loop: train, then evaluate when it is due.
            with ExitStack() as stack:
                trainer._build_train_context(stack)
                metrics = trainer.train_iteration()
                trainer.state.iteration += 1
                if eval_config.every and (iteration % eval_config.every == 0 or iteration == args.iterations):
                    with ExitStack() as test:
                        trainer._build_test_context(test, eval_config.deterministic)
                        metrics.update(trainer.evaluate())
                    trainer._track_best(metrics)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            trainer.state.train_seconds += wall
            run["wall"] += wall
            run["cpu"] += cpu
            run["generators"] = _generators()
            run["records"].append(metrics)
    return [_figures(run, seed) for run in runs]


def _figures(run: dict[str, Any], seed: int) -> dict[str, Any]:
    trainer, config, records = run["trainer"], run["config"], run["records"]
    collect = sum(record.get("timers/collect", 0.0) for record in records)
    update = sum(record.get("timers/update", 0.0) for record in records)
    minibatch_size = int(config.trainer.minibatch_size)
    frames_per_batch = int(config.trainer.frames_per_batch)
    laid_out = [_laid_out(record, frames_per_batch) for record in records]
    used = [_used(record, frames_per_batch, minibatch_size) for record in records]
    metric = config.trainer.eval.metric
    return {
        "trainer": run["name"],
        "seed": seed,
        "iterations": trainer.state.iteration,
        "build_seconds": run["build"],
        "train_seconds": run["wall"],
        "cpu_seconds": run["cpu"],
        "collect_seconds": collect,
        "update_seconds": update,
        "eval_seconds": run["wall"] - collect - update,
        "optimizer_steps": trainer.state.gradient_steps,
        "frames": trainer.state.frames,
        "frames_laid_out": sum(laid_out) / len(laid_out) if laid_out else 0.0,
        "frames_used": sum(used) / len(used) if used else 0.0,
        "best_eval": max((record[metric] for record in records if metric in record), default=None),
    }


def _laid_out(record: dict[str, float], frames_per_batch: int) -> float:
    """The share of an iteration's collected frames in the loss's layout."""
    if "train/frames_laid_out" in record:
        return record["train/frames_laid_out"]
    if "learning_aware/episodes" in record:  # whole episodes, from a version without the metric
        return record["train/episodes"] * record["train/episode_length"] / frames_per_batch
    return record["train/layout_items"] / frames_per_batch  # transitions


def _used(record: dict[str, float], frames_per_batch: int, minibatch_size: int) -> float:
    """The share of an iteration's collected frames in one epoch's minibatches."""
    if "train/frames_used" in record:
        return record["train/frames_used"]
    # Minibatches of exactly minibatch_size items, the rest left out (for episodes, the expected share).
    items = record["train/layout_items"]
    drawn = (items // min(minibatch_size, items)) * min(minibatch_size, items) if items else 0
    return _laid_out(record, frames_per_batch) * drawn / items if items else 0.0


def _in_subprocess(args: argparse.Namespace, seed: int) -> list[dict[str, Any]]:
    command = [sys.executable, __file__, "--worker", str(seed), *_forwarded(args)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO_ROOT)
    if result.returncode:
        lines = result.stderr.strip().splitlines()
        raise SystemExit(f"error: the runs of seed {seed} failed: {lines[-1] if lines else result.returncode}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _forwarded(args: argparse.Namespace) -> list[str]:
    forwarded = ["--trainers", *args.trainers, "--iterations", str(args.iterations), "--threads", str(args.threads),
                 "--preset", args.preset, "--work-dir", str(args.work_dir)]
    return forwarded + [f"--override={item}" for item in args.override]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trainers", nargs="+", default=list(DEFAULT_TRAINERS), help="trainers; the first is the baseline")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="seeds (each trainer runs each)")
    parser.add_argument("--iterations", type=int, default=20, help="train iterations per run")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument("--preset", default="quick", help="the preset every run starts from")
    parser.add_argument("--override", action="append", default=[],
                        help="a Hydra override for every run, or TRAINER:override for one trainer's (repeatable)")
    parser.add_argument("--work-dir", default="/tmp/nip_like_learning_aware_benchmark", help="scratch run folders")
    parser.add_argument("--output", help="also write the results as JSON here")
    parser.add_argument("--worker", type=int, metavar="SEED", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.iterations < 1 or args.threads < 1:
        parser.error("--iterations and --threads must be at least 1")
    return args


def summarise(runs: list[dict[str, Any]], baseline: str) -> list[dict[str, Any]]:
    """Per trainer: the medians over seeds, and the ratios to the baseline's runs of the same seeds."""
    reference = {run["seed"]: run for run in runs if run["trainer"] == baseline}
    rows = []
    for name in dict.fromkeys(run["trainer"] for run in runs):
        mine = [run for run in runs if run["trainer"] == name]
        row = {"trainer": name, "runs": len(mine)}
        for key in ("train_seconds", "cpu_seconds", "collect_seconds", "update_seconds", "eval_seconds",
                    "optimizer_steps", "frames", "frames_laid_out", "frames_used"):
            row[key] = median(run[key] for run in mine)
        paired = [run for run in mine if run["seed"] in reference]
        for key in ("train_seconds", "cpu_seconds"):
            ratios = [run[key] / reference[run["seed"]][key] for run in paired]
            row[f"{key}_ratio"] = median(ratios) if ratios else None
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run every trainer on every seed, print the tables, return (and optionally write) the results."""
    args = parse_args(argv)
    if args.worker is not None:
        print(json.dumps(measure(args, args.worker)))
        return {}
    results: dict[str, Any] = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "threads": args.threads,
        "iterations": args.iterations,
        "overrides": [f"preset={args.preset}", *args.override],
        "runs": [],
    }
    print(f"{', '.join(args.trainers)} on the {args.preset} preset, {args.iterations} iterations, "
          f"{args.threads} thread(s), seeds {' '.join(map(str, args.seeds))}")
    header = (f"{'trainer':<8} {'seed':>4} {'train s':>8} {'CPU s':>8} {'collect':>8} {'update':>8} {'eval':>7} "
              f"{'steps':>6} {'frames':>7} {'laid out':>8} {'used':>6}")
    print(header)
    for seed in args.seeds:
        for run in _in_subprocess(args, seed):
            results["runs"].append(run)
            print(f"{run['trainer']:<8} {seed:>4} {run['train_seconds']:>8.1f} {run['cpu_seconds']:>8.1f} "
                  f"{run['collect_seconds']:>8.1f} {run['update_seconds']:>8.1f} {run['eval_seconds']:>7.1f} "
                  f"{run['optimizer_steps']:>6} {run['frames']:>7} {run['frames_laid_out']:>8.3f} "
                  f"{run['frames_used']:>6.3f}", flush=True)
    results["summary"] = summarise(results["runs"], args.trainers[0])
    print(f"\nmedians over seeds; ratios to {args.trainers[0]} of the same seed (median)")
    print(f"{'trainer':<8} {'train s':>8} {'x train':>8} {'CPU s':>8} {'x CPU':>7} {'steps':>6} {'laid out':>8} {'used':>6}")
    for row in results["summary"]:
        ratio = lambda value: f"{value:.2f}" if value is not None else "-"  # noqa: E731
        print(f"{row['trainer']:<8} {row['train_seconds']:>8.1f} {ratio(row['train_seconds_ratio']):>8} "
              f"{row['cpu_seconds']:>8.1f} {ratio(row['cpu_seconds_ratio']):>7} {row['optimizer_steps']:>6.0f} "
              f"{row['frames_laid_out']:>8.3f} {row['frames_used']:>6.3f}")
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
