"""Text that ``scripts/run_sweep.py`` prints: the plan of a sweep and its outcome."""

from __future__ import annotations

from collections import Counter

from nip_like.sweeps.grid import Sweep
from nip_like.sweeps.runner import SweepResult
from nip_like.sweeps.state import JobPlan


def plan_headline(sweep: Sweep, plans: list[JobPlan]) -> str:
    """Return one line: how many jobs, what will happen to them, iterations left."""
    counts = Counter(plan.action for plan in plans)
    parts = [f"{counts[action]} to {action}" for action in ("run", "resume", "restart") if counts[action]]
    if counts["skip"]:
        parts.append(f"{counts['skip']} finished")
    if counts["fail"]:
        parts.append(f"{counts['fail']} failing before they start")
    left = sweep.total_iterations - sum(plan.done for plan in plans)
    return (
        f"Sweep {sweep.name} in {sweep.root}: {len(plans)} jobs ({', '.join(parts) or 'none'}); "
        f"{left} of {sweep.total_iterations} iterations left"
    )


def format_plan(plans: list[JobPlan]) -> str:
    """Return one line per job: action, iterations done of declared, folder name, detail."""
    width = max((len(plan.job.name) for plan in plans), default=6)
    lines = [f"{'action':<8} {'done':>11}  {'job folder':<{width}}  detail"]
    for plan in plans:
        done = f"{plan.done}/{plan.job.iterations}" if plan.job.error is None else "-"
        detail = plan.detail if plan.action != "skip" else ""
        lines.append(f"{plan.action:<8} {done:>11}  {plan.job.name:<{width}}  {detail}".rstrip())
    return "\n".join(lines)


def format_result(sweep: Sweep, result: SweepResult) -> str:
    """Return the closing summary: counts by outcome, then every failure with its reason."""
    counts = Counter(outcome.status for outcome in result.outcomes)
    order = ("finished", "skipped", "failed", "stopped", "not started")
    words = {"skipped": "already finished"}
    parts = [f"{counts[status]} {words.get(status, status)}" for status in order if counts[status]]
    lines = [f"Sweep {sweep.name} in {sweep.root}: {', '.join(parts)}."]
    failed = result.with_status("failed")
    if failed:
        lines.append(f"Failed jobs ({len(failed)}):")
        for outcome in failed:
            job = outcome.plan.job
            log = f" [{job.folder / 'stderr.log'}]" if (job.folder / "stderr.log").is_file() else ""
            lines.append(f"  {job.name}: {outcome.message}{log}")
    if result.interrupted:
        lines.append(
            "Interrupted: stopped jobs keep their last checkpoint; run the same command again to finish the sweep."
        )
    elif failed:
        lines.append("Fix the failing jobs and run the same command again: finished jobs are skipped.")
    return "\n".join(lines)
