"""Build order: config -> trainer entry (resolved once) -> checks -> seed -> protocol -> scenario -> trainer (agents -> warm start -> loss -> optimiser -> envs) -> run."""

from __future__ import annotations

import json
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from omegaconf import DictConfig, OmegaConf

from nip_like import cache_record, distributed, interrupts, run_lock, smoke, start_up
from nip_like.checkpoint import seed_everything, write_text_atomic
from nip_like.folders import check_writable_folder, resume_command
from nip_like.config import run_id
from nip_like.errors import CheckpointError, ConfigError, RunInterrupted
from nip_like.interrupts import StopNow, StopRequested
from nip_like.logging import MetricLogger
from nip_like.trainers.base import Trainer
from nip_like.validation import CheckedConfig, validate

#: Name of the resolved config a run folder keeps (read back by ``nip_like.resume``).
CONFIG_FILE = "config.yaml"
SUMMARY_FILE = "summary.json"

#: Makes a run's progress hook (:attr:`~nip_like.trainers.base.Trainer.on_progress`) from the
#: loop iterations completed in earlier sessions; None when nothing follows the run.
ProgressHookFactory = Callable[[int], Optional[Callable[[int], None]]]


def build_trainer(config: DictConfig, run_dir: Path) -> Trainer:
    """Build every component of the experiment and return its trainer.

    A test run (``run.test_run``) builds the config shrunk by
    :func:`nip_like.smoke.shrink`; its run id stays the given config's. With
    ``run.fresh_cache`` every ``cache_dir`` of the config names a folder in
    the run's own cache folder (:func:`nip_like.cache_record.redirected`):
    the one the run in progress records (:func:`nip_like.cache_record.fresh_root`),
    else ``run_dir/cache``.

    Parameters
    ----------
    config : DictConfig
        The whole experiment config.
    run_dir : Path
        The run folder.
    """
    identity = run_id(config)
    config = smoke.shrink(config)
    if config.run.get("fresh_cache"):
        config = cache_record.redirected(config, cache_record.fresh_root() or Path(run_dir) / cache_record.FRESH_FOLDER)
    checked = _checked_inputs(config)
    if config.run.num_threads:
        torch.set_num_threads(int(config.run.num_threads))
    seed_everything(int(config.seed))
    scenario = checked.build_scenario()
    logger_config = config.logger
    if not distributed.current().is_writer:  # under torchrun only rank 0 writes metrics
        logger_config = OmegaConf.merge(config.logger, {"backends": []})
    logger = MetricLogger(logger_config, run_dir, str(config.name))
    logger.log_hyper_parameters(config, identity)
    trainer = checked.trainer.cls(config, scenario, run_dir, logger)
    start_up.resume_after_start_up()  # built: a program that paused the collector for its start-up resumes it
    return trainer


def preflight(config: DictConfig) -> CheckedConfig:
    """Every check that needs no data, no model weights and no run folder: run before the folder is made.

    First the config, in one pass that reports every problem together
    (:func:`nip_like.validation.validate`: names, keys, types and ranges,
    device and distributed settings, what the trainer requires of the
    scenario, the components' own checks). Then the inputs that can be
    checked without loading them: the scenario's
    (:meth:`~nip_like.scenarios.base.Scenario.preflight`: model folders, their
    tokenizers and chat templates, sizes against a model's context) and the
    trainer's (:meth:`~nip_like.trainers.base.Trainer.preflight`: a writable
    warm-start cache, a text model's server answers). The CLI calls it before
    Hydra makes the run folder, so that a refused command leaves nothing
    behind; :func:`build_trainer` calls it again.

    With ``run.fresh_cache`` the caches are the run folder's, which does not
    exist yet: only the config is checked here, its caches in a folder that
    is never made, so that nothing is read from or written to the shared
    caches; :func:`build_trainer` checks the inputs, into the run's own caches.

    Returns
    -------
    CheckedConfig
        The trainer, resolved once, and the checked sections the scenario is built from.

    Raises
    ------
    ConfigError
        Every problem of the config, one line each; or the first problem of the inputs.
    """
    if config.run.get("fresh_cache"):
        return validate(cache_record.redirected(config, Path(tempfile.gettempdir()) / "nip_like-fresh-cache-unmade"))
    return _checked_inputs(config)


def _checked_inputs(config: DictConfig) -> CheckedConfig:
    """:func:`validate`, then the scenario's and the trainer's preflights (:func:`preflight`, its caches as the config names them)."""
    checked = validate(config)
    checked.scenario.preflight()
    checked.trainer.cls.preflight(config, checked.scenario)
    return checked


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
    write_text_atomic(json.dumps(data, indent=2, sort_keys=True) + "\n", path)


def check_run_folder(run_dir: Path, resume: bool = False) -> None:
    """Refuse a run folder that this command may not use, before anything is written there.

    Only reads the folder. A folder is refused when another process is running
    in it (:mod:`nip_like.run_lock`), when a new run would go into a folder
    that holds a run (one with ``checkpoints/last.pt``), and when resuming a
    folder that is not a run's or whose run finished without a ``last.pt``.

    Raises
    ------
    RunInUseError, ConfigError, CheckpointError
        One line each, naming the folder (and the process that holds it).
    """
    run_dir = Path(run_dir)
    check_writable_folder(run_dir, "the run folder")
    if (run_dir / "checkpoints").is_dir():
        check_writable_folder(run_dir / "checkpoints", "the checkpoints folder")
    run_lock.check_free(run_dir)
    last = run_dir / "checkpoints" / "last.pt"
    if resume and not last.is_file():
        if not (run_dir / CONFIG_FILE).is_file() or (run_dir / SUMMARY_FILE).is_file():
            raise CheckpointError(f"cannot resume {run_dir}: it has no checkpoints/last.pt")
    if not resume and last.is_file():
        raise ConfigError(
            f"{run_dir} already holds a run; resume it with `python -m nip_like.resume {run_dir}` "
            f"or choose another folder"
        )


def _remove_stale_temporaries(run_dir: Path) -> None:
    """Remove what an atomic write killed half-way left behind (``checkpoints/.last.pt.<pid>-<random>.tmp``, ...)."""
    folders = [(run_dir / "checkpoints", ".*.tmp"), (run_dir, f".{SUMMARY_FILE}.*tmp"), (run_dir, f".{cache_record.CACHES_FILE}.*tmp")]
    for path in [path for folder, pattern in folders for path in folder.glob(pattern)]:
        if path.is_file():
            path.unlink(missing_ok=True)


def _interrupted(
    run_dir: Path, trainer: Trainer | None, stop: StopRequested | None, waiting: StopNow | None = None
) -> RunInterrupted:
    """The one-line report of a run stopped by SIGINT or SIGTERM (see :mod:`nip_like.interrupts`)."""
    command = resume_command(run_dir)
    if stop is not None and stop.phase == "train":
        message = f"interrupted at iteration {stop.iteration}; resume with: {command}"
    elif stop is not None:
        message = f"interrupted in the test loop (training finished at iteration {stop.iteration}); resume with: {command}"
    else:  # a second signal, or a first one in a long wait: stopped at once, wherever the run was
        state = getattr(trainer, "state", None)
        where = f"during iteration {state.iteration + 1}" if state is not None else "while setting up"
        if waiting is not None:  # a loop on the way may know the part of the run better than the state's counter
            where = f"{waiting.during or where}, {waiting.where}"
        if (run_dir / "checkpoints" / "last.pt").is_file():
            message = f"interrupted at once {where}; resume from the last checkpoint with: {command}"
        else:
            message = f"interrupted at once {where}, before the first checkpoint; start it again with: {command}"
    return RunInterrupted(message, 128 + (interrupts.requested_signal() or signal.SIGINT))


def run_experiment(
    config: DictConfig,
    run_dir: Path,
    resume: bool = False,
    handle_signals: bool = True,
    progress: ProgressHookFactory | None = None,
) -> dict[str, float]:
    """Run (or resume) an experiment in ``run_dir`` and write its ``summary.json``.

    The cache entries the run reads or writes (datasets, warm starts, model
    conversions) are recorded (:mod:`nip_like.cache_record`): in
    ``caches.json`` as they are used, in the summary's ``"caches"`` at the
    end. With ``run.fresh_cache`` every cache lives in ``run_dir/cache/``.
    Resuming first warns, one line each, of the entries recorded before that
    have changed or are gone.

    Parameters
    ----------
    config : DictConfig
        The whole experiment config.
    run_dir : Path
        The run folder. A new run refuses a folder that already holds one;
        either refuses a folder that another process is running in.
    resume : bool
        Continue from ``run_dir/checkpoints/last.pt``; a run stopped before its
        first checkpoint (a ``config.yaml``, no ``last.pt``, no summary) starts
        again from the beginning in the same folder, its metric rows dropped.
    handle_signals : bool
        Stop at the next safe point on SIGINT or SIGTERM (:mod:`nip_like.interrupts`).
    progress : callable, optional
        Called once the trainer is built (and resumed) with the loop iterations
        already completed; the hook it returns, if any, becomes the trainer's
        ``on_progress``. A sweep hands its own in
        (:func:`nip_like.sweeps.progress.progress_from_environment`).

    Returns
    -------
    dict
        The final test metrics.

    Raises
    ------
    RunInterrupted
        If SIGINT or SIGTERM stopped the run; its message says how to resume.
    """
    run_dir = Path(run_dir)
    if not distributed.current().is_writer:  # another rank of a torchrun run: rank 0 holds the folder
        with interrupts.handle_interrupts(handle_signals):
            return _run_locked(config, run_dir, resume, progress)
    check_run_folder(run_dir, resume)
    with run_lock.holding(run_dir), interrupts.handle_interrupts(handle_signals):
        return _run_locked(config, run_dir, resume, progress)


def _run_locked(
    config: DictConfig, run_dir: Path, resume: bool, progress: ProgressHookFactory | None
) -> dict[str, float]:
    """:func:`run_experiment` once the folder's lock is held."""
    writer = distributed.current().is_writer
    # A run stopped before its first checkpoint starts again from the beginning, resumed or run again in its folder.
    from_scratch = not (run_dir / "checkpoints" / "last.pt").is_file() and (resume or (run_dir / CONFIG_FILE).is_file())
    if writer and resume:
        _remove_stale_temporaries(run_dir)
    elif writer:
        (run_dir / CONFIG_FILE).write_text(OmegaConf.to_yaml(config, resolve=True))
    if from_scratch and writer:
        print(f"No checkpoint in {run_dir} yet: starting the run again from the beginning")
    if resume and writer:  # the cache entries the run used before: a changed or gone one is named, not refused
        cache_record.warn_changes(run_dir)
    fresh = run_dir / cache_record.FRESH_FOLDER if config.run.get("fresh_cache") else None
    started = time.perf_counter()
    trainer = None
    try:
        with cache_record.recording(run_dir / cache_record.CACHES_FILE if writer else None, fresh, keep=resume) as record:
            # Under torchrun rank 0 builds first (it may generate the data caches that the others then read).
            with distributed.current().rank_zero_first():
                trainer = build_trainer(config, run_dir)
            try:
                if resume or from_scratch:
                    if not from_scratch:
                        trainer.load_checkpoint("last")
                    if writer:
                        trainer.logger.truncate_after(0 if from_scratch else trainer.state.iteration)
                hook = progress(sum(trainer.progress_initial.values())) if progress is not None else None
                if hook is not None:  # e.g. a sweep's overall progress bar follows this run
                    trainer.on_progress = hook
                metrics = trainer.train()
            finally:
                trainer.close()
                trainer.logger.close()
                start_up.thaw_start_up()  # another run in this process may follow (a sweep's jobs)
    except StopRequested as stop:
        raise _interrupted(run_dir, trainer, stop) from None
    except StopNow as waiting:
        raise _interrupted(run_dir, trainer, None, waiting) from None
    except KeyboardInterrupt:
        if interrupts.requested_signal() is None:  # not from handle_interrupts' handler
            raise
        raise _interrupted(run_dir, trainer, None) from None
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
        "fresh_cache": fresh is not None,
        "caches": record.as_dicts(),
    }
    if distributed.current().enabled:
        summary["ranks"] = distributed.current().world_size
    from nip_like.scenarios.code_validation.isolation import used as sandbox_isolation  # decided once per process

    if sandbox_isolation() is not None:  # programs ran in the code sandbox here: how they were isolated
        summary["sandbox_isolation"] = sandbox_isolation().summary()
    if writer:
        _write_json_atomic(summary, run_dir / SUMMARY_FILE)
    return metrics


def format_metrics(metrics: dict[str, float]) -> str:
    """Return the metrics as aligned ``name  value`` lines."""
    width = max((len(name) for name in metrics), default=0)
    return "\n".join(f"{name:<{width}}  {value:.4f}" for name, value in sorted(metrics.items()))
