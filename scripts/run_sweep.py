"""Run a sweep config's grid, restartably: ``python scripts/run_sweep.py SWEEP [overrides]``.

Each grid point of ``configs/sweep/<SWEEP>.yaml`` runs as its own
``python -m nip_like`` process in ``<sweep root>/<its overrides>/`` (the
folders Hydra's multirun uses for the same config), ``--jobs`` at a time, each
on one thread. Running the same command again skips finished jobs, resumes
interrupted ones from their last checkpoint and restarts those that stopped
before their first checkpoint (their old folder is moved to
``<sweep root>/_incomplete/``). A failing job does not stop the others; the
failures are listed at the end, and the exit status is 1 if there were any.

Examples
--------
``python scripts/run_sweep.py ppo_vs_dpo --jobs 2``             the PPO-vs-DPO grid
``python scripts/run_sweep.py ppo_vs_dpo --dry-run``            what would run, and what is done
``python scripts/run_sweep.py ppo_vs_dpo seed=0,1,2,3,4,5,6,7``  a larger grid
``python scripts/run_sweep.py mine --config-dir my_configs``    ``my_configs/sweep/mine.yaml``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Run the nip_like of this checkout, whatever is installed.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nip_like.cli import report_errors  # noqa: E402
from nip_like.sweeps.grid import expand_sweep  # noqa: E402
from nip_like.sweeps.listing import format_plan, format_result, plan_headline  # noqa: E402
from nip_like.sweeps.runner import SweepRunner  # noqa: E402
from nip_like.sweeps.state import inspect_job  # noqa: E402

#: Exit status after an interruption (as a shell reports SIGINT).
EXIT_INTERRUPTED = 130


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(
        prog="python scripts/run_sweep.py",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("sweep", help="a sweep config: configs/sweep/<SWEEP>.yaml (or in --config-dir)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every job; key=a,b,c sweeps over values")
    parser.add_argument("-j", "--jobs", type=int, default=1, help="jobs running at once (default 1)")
    parser.add_argument("--out", type=Path, help="the sweep folder (default: the config's hydra.sweep.dir)")
    parser.add_argument("--config-dir", type=Path, help="an extra config folder holding sweep/<SWEEP>.yaml")
    parser.add_argument("--threads-per-job", type=int, default=1, help="threads of each job (default 1)")
    parser.add_argument("--dry-run", action="store_true", help="list the jobs and what would happen; run nothing")
    parser.add_argument("--no-progress-bar", action="store_true", help="do not draw the overall progress bar")
    # Overrides may come before or after the options.
    args = parser.parse_intermixed_args(argv)
    if args.jobs < 1 or args.threads_per_job < 1:
        parser.error("--jobs and --threads-per-job must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    args = parse_args(argv)
    with report_errors():
        sweep = expand_sweep(args.sweep, args.overrides, out=args.out, config_dir=args.config_dir)
        plans = [inspect_job(job) for job in sweep.jobs]
    print(plan_headline(sweep, plans), flush=True)
    if args.dry_run:
        print(format_plan(plans))
        return 0
    runner = SweepRunner(sweep, plans, args.jobs, args.threads_per_job, progress_bar=not args.no_progress_bar)
    result = runner.run()
    print(format_result(sweep, result))
    if result.interrupted:
        return EXIT_INTERRUPTED
    return 1 if result.with_status("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
