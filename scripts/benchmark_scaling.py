"""Data-parallel scaling of one run: frames per second and update time with 1 and N ranks (``torchrun``).

Each configuration runs the real command, ``python -m torch.distributed.run
--standalone --nproc_per_node=N -m nip_like <preset> ...``, with one thread per
rank (``run.num_threads=1``), the same global batch for every N (each rank
collects ``1/N`` of it and takes ``1/N`` of each optimiser step's minibatches:
every run accumulates ``lcm(ranks)`` minibatches per optimiser step, so that
each rank count takes the same steps),
evaluation off and a CSV logger. It reads the run's own per-iteration metrics:
``SPS`` (frames of the whole batch per second of the iteration),
``timers/collect`` and ``timers/update``; the first ``--skip`` iterations
(start-up, first allocations) are left out and the rest averaged.

The efficiency with N ranks is ``SPS(N) / (N x SPS(1))``: 1 is perfect
scaling; the target on CPU at N = 2 is at least 0.8. A CPU run is only
meaningful with at least N idle cores (``os.cpu_count()`` and the load at the
start are reported with the figures).

Run it from the repository root::

    python scripts/benchmark_scaling.py                       # paper and lm_quick presets, 1 and 2 ranks
    python scripts/benchmark_scaling.py --presets smoke --iterations 3 --skip 1 --output scaling.json
    python scripts/benchmark_scaling.py --ranks 1 2 4 --device cuda   # one GPU per rank (NCCL)
    python scripts/benchmark_scaling.py --presets lm_quick --fsdp     # also each N > 1 with run.fsdp=true

With ``--fsdp`` every rank count above 1 also runs with its language-model
agents sharded (``run.fsdp=true``, FSDP2), in a row marked ``sharded``
beside the replicated one, with the same steps.

Options after the flags (``key=value``) go to every run, after the preset's
own (see ``PRESET_OVERRIDES``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from nip_like.logging import read_csv_metric  # noqa: E402

#: What each preset's runs add to the preset: a smaller dataset (generated once, in ``{cache}``), no warm start,
#: a test of a few episodes (every rank count must split them).
PRESET_OVERRIDES: dict[str, list[str]] = {
    "paper": ["scenario.num_pairs=2000", "scenario.cache_dir={cache}", "trainer.num_test_episodes=8", "trainer.test_batch_episodes=8"],
    "lm_quick": [
        "scenario.num_lists=4000", "scenario.cache_dir={cache}", "trainer.pretrain.agents=[]", "trainer.num_test_episodes=8",
        "trainer.test_batch_episodes=8",
    ],
    "smoke": ["trainer.num_test_episodes=8", "trainer.test_batch_episodes=8"],
}
#: The per-iteration metrics read back.
METRICS = {"sps": "SPS", "collect_s": "timers/collect", "update_s": "timers/update", "iteration_s": "timers/iteration"}


def run_command(
    preset: str, ranks: int, iterations: int, run_dir: Path, cache: Path, device: str, accumulation: int, extra: list[str]
) -> list[str]:
    """The ``torchrun`` command of one timed run (``accumulation`` minibatches per optimiser step, shared by the ranks)."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", "-m", "nip_like",
        f"preset={preset}", f"trainer.num_iterations={iterations}", "trainer.eval.every=0", "run.num_threads=1",
        f"trainer.optimizer.grad_accumulation_steps={accumulation}",
        "run.progress_bar=false", "run.checkpoint_every=0", "logger=csv", f"run.device={device}",
        *(option.format(cache=cache) for option in PRESET_OVERRIDES.get(preset, [])), *extra, f"hydra.run.dir={run_dir}",
    ]


def time_run(
    preset: str,
    ranks: int,
    iterations: int,
    skip: int,
    root: Path,
    device: str,
    accumulation: int,
    extra: list[str],
    sharded: bool = False,
) -> dict[str, Any]:
    """Run one configuration (``sharded``: with ``run.fsdp=true``); its mean per-iteration figures after ``skip`` iterations."""
    run_dir = root / f"{preset}-{ranks}{'-sharded' if sharded else ''}"
    extra = [*extra, "run.fsdp=true"] if sharded else extra
    command = run_command(preset, ranks, iterations, run_dir, root / "cache", device, accumulation, extra)
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    started = time.perf_counter()
    result = subprocess.run(command, cwd=REPO_ROOT, env=environment, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{preset} with {ranks} rank(s) failed (exit {result.returncode}): {result.stderr.strip()[-2000:]}")
    figures: dict[str, Any] = {"preset": preset, "ranks": ranks, "sharded": sharded, "wall_s": time.perf_counter() - started}
    for name, metric in METRICS.items():
        rows = [value for step, value in read_csv_metric(run_dir, metric) if step > skip]
        if not rows:
            raise SystemExit(f"{preset} with {ranks} rank(s): no {metric} after iteration {skip}; run more --iterations")
        figures[name] = statistics.fmean(rows)
    figures["iterations_timed"] = iterations - skip
    return figures


def efficiencies(rows: list[dict[str, Any]]) -> None:
    """Add ``efficiency`` (SPS(N) / (N x SPS(1))) and ``speedup`` to each row, against its preset's 1-rank row."""
    single = {row["preset"]: row["sps"] for row in rows if row["ranks"] == 1 and not row.get("sharded")}
    for row in rows:
        base = single.get(row["preset"])
        row["speedup"] = row["sps"] / base if base else None
        row["efficiency"] = row["sps"] / (row["ranks"] * base) if base else None


def table(rows: list[dict[str, Any]]) -> str:
    """The figures as an rst list-table-like plain table."""
    header = f"{'preset':<10} {'ranks':>5} {'sharded':>7} {'frames/s':>10} {'collect s':>10} {'update s':>10} {'speedup':>8} {'efficiency':>10}"
    lines = [header, "-" * len(header)]
    for row in rows:
        speedup = f"{row['speedup']:.2f}" if row["speedup"] is not None else "-"
        efficiency = f"{row['efficiency']:.2f}" if row["efficiency"] is not None else "-"
        lines.append(
            f"{row['preset']:<10} {row['ranks']:>5} {'yes' if row.get('sharded') else 'no':>7} {row['sps']:>10.1f} {row['collect_s']:>10.2f} {row['update_s']:>10.2f} "
            f"{speedup:>8} {efficiency:>10}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["paper", "lm_quick"])
    parser.add_argument("--ranks", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--iterations", type=int, default=4, help="iterations of each run")
    parser.add_argument("--skip", type=int, default=1, help="first iterations left out of the means")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--output", type=Path, default=None, help="write the figures as JSON here")
    parser.add_argument("--keep", type=Path, default=None, help="keep the runs' folders here (default: a temporary folder)")
    parser.add_argument("--fsdp", action="store_true", help="also run each rank count above 1 with run.fsdp=true (LM presets)")
    parser.add_argument("overrides", nargs="*", help="key=value options for every run")
    args = parser.parse_args(argv)
    if args.skip >= args.iterations:
        parser.error(f"--skip ({args.skip}) must be below --iterations ({args.iterations})")
    if 1 not in args.ranks:
        parser.error("--ranks must include 1: the efficiency is measured against one rank")
    with tempfile.TemporaryDirectory() as temporary:
        root = args.keep or Path(temporary)
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        # Every rank count takes the same optimiser steps: each step's minibatches are shared by the ranks.
        accumulation = math.lcm(*args.ranks)
        rows = [
            time_run(preset, ranks, args.iterations, args.skip, root, args.device, accumulation, args.overrides, sharded)
            for preset in args.presets
            for ranks in sorted(args.ranks)
            for sharded in ((False, True) if args.fsdp and ranks > 1 else (False,))
        ]
    efficiencies(rows)
    result = {
        "rows": rows,
        "machine": {"cpus": os.cpu_count(), "load_at_start": load, "platform": platform.platform(), "device": args.device},
        "iterations": args.iterations,
        "grad_accumulation_steps": accumulation,
        "skip": args.skip,
        "overrides": args.overrides,
    }
    print(table(rows))
    if args.output is not None:
        args.output.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
