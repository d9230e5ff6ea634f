"""Matched budgets: what a fair comparison of objectives requires, and the check.

On each task, runs are compared at a *matched budget*:

frames (required)
    Every run collected the same number of environment frames in training
    (``frames`` in ``summary.json``, that is ``num_iterations x
    frames_per_batch`` for a run that was not stopped early). Frames are the
    sample budget of online RL, the cost that both objectives pay in the
    same currency.
held-out episodes (required)
    Every run's final metrics come from the same number of test episodes
    (``test/episodes``). With equal seeds they are the same episodes, since
    the test generator is seeded from the run's seed alone.
gradient steps (a rule, ``report`` by default)
    Objectives spend a batch differently: PPO takes
    ``epochs x batch / minibatch`` steps per iteration, DPO one per minibatch
    of the preference pairs it keeps, which vary. Requiring equal steps would
    change one objective's own settings, so by default they are *reported*
    (median and range per objective) next to the results. ``equal`` requires
    every run to take the same number; ``within:R`` requires the largest
    objective median to be at most ``R`` times the smallest.

A comparison that breaks a requirement is refused with one line naming what
differs, unless the caller allows mixed budgets; the report then says in
words that the budgets were not matched.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nip_like.analysis.groups import Group
from nip_like.errors import ReportError

#: The flag that lets a report compare runs of different budgets.
ALLOW_FLAG = "--allow-mixed-budgets"


@dataclass(frozen=True)
class GradientStepRule:
    """How gradient steps must match: ``report``, ``equal`` or ``within`` a ratio.

    Parameters
    ----------
    kind : str
        ``report`` (not required to match, only reported), ``equal`` or ``within``.
    ratio : float
        For ``within``: the largest allowed ratio between the objectives'
        median gradient steps (at least 1).
    """

    kind: str = "report"
    ratio: float = 1.0

    @classmethod
    def parse(cls, text: str) -> "GradientStepRule":
        """Parse ``report``, ``equal`` or ``within:R``.

        Raises
        ------
        ReportError
            On any other text.
        """
        if text in ("report", "equal"):
            return cls(text)
        if text.startswith("within:"):
            try:
                ratio = float(text.split(":", 1)[1])
            except ValueError:
                ratio = float("nan")
            if ratio >= 1.0:
                return cls("within", ratio)
        raise ReportError(f"--gradient-steps must be 'report', 'equal' or 'within:R' with R >= 1, got {text!r}")

    def describe(self) -> str:
        """The rule in words."""
        if self.kind == "report":
            return "reported, not required to match"
        if self.kind == "equal":
            return "required to be equal"
        return f"required to be within a factor {self.ratio:g} between objectives (medians)"


def _by_objective(groups: list[Group], values: dict[int, object]) -> str:
    parts = []
    for group in groups:
        distinct = sorted({values[id(run)] for run in group.runs}, key=str)
        parts.append(f"{group.objective}: {', '.join(_number(value) for value in distinct)}")
    return "; ".join(parts)


def _number(value: object) -> str:
    return f"{value:,}" if isinstance(value, int) else str(value)


def median_steps(group: Group) -> float:
    """The median gradient steps of a group's runs (``nan`` when unknown)."""
    steps = [run.gradient_steps for run in group.runs if run.gradient_steps is not None]
    return float(np.median(steps)) if steps else float("nan")


def check_budgets(task: str, groups: list[Group], rule: GradientStepRule, allow_mixed: bool = False) -> list[str]:
    """Check that the runs of one task were given matched budgets.

    Parameters
    ----------
    task : str
        The task's label, for messages.
    groups : list of Group
        The task's groups (one per objective).
    rule : GradientStepRule
        How gradient steps must match.
    allow_mixed : bool
        Report a mismatch in words instead of refusing.

    Returns
    -------
    list of str
        Sentences for the report: what was matched and what was not.

    Raises
    ------
    ReportError
        On a mismatch when ``allow_mixed`` is false; one line, naming the
        values per objective and the flag that overrides the check.
    """
    runs = [run for group in groups for run in group.runs]
    frames = {id(run): run.frames for run in runs}
    episodes = {id(run): run.test_metrics.get("test/episodes") for run in runs}
    steps = {id(run): run.gradient_steps for run in runs}
    problems = []  # (what differs, how to match it)
    if len(set(frames.values())) > 1:
        problems.append(
            (
                f"frames per run ({_by_objective(groups, frames)})",
                "equal trainer.num_iterations and trainer.frames_per_batch (as the ready sweeps set)",
            )
        )
    if len(set(episodes.values())) > 1:
        problems.append(
            (f"held-out test episodes ({_by_objective(groups, episodes)})", "equal trainer.num_test_episodes")
        )
    if rule.kind == "equal" and len(set(steps.values())) > 1:
        problems.append(
            (
                f"gradient steps per run ({_by_objective(groups, steps)}), which --gradient-steps equal requires",
                "epochs and minibatch sizes that give equal steps, or a looser --gradient-steps",
            )
        )
    if rule.kind == "within":
        medians = [median_steps(group) for group in groups]
        if min(medians) <= 0 or max(medians) / min(medians) > rule.ratio:
            shown = "; ".join(f"{group.objective}: {median:,.0f}" for group, median in zip(groups, medians))
            problems.append(
                (
                    f"median gradient steps ({shown}) by more than the factor {rule.ratio:g} of --gradient-steps",
                    "epochs and minibatch sizes that bring the steps closer, or a looser --gradient-steps",
                )
            )
    differences = " and in ".join(difference for difference, _ in problems)
    if problems and not allow_mixed:
        remedies = "; ".join(remedy for _, remedy in problems)
        raise ReportError(
            f"the runs on {task} differ in {differences}: objectives are compared at a matched budget, so rerun "
            f"them with {remedies}, or pass {ALLOW_FLAG} to compare them anyway"
        )
    notes = []
    if problems:
        notes.append(
            f"Budgets are NOT matched ({ALLOW_FLAG}): the runs differ in {differences}. "
            f"Differences between objectives mix the effect of the objective with that of the budget."
        )
    else:
        frame_value = next(iter(frames.values()))
        episode_value = next(iter(episodes.values()))
        notes.append(
            f"Matched budget: every run collected {_number(frame_value)} frames and was tested on "
            f"{_number(int(episode_value)) if episode_value is not None else 'the same'} held-out episodes."
        )
    step_text = "; ".join(f"{group.objective}: {_steps_range(group)}" for group in groups)
    notes.append(f"Gradient steps per run ({rule.describe()}): {step_text}.")
    return notes


def _steps_range(group: Group) -> str:
    steps = [run.gradient_steps for run in group.runs if run.gradient_steps is not None]
    if not steps:
        return "unknown"
    if min(steps) == max(steps):
        return f"{steps[0]:,}"
    return f"median {np.median(steps):,.0f} (range {min(steps):,} to {max(steps):,})"
