"""Compare objectives from a sweep's run folders: ``python scripts/compare_objectives.py SWEEP_DIR``.

Writes into ``--out`` (by default ``SWEEP_DIR/report``): ``report.md`` (the
tables and the plots), ``summary.csv``, ``final_metrics.csv``,
``probability_of_improvement.csv``, ``curves_frames.png``,
``curves_wall_time.png`` and ``reward_vs_kl.png``, and prints the Markdown.

Runs are compared within each task (scenario and protocol) at a matched
budget: equal frames and held-out episodes per run; gradient steps are
reported (see ``--gradient-steps``). Runs with different budgets are refused
unless ``--allow-mixed-budgets`` is given. Below 5 runs per objective the
report says so in its first line and in every table: it gives the range of
the runs instead of confidence intervals, and estimates no probability of
improvement. See docs/comparing.rst.

Examples
--------
``python scripts/compare_objectives.py outputs/sweeps/ppo_vs_dpo``
``python scripts/compare_objectives.py outputs/sweeps/objectives --objectives ppo,dpo``
``python scripts/compare_objectives.py runs/a runs/b --threshold 0.95 --gradient-steps within:2``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Use the nip_like of this checkout, whatever is installed.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nip_like.analysis.budgets import ALLOW_FLAG, GradientStepRule  # noqa: E402
from nip_like.analysis.groups import OBJECTIVE_KEYS, TASK_KEYS  # noqa: E402
from nip_like.analysis.report import (  # noqa: E402
    MARKDOWN_FILE,
    ReportOptions,
    build_report,
    format_markdown,
    write_report,
)
from nip_like.analysis.runs import find_runs  # noqa: E402
from nip_like.cli import report_errors  # noqa: E402


def _keys(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(
        prog="python scripts/compare_objectives.py",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("folders", nargs="+", type=Path, help="sweep folders (or run folders) to read")
    parser.add_argument("--out", type=Path, help="where to write the report (default: FIRST_FOLDER/report)")
    parser.add_argument("--metrics", type=_keys, help="final metrics to tabulate, comma-separated (default: all test/)")
    parser.add_argument("--primary-metric", default="test/reward", help="metric of the summary and of P(X > Y)")
    parser.add_argument("--curve-metric", default="eval/reward", help="learning-curve metric of the plots")
    parser.add_argument("--threshold", type=float, default=0.9, help="level to reach on the threshold metric")
    parser.add_argument("--threshold-metric", help="curve the threshold applies to (default: --curve-metric)")
    parser.add_argument("--threshold-mode", default="max", help="max: reach means >=; min: <=")
    parser.add_argument("--reward-metric", default="train/reward", help="y axis of the reward-against-KL plot")
    parser.add_argument("--kl-metric", default="objective/kl", help="x axis of the reward-against-KL plot")
    parser.add_argument(
        "--gradient-steps",
        default="report",
        help="report (default): listed, not required to match; equal; or within:R (medians within a factor R)",
    )
    parser.add_argument(ALLOW_FLAG, action="store_true", help="compare runs whose budgets differ (the report says so)")
    parser.add_argument("--objective-key", type=_keys, default=OBJECTIVE_KEYS, help="config keys naming an objective")
    parser.add_argument("--task-key", type=_keys, default=TASK_KEYS, help="config keys naming a task")
    parser.add_argument("--objectives", type=_keys, help="objectives to keep, in this order (default: all, sorted)")
    parser.add_argument("--reps", type=int, default=10_000, help="bootstrap resamples (default 10000)")
    parser.add_argument("--confidence", type=float, default=0.95, help="coverage of the intervals (default 0.95)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the bootstrap (default 0)")
    parser.add_argument("--no-plots", action="store_true", help="write the tables only")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    args = parse_args(argv)
    with report_errors():
        options = ReportOptions(
            metrics=list(args.metrics) if args.metrics else None,
            primary_metric=args.primary_metric,
            curve_metric=args.curve_metric,
            threshold=args.threshold,
            threshold_metric=args.threshold_metric,
            threshold_mode=args.threshold_mode,
            reward_metric=args.reward_metric,
            kl_metric=args.kl_metric,
            gradient_steps=GradientStepRule.parse(args.gradient_steps),
            allow_mixed_budgets=args.allow_mixed_budgets,
            objective_keys=args.objective_key,
            task_keys=args.task_key,
            objectives=args.objectives,
            reps=args.reps,
            confidence=args.confidence,
            seed=args.seed,
            plots=not args.no_plots,
        )
        report = build_report(find_runs(args.folders), options, roots=args.folders)
        out = args.out or args.folders[0] / "report"
        written = write_report(report, out)
    print(format_markdown(report))
    print(f"Wrote {out / MARKDOWN_FILE} and {len(written) - 1} more files in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
