"""Metrics -> TorchRL loggers (CSV by default; TensorBoard, W&B, MLflow optional).

Metric names are namespaced (``train/...``, ``eval/...``, ``test/...``,
``loss/...``, ``objective/...``, ``policy/...``, ``timers/...``, ``SPS``) and
follow TRL's names where the quantity is the same. A loss names its own
outputs (:mod:`nip_like.objectives.contract`), so a new loss term needs no
edit here. ``objective/kl`` and ``objective/entropy`` are measured by the
trainer on each collected batch, the same way whatever the objective; a
loss's own entropy estimate is ``policy/entropy``.
"""

from __future__ import annotations

import csv
import importlib.util
import os
from pathlib import Path
from typing import Mapping

from omegaconf import DictConfig
from torchrl.record.loggers import CSVLogger, Logger

from nip_like.errors import ConfigError, WriteError

#: Optional logger backends and the package each needs.
BACKEND_PACKAGES = {"csv": None, "tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}

class MetricLogger:
    """Send scalar metrics to one or more TorchRL loggers.

    Parameters
    ----------
    config : DictConfig
        The ``logger`` node of the experiment config.
    run_dir : Path
        The run folder; CSV files go to ``<run_dir>/metrics/scalars/``.
    experiment_name : str
        Name shown by the backends.
    """

    def __init__(self, config: DictConfig, run_dir: Path, experiment_name: str) -> None:
        self.run_dir = Path(run_dir)
        self.loggers: dict[str, Logger] = {}
        self._write_failed = False
        for backend in config.backends:
            if backend not in BACKEND_PACKAGES:
                raise ConfigError(f"unknown logger backend {backend!r}; choose from {sorted(BACKEND_PACKAGES)}")
            package = BACKEND_PACKAGES[backend]
            if package is not None and importlib.util.find_spec(package) is None:
                raise ConfigError(
                    f"logger backend {backend!r} needs the {package!r} package: pip install 'nip_like[{backend}]'"
                )
        for backend in config.backends:
            self.loggers[backend] = self._make(backend, config, experiment_name)

    def _make(self, backend: str, config: DictConfig, experiment_name: str) -> Logger:
        if backend == "csv":
            return CSVLogger(exp_name="metrics", log_dir=str(self.run_dir))
        if backend == "tensorboard":
            from torchrl.record.loggers import TensorboardLogger

            return TensorboardLogger(exp_name="tensorboard", log_dir=str(self.run_dir))
        if backend == "wandb":
            from torchrl.record.loggers import WandbLogger

            return WandbLogger(
                exp_name=experiment_name,
                save_dir=str(self.run_dir),
                project=config.wandb_project,
                mode=config.wandb_mode,
            )
        from torchrl.record.loggers import MLFlowLogger

        uri = config.mlflow_tracking_uri
        if uri is None:
            # A folder inside the run folder, so that the run stays self-contained.
            # MLflow 3 keeps its file store working only when asked to.
            uri = (self.run_dir / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        return MLFlowLogger(exp_name=experiment_name, tracking_uri=uri)

    @property
    def csv_dir(self) -> Path:
        """Folder holding one CSV file per metric (``step,value`` rows)."""
        return self.run_dir / "metrics" / "scalars"

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Log every metric in ``metrics`` at ``step``.

        Raises
        ------
        WriteError
            A backend could not write (a full disk, a file-size limit), in
            one line; the rows of earlier steps are kept, and a resumed run
            drops whatever part of this step was written
            (:meth:`truncate_after`).
        """
        try:
            for name, value in metrics.items():
                for logger in self.loggers.values():
                    logger.log_scalar(name, float(value), step=step)
        except OSError as error:
            self._write_failed = True
            reason = error.strerror or " ".join(str(error).split()) or type(error).__name__
            raise WriteError(
                f"could not write the metrics of step {step} under {self.run_dir}: {reason}; the rows of the steps "
                f"before are kept"
            ) from error

    def log_text(self, name: str, text: str, step: int) -> None:
        """Send ``text`` to the backends that have a text channel.

        CSV: ``metrics/texts/<name><step>.txt``; TensorBoard: ``add_text``;
        W&B: ``log_str`` (a table). MLflow has none here: its runs keep the
        JSONL files of the run folder.
        """
        for backend, logger in self.loggers.items():
            if backend in ("csv", "tensorboard"):
                logger.experiment.add_text(name, text, global_step=step)
            elif backend == "wandb":
                logger.log_str(name, text, step=step)

    def truncate_after(self, step: int, drop: tuple[str, ...] = ("test",)) -> None:
        """Drop CSV rows logged after ``step`` (used when a run resumes).

        A run killed after its last checkpoint has logged iterations that the
        resumed run logs again; keeping only rows up to the checkpoint's step
        leaves each CSV file with one row per step. Metrics under the top-level
        folders in ``drop`` (the final test metrics, which the resumed run
        writes again) lose every row.
        """
        if not self.csv_dir.is_dir():
            return
        for path in self.csv_dir.rglob("*.csv"):
            dropped = path.relative_to(self.csv_dir).parts[0] in drop
            with open(path, newline="") as handle:
                every_row = [row for row in csv.reader(handle) if row]
            # A row cut short by a write that failed (a full disk) is dropped with the step it belonged to.
            rows = [row for row in every_row if _whole_row(row) and int(float(row[0])) <= step and not dropped]
            if rows == every_row:
                continue  # nothing to drop: the file stays as it is, byte for byte
            temporary = path.with_suffix(".csv.tmp")
            with open(temporary, "w", newline="") as handle:
                csv.writer(handle, lineterminator="\n").writerows(rows)  # the line ending of the CSV logger
            os.replace(temporary, path)

    def close(self) -> None:
        """Flush and close the backends.

        After a write that failed (:meth:`log` raised), files that cannot be
        flushed are closed without their unwritten rest, so that the one-line
        error of the failed write is the run's error.
        """
        for logger in self.loggers.values():
            experiment = getattr(logger, "experiment", None)
            for handle in getattr(experiment, "files", {}).values():
                try:
                    handle.close()
                except OSError:
                    if not self._write_failed:
                        raise
            if hasattr(experiment, "finish"):
                experiment.finish()


def _whole_row(row: list[str]) -> bool:
    """Whether a CSV row is a whole ``step,value`` pair (not one cut short by a failed write)."""
    if len(row) != 2:
        return False
    try:
        float(row[0]), float(row[1])
    except ValueError:
        return False
    return True


def read_csv_metric(run_dir: Path, name: str) -> list[tuple[int, float]]:
    """Read one metric's ``(step, value)`` rows from a run folder's CSV files."""
    path = Path(run_dir) / "metrics" / "scalars" / f"{name}.csv"
    with open(path, newline="") as handle:
        return [(int(float(row[0])), float(row[1])) for row in csv.reader(handle) if row]
