"""Metrics -> TorchRL loggers (CSV by default; TensorBoard, W&B, MLflow optional).

Metric names are namespaced (``train/...``, ``eval/...``, ``test/...``,
``loss/...``, ``objective/...``, ``policy/...``, ``timers/...``, ``SPS``) and
follow TRL's names where the quantity is the same. A loss names its own
outputs (:mod:`nip_like.objectives.contract`), so a new loss term needs no
edit here. ``objective/kl`` and ``objective/entropy`` are measured by the
trainer on each collected batch, the same way whatever the objective; a
loss's own entropy estimate is ``policy/entropy``.

Besides scalars, the backends get the resolved config and the run id as
hyper-parameters (:meth:`MetricLogger.log_hyper_parameters`), the final
``test/...`` metrics as summary values (:meth:`MetricLogger.log_summary`) and
transcripts as text (:meth:`MetricLogger.log_text`); every metric also goes to
the job log (:mod:`nip_like.job_log`).
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
from pathlib import Path
from typing import Any, Mapping

from omegaconf import DictConfig, OmegaConf
from torchrl.record.loggers import CSVLogger, Logger

from nip_like.errors import ConfigError, WriteError
from nip_like.job_log import FINAL_PREFIX, JobLog

#: Optional logger backends and the package each needs.
BACKEND_PACKAGES = {"csv": None, "tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}

#: Iterations between two summary lines of the job log when the config does not say (``logger.log_every``).
DEFAULT_LOG_EVERY = 10

#: The hyper-parameter that names the run (:func:`nip_like.config.run_id`), beside the config's keys.
RUN_ID_KEY = "run_id"


def flat_hyper_parameters(config: DictConfig | Mapping[str, Any], run_id: str) -> dict[str, Any]:
    """Return the resolved config as ``{"trainer.optimizer.lr": 0.001, ...}`` plus ``run_id``.

    Values stay numbers, strings and booleans; ``null`` becomes the string
    ``"null"`` and a list its JSON text, the types every backend accepts.
    """
    tree = OmegaConf.to_container(config, resolve=True) if isinstance(config, DictConfig) else dict(config)
    flat: dict[str, Any] = {}

    def visit(node: Any, prefix: str) -> None:
        if isinstance(node, dict) and node:
            for key, item in node.items():
                visit(item, f"{prefix}{key}.")
        elif node is None:
            flat[prefix[:-1]] = "null"
        elif isinstance(node, (bool, int, float, str)):
            flat[prefix[:-1]] = node
        else:
            flat[prefix[:-1]] = json.dumps(node, default=str)

    visit(tree, "")
    flat[RUN_ID_KEY] = run_id
    return flat

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
        self.hyper_parameters: dict[str, Any] = {}
        self.job_log = JobLog(int(config.get("log_every", DEFAULT_LOG_EVERY)))
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
            final = {name: float(value) for name, value in metrics.items() if name.startswith(FINAL_PREFIX)}
            if final:
                self.log_summary(final)
        except OSError as error:
            self._write_failed = True
            reason = error.strerror or " ".join(str(error).split()) or type(error).__name__
            raise WriteError(
                f"could not write the metrics of step {step} under {self.run_dir}: {reason}; the rows of the steps "
                f"before are kept"
            ) from error
        self.job_log.observe(metrics, step)

    def log_hyper_parameters(self, config: DictConfig, run_id: str) -> None:
        """Send the resolved config and the run id to the backends, at the start of a session.

        CSV: ``metrics/texts/hparams0.txt`` (``key: value`` lines);
        TensorBoard: the config as YAML and the run id as texts (``config``,
        ``run_id``), and the hyper-parameters themselves with the final
        metrics (:meth:`log_summary`); W&B: the run's config (nested, plus
        ``run_id``); MLflow: the run's parameters (flattened keys).

        Parameters
        ----------
        config : DictConfig
            The whole experiment config.
        run_id : str
            The run id (:func:`nip_like.config.run_id`).
        """
        self.hyper_parameters = flat_hyper_parameters(config, run_id)
        for backend, logger in self.loggers.items():
            if backend == "csv":
                logger.log_hparams(self.hyper_parameters)
            elif backend == "tensorboard":
                yaml_text = OmegaConf.to_yaml(config, resolve=True)
                # Indented four spaces: TensorBoard renders text as Markdown, and this keeps it a code block.
                logger.experiment.add_text("config", "".join(f"    {line}\n" for line in yaml_text.splitlines()), 0)
                logger.experiment.add_text(RUN_ID_KEY, run_id, 0)
            elif backend == "wandb":
                logger.log_hparams({**OmegaConf.to_container(config, resolve=True), RUN_ID_KEY: run_id})
            else:
                logger.log_hparams({key: str(value) for key, value in self.hyper_parameters.items()})

    def log_summary(self, metrics: Mapping[str, float]) -> None:
        """Record the final test metrics as the run's summary values.

        :meth:`log` calls it with the ``test/...`` metrics, which a run logs
        once, at the end. TensorBoard: the hyper-parameters of
        :meth:`log_hyper_parameters` with these metrics (its HParams
        dashboard); W&B: the run summary. CSV and MLflow keep them as the
        last value of each metric (and ``summary.json``).
        """
        for backend, logger in self.loggers.items():
            if backend == "tensorboard" and self.hyper_parameters:
                from torch.utils.tensorboard.summary import hparams

                writer = logger.experiment.file_writer
                for summary in hparams(self.hyper_parameters, dict(metrics)):
                    writer.add_summary(summary)
                logger.experiment.flush()
            elif backend == "wandb":
                logger.experiment.summary.update(dict(metrics))

    def log_text(self, name: str, text: str, step: int) -> None:
        """Send ``text`` to the backends that have a text channel.

        CSV: ``metrics/texts/<name><step>.txt``; TensorBoard: ``add_text``;
        W&B: ``log_str``; MLflow: the artifact ``<name>_<step>.txt``.
        """
        for backend, logger in self.loggers.items():
            if backend in ("csv", "tensorboard"):
                logger.experiment.add_text(name, text, global_step=step)
            elif backend == "wandb":
                logger.log_str(name, text, step=step)
            else:
                import mlflow

                mlflow.log_text(text, f"{name}_{step}.txt")

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
        if "mlflow" in self.loggers:  # the MLflow run stays active in this process until ended: a next run would fail to start
            import mlflow

            mlflow.end_run()


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
