"""Read run folders: their summary, their config and their metric curves.

A *finished* run folder holds ``summary.json`` (see :doc:`/running`); its
``config.yaml`` gives the hyper-parameters, and with the CSV logger
``metrics/scalars/`` gives the curves. :func:`find_runs` walks one or more
sweep folders and returns every finished run, and the folders of runs that
did not finish, which a report lists but does not use.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import OmegaConf

from nip_like.config import HYPER_PARAMETER_KEYS, without_locations
from nip_like.errors import ReportError
from nip_like.experiment import CONFIG_FILE, SUMMARY_FILE
from nip_like.logging import read_csv_metric

#: Metric whose value at a step is the frames collected so far.
FRAMES_METRIC = "train/frames"

#: Metric whose running sum is the train loop's wall time.
ITERATION_SECONDS_METRIC = "timers/iteration"


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Return a nested dict as ``{"a.b.c": value}`` (lists and empty dicts are values)."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


@dataclass
class Run:
    """One finished run folder.

    Parameters
    ----------
    folder : Path
        The run folder.
    summary : dict
        Its ``summary.json``.
    config : dict
        Its resolved ``config.yaml``, as plain containers.
    """

    folder: Path
    summary: dict[str, Any]
    config: dict[str, Any]
    _curves: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict, repr=False)

    @classmethod
    def load(cls, folder: Path) -> "Run":
        """Read a finished run folder, or fail naming the file that is wrong."""
        folder = Path(folder)
        try:
            summary = json.loads((folder / SUMMARY_FILE).read_text())
        except (OSError, ValueError) as error:
            raise ReportError(f"{folder / SUMMARY_FILE} cannot be read as JSON ({type(error).__name__})") from error
        try:
            config = OmegaConf.to_container(OmegaConf.load(folder / CONFIG_FILE), resolve=True)
        except Exception as error:  # missing file or bad YAML: OmegaConf raises several types
            raise ReportError(f"{folder / CONFIG_FILE} cannot be read ({type(error).__name__})") from error
        if not isinstance(summary, dict) or not isinstance(summary.get("test_metrics"), dict):
            raise ReportError(f"{folder / SUMMARY_FILE} has no test_metrics: it is not a nip_like run summary")
        return cls(folder=folder, summary=summary, config=config)

    # ------------------------------------------------------------ run facts
    @property
    def seed(self) -> int:
        """The run's seed."""
        return int(self.config.get("seed", self.summary.get("seed", 0)))

    @property
    def frames(self) -> int | None:
        """Environment frames collected in training."""
        return self.summary.get("frames")

    @property
    def gradient_steps(self) -> int | None:
        """Optimiser steps taken."""
        return self.summary.get("gradient_steps")

    @property
    def train_seconds(self) -> float | None:
        """Wall time of the train loop, over every session of the run."""
        return self.summary.get("train_seconds")

    @property
    def test_metrics(self) -> dict[str, float]:
        """The final held-out metrics (``test/...``)."""
        return self.summary["test_metrics"]

    @cached_property
    def hyper_parameters(self) -> dict[str, Any]:
        """The flattened hyper-parameters (``trainer.lr`` -> value): what identifies a run.

        As for the run id (:func:`~nip_like.config.without_locations`): where
        caches live, and options added later at their neutral value (a run
        saved before they existed has none), are not among them.
        """
        return flatten(without_locations({key: self.config.get(key) for key in HYPER_PARAMETER_KEYS}))

    def value(self, key: str) -> Any:
        """Return the config value at a dotted key, or ``None`` if it is absent."""
        node: Any = self.config
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        return node

    # --------------------------------------------------------------- curves
    def has_metric(self, metric: str) -> bool:
        """Whether the run logged ``metric`` to CSV."""
        return metric in self._curves or (self.folder / "metrics" / "scalars" / f"{metric}.csv").is_file()

    def curve(self, metric: str) -> tuple[np.ndarray, np.ndarray]:
        """Return a metric's ``(steps, values)`` from the CSV files, in step order.

        Raises
        ------
        ReportError
            If the run has no CSV file for the metric (another logger, or a
            metric that the run does not log).
        """
        if metric not in self._curves:
            try:
                rows = read_csv_metric(self.folder, metric)
            except FileNotFoundError as error:
                raise ReportError(
                    f"run {self.folder} has no metric {metric!r} (no metrics/scalars/{metric}.csv: it needs "
                    f"logger=csv, the default); choose another metric or leave this run out"
                ) from error
            except (OSError, ValueError, IndexError) as error:
                raise ReportError(f"run {self.folder}: metrics/scalars/{metric}.csv is not step,value rows") from error
            rows.sort()
            steps = np.array([step for step, _ in rows], dtype=float)
            values = np.array([value for _, value in rows], dtype=float)
            self._curves[metric] = (steps, values)
        return self._curves[metric]

    def frames_at(self, steps: np.ndarray) -> np.ndarray:
        """Return the frames collected by the end of each of ``steps`` (iterations).

        Step 0, before the first iteration (an evaluation of the initial
        policy), is at 0 frames.
        """
        frame_steps, frames = _from_zero(*self.curve(FRAMES_METRIC))
        return np.interp(steps, frame_steps, frames)

    def seconds_at(self, steps: np.ndarray) -> np.ndarray:
        """Return the train loop's wall time by the end of each of ``steps``.

        It is the running sum of ``timers/iteration`` (each iteration's
        collection, update and evaluation), so it leaves out start-up and the
        final test loop; step 0 is at 0 seconds.
        """
        timer_steps, seconds = self.curve(ITERATION_SECONDS_METRIC)
        return np.interp(steps, *_from_zero(timer_steps, np.cumsum(seconds)))


def _from_zero(steps: np.ndarray, totals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A running total by step, starting from 0 at step 0 if it has no value there."""
    if len(steps) and steps[0] <= 0:
        return steps, totals
    return np.concatenate([[0.0], steps]), np.concatenate([[0.0], totals])


@dataclass
class FoundRuns:
    """The outcome of :func:`find_runs`: finished runs and the folders of unfinished ones."""

    runs: list[Run]
    unfinished: list[Path]


def _is_hidden(name: str) -> bool:
    # Hidden folders (.hydra, .submitit) and the sweep script's _incomplete/ hold no runs to compare.
    return name.startswith((".", "_"))


def find_runs(roots: list[Path]) -> FoundRuns:
    """Find every run folder under ``roots`` (a root may be a run folder itself).

    Parameters
    ----------
    roots : list of Path
        Sweep folders or run folders.

    Raises
    ------
    ReportError
        If a root does not exist, or a summary or config cannot be read.
    """
    runs: list[Run] = []
    unfinished: list[Path] = []
    for root in roots:
        root = Path(root)
        if not root.is_dir():
            raise ReportError(f"{root} is not a folder")
        for folder, subfolders, files in os.walk(root):
            subfolders[:] = sorted(name for name in subfolders if not _is_hidden(name))
            here = Path(folder)
            if SUMMARY_FILE in files:
                runs.append(Run.load(here))
                subfolders[:] = []
            elif CONFIG_FILE in files and ("checkpoints" in subfolders or (here / ".hydra").is_dir()):
                unfinished.append(here)
                subfolders[:] = []
    return FoundRuns(runs=runs, unfinished=unfinished)
