"""Group runs by task and objective, and check that a group differs only in its seeds.

A *task* is what the objectives are compared on (by default the scenario and
the protocol); an *objective* is what is compared: by default the objective's
identity (:data:`OBJECTIVE`: the trainer's registered name, plus its variant
when the run's variant is not the schema's default, so ``ppo`` and
``ppo_kl`` are told apart). Both are named by config keys, so that any sweep
axis can play either part: ``objective_keys=("objective", "trainer.optimizer.lr")``
compares each objective at each learning rate.

The runs of one group are the seeds of one configuration: apart from
``seed``, their hyper-parameters must be equal. Otherwise the group would pool
different experiments, and :func:`check_seeds_only` refuses it, naming the
keys that differ.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Sequence

import dataclasses

from nip_like.analysis.runs import Run
from nip_like.errors import ConfigError, ReportError
from nip_like.registry import TRAINERS

#: The pseudo-key naming a run's objective by its identity (see :func:`objective_label`).
OBJECTIVE = "objective"

#: Default config keys naming a run's objective.
OBJECTIVE_KEYS = (OBJECTIVE,)

#: Default config keys naming a run's task.
TASK_KEYS = ("scenario.name", "protocol.name")


@dataclass
class Group:
    """The runs of one objective on one task (one per seed).

    Parameters
    ----------
    task : str
        The task's label (``hidden_bits / prover_verifier``).
    objective : str
        The objective's label (``ppo``).
    runs : list of Run
        Its runs, by seed.
    """

    task: str
    objective: str
    runs: list[Run]

    @property
    def seeds(self) -> list[int]:
        """The seeds of the runs, in order."""
        return [run.seed for run in self.runs]


def objective_label(run: Run) -> str:
    """What distinguishes a run's objective: its trainer's registered name, and its variant if not the default.

    The variant is the field the objective schema names as its
    ``variant_field`` (PPO's ``variant``, DPO's ``loss_type``): ``ppo`` and
    ``ppo_kl``, ``dpo`` and ``dpo_hinge``. A trainer that cannot be imported
    (a user's, elsewhere) is named by its ``trainer_type``.
    """
    trainer_type = str(run.value("trainer.trainer_type"))
    try:
        entry = TRAINERS.entry(trainer_type)
    except ConfigError:
        return trainer_type
    field = getattr(entry.schema, "variant_field", None)
    options = run.value("trainer.objective") or {}
    if field is None or field not in options:
        return entry.name
    default = {item.name: item.default for item in dataclasses.fields(entry.schema)}[field]
    return entry.name if options[field] == default else f"{entry.name}_{options[field]}"


def _label(run: Run, keys: Sequence[str]) -> str:
    values = []
    for key in keys:
        value = objective_label(run) if key == OBJECTIVE else run.value(key)
        if value is None:
            raise ReportError(f"run {run.folder} has no config key {key!r}; check --objective-key / --task-key")
        values.append(str(value))
    if len(keys) == 1:
        return values[0]
    if keys == TASK_KEYS:
        return " / ".join(values)
    return " ".join(f"{key.rsplit('.', 1)[-1]}={value}" for key, value in zip(keys, values))


def group_runs(
    runs: Sequence[Run],
    objective_keys: Sequence[str] = OBJECTIVE_KEYS,
    task_keys: Sequence[str] = TASK_KEYS,
    objectives: Sequence[str] | None = None,
) -> dict[str, list[Group]]:
    """Return the groups of each task: ``{task: [group, ...]}``.

    Parameters
    ----------
    runs : sequence of Run
        Finished runs.
    objective_keys, task_keys : sequence of str
        Config keys whose values name a run's objective and task.
    objectives : sequence of str, optional
        Keep only these objectives, in this order; by default all of them,
        sorted by name.

    Raises
    ------
    ReportError
        If no run is left, or an objective asked for has no run.
    """
    tasks: dict[str, dict[str, list[Run]]] = defaultdict(lambda: defaultdict(list))
    for run in runs:
        tasks[_label(run, task_keys)][_label(run, objective_keys)].append(run)
    if objectives:
        found = {objective for by_objective in tasks.values() for objective in by_objective}
        missing = [objective for objective in objectives if objective not in found]
        if missing:
            raise ReportError(f"no runs of objectives {missing}; the runs have {sorted(found)}")
    result: dict[str, list[Group]] = {}
    for task in sorted(tasks):
        names = [name for name in objectives if name in tasks[task]] if objectives else sorted(tasks[task])
        groups = [Group(task, name, sorted(tasks[task][name], key=lambda run: run.seed)) for name in names]
        if groups:
            result[task] = groups
    if not result:
        raise ReportError("no finished runs to compare (no summary.json under the folders given)")
    return result


def check_seeds_only(groups: dict[str, list[Group]], ignore: Sequence[str] = ()) -> None:
    """Refuse a group whose runs differ in anything but the seed.

    Parameters
    ----------
    groups : dict
        As returned by :func:`group_runs`.
    ignore : sequence of str
        Further keys allowed to differ within a group.

    Raises
    ------
    ReportError
        Naming the group and the keys that differ, and how to split it.
    """
    allowed = {"seed", *ignore}
    for task_groups in groups.values():
        for group in task_groups:
            seeds = group.seeds
            if len(set(seeds)) != len(seeds):
                duplicated = sorted({seed for seed in seeds if seeds.count(seed) > 1})
                folders = [str(run.folder) for run in group.runs if run.seed in duplicated][:2]
                raise ReportError(
                    f"objective {group.objective!r} on {group.task} has more than one run of seed "
                    f"{duplicated[0]} ({', '.join(folders)}); a group holds one run per seed: give one sweep folder "
                    f"per experiment, or tell them apart with --objective-key"
                )
            differing = _differing_keys([run.hyper_parameters for run in group.runs], allowed)
            if differing:
                shown = ", ".join(differing[:5]) + (" ..." if len(differing) > 5 else "")
                raise ReportError(
                    f"the runs of objective {group.objective!r} on {group.task} differ in {shown}, not only in "
                    f"their seed; add the key to --objective-key or --task-key, or report the runs separately"
                )


def _differing_keys(configs: list[dict[str, Any]], allowed: set[str]) -> list[str]:
    keys = sorted(set().union(*configs)) if configs else []
    sentinel = object()
    differing = []
    for key in keys:
        if key in allowed:
            continue
        values = {repr(config.get(key, sentinel)) for config in configs}
        if len(values) > 1:
            differing.append(key)
    return differing
