"""Build order: config -> seed -> protocol -> scenario -> agents -> envs -> trainer -> run."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from nip_like.checkpoint import seed_everything
from nip_like.config import check_config_values, check_known_keys, run_id
from nip_like.errors import CheckpointError, ConfigError
from nip_like.logging import MetricLogger
from nip_like.protocols.base import Protocol
from nip_like.registry import PROTOCOLS, SCENARIOS, TRAINERS
from nip_like.scenarios.base import Scenario
from nip_like.sweeps.progress import PROGRESS_FILE_ENV, ProgressFile
from nip_like.trainers.base import Trainer

#: Name of the resolved config a run folder keeps (read back by ``nip_like.resume``).
CONFIG_FILE = "config.yaml"
SUMMARY_FILE = "summary.json"


def build_trainer(config: DictConfig, run_dir: Path) -> Trainer:
    """Build every component of the experiment and return its trainer.

    Parameters
    ----------
    config : DictConfig
        The whole experiment config.
    run_dir : Path
        The run folder.
    """
    check_objective(config)
    check_known_keys(config)
    check_config_values(config)
    _check_device(config.run.device)
    if config.run.num_threads:
        torch.set_num_threads(int(config.run.num_threads))
    seed_everything(int(config.seed))
    scenario = build_scenario(config)
    trainer_class = TRAINERS.get(config.trainer.trainer_type)
    if not issubclass(trainer_class, Trainer):
        raise ConfigError(f"trainer {config.trainer.trainer_type!r} is not a nip_like Trainer subclass")
    logger = MetricLogger(config.logger, run_dir, str(config.name))
    return trainer_class(config, scenario, run_dir, logger)


def check_objective(config: DictConfig) -> None:
    """Check ``trainer.objective`` against the objective schema of the trainer ``config`` names.

    Raises
    ------
    ConfigError
        If the options are another objective's (for a trainer named by dotted
        path with an objective of its own, select its options with
        ``trainer/objective=<name>``), or a key or type is wrong.
    """
    trainer_type = str(config.trainer.trainer_type)
    entry = TRAINERS.entry(trainer_type)
    options = config.trainer.get("objective")
    if entry.schema is None:
        return
    given = OmegaConf.get_type(options) if isinstance(options, DictConfig) else None
    if given is not None and given is not dict and not issubclass(given, entry.schema):
        raise ConfigError(
            f"trainer {trainer_type} takes objective options {entry.schema.__name__}, but trainer.objective holds "
            f"{given.__name__}; select its options with trainer/objective={entry.name}"
        )
    TRAINERS.typed_options(trainer_type, options, "trainer.objective")


def build_protocol(config: DictConfig) -> Protocol:
    """Build the protocol ``config.protocol`` names from its options, checked against its schema.

    Parameters
    ----------
    config : DictConfig
        The whole experiment config.
    """
    name = str(config.protocol.name)
    options = PROTOCOLS.typed_options(name, config.protocol, "protocol")
    return PROTOCOLS.get(name)(**OmegaConf.to_container(options, resolve=True))


def build_scenario(config: DictConfig) -> Scenario:
    """Build the protocol and the scenario that ``config`` names (no data is loaded yet).

    Parameters
    ----------
    config : DictConfig
        The whole experiment config.
    """
    protocol = build_protocol(config)
    name = str(config.scenario.name)
    return SCENARIOS.get(name)(SCENARIOS.typed_options(name, config.scenario, "scenario"), protocol)


def _check_device(device: str) -> None:
    try:
        parsed = torch.device(device)
    except RuntimeError as error:
        raise ConfigError(f"run.device {device!r} is not a torch device (cpu, cuda, cuda:1, ...)") from error
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"run.device is {device!r} but CUDA is not available on this machine; use run.device=cpu")


def git_revision() -> str | None:
    """Return the git commit of the nip_like source tree, if it is a checkout."""
    try:
        result = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() or None if result.returncode == 0 else None


def _write_json_atomic(data: dict[str, Any], path: Path) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(temporary, path)


def run_experiment(config: DictConfig, run_dir: Path, resume: bool = False) -> dict[str, float]:
    """Run (or resume) an experiment in ``run_dir`` and write its ``summary.json``.

    Parameters
    ----------
    config : DictConfig
        The whole experiment config.
    run_dir : Path
        The run folder. A new run refuses a folder that already holds one.
    resume : bool
        Continue from ``run_dir/checkpoints/last.pt``.

    Returns
    -------
    dict
        The final test metrics.
    """
    run_dir = Path(run_dir)
    last = run_dir / "checkpoints" / "last.pt"
    if resume and not last.is_file():
        raise CheckpointError(f"cannot resume {run_dir}: it has no checkpoints/last.pt")
    if not resume and last.is_file():
        raise ConfigError(
            f"{run_dir} already holds a run; resume it with `python -m nip_like.resume {run_dir}` "
            f"or choose another folder"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    if not resume:
        (run_dir / CONFIG_FILE).write_text(OmegaConf.to_yaml(config, resolve=True))
    started = time.perf_counter()
    trainer = build_trainer(config, run_dir)
    try:
        if resume:
            trainer.load_checkpoint("last")
            trainer.logger.truncate_after(trainer.state.iteration)
        if os.environ.get(PROGRESS_FILE_ENV):
            # A sweep's overall progress bar follows this run (see nip_like.sweeps.progress).
            done = sum(trainer.progress_initial.values())
            trainer.on_progress = ProgressFile(Path(os.environ[PROGRESS_FILE_ENV]), done)
        metrics = trainer.train()
    finally:
        trainer.logger.close()
    state = getattr(trainer, "state", None)
    summary = {
        "name": str(config.name),
        "run_id": run_id(config),
        "seed": int(config.seed),
        "trainer_type": str(config.trainer.trainer_type),
        "test_metrics": metrics,
        "frames": getattr(state, "frames", None),
        "iterations": getattr(state, "iteration", None),
        "gradient_steps": getattr(state, "gradient_steps", None),
        "best_eval_metric": getattr(state, "best_metric", None),
        "best_iteration": getattr(state, "best_iteration", None),
        "stopped_early": getattr(state, "stopped_early", None),
        "train_seconds": getattr(state, "train_seconds", None),
        "wall_seconds_this_session": time.perf_counter() - started,
        "resumed": resume,
        "git_revision": git_revision(),
        "device": str(config.run.device),
    }
    _write_json_atomic(summary, run_dir / SUMMARY_FILE)
    return metrics


def format_metrics(metrics: dict[str, float]) -> str:
    """Return the metrics as aligned ``name  value`` lines."""
    width = max((len(name) for name in metrics), default=0)
    return "\n".join(f"{name:<{width}}  {value:.4f}" for name, value in sorted(metrics.items()))
