"""``python -m nip_like.resume RUN_DIR [run.key=value ...]``: continue a run from its folder.

The run's own resolved config (``RUN_DIR/config.yaml``) is used as it is; only
run settings (``run.*``) and logger settings (``logger.*``), which do not change
results, may be overridden, for example ``run.device=cuda``. A folder that
another process is still running in is refused (exit status 2, naming the
process); a run stopped before its first checkpoint starts again from the
beginning in its folder. Each cache entry the run used (its ``caches.json``:
a dataset, a warm start, a model conversion) that has changed or is gone
since is named in one ``warning: ...`` line on standard error, and the run
goes on with the cache as it is now (:func:`nip_like.cache_record.warn_changes`).
A run with ``run.fresh_cache`` keeps using its own caches, ``RUN_DIR/cache/``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from nip_like import start_up

if __name__ == "__main__":  # before the imports below: the collector waits until the run is built (nip_like.start_up)
    start_up.pause_for_start_up()

from nip_like import distributed  # noqa: E402 - after the pause above
from nip_like.cli import EXIT_INTERRUPTED, OneLineArgumentParser, report_errors
from nip_like.config import ExperimentConfig
from nip_like.errors import CheckpointError, ConfigError
from nip_like.experiment import CONFIG_FILE, format_metrics, run_experiment
from nip_like.sweeps.progress import progress_from_environment

#: Config sections a resumed run may change.
RESUME_OVERRIDABLE = ("run.", "logger.")


def load_run_config(run_dir: Path, overrides: list[str] | None = None):
    """Load a run folder's config and apply run-setting overrides.

    Parameters
    ----------
    run_dir : Path
        A run folder written by ``python -m nip_like``.
    overrides : list of str
        ``key=value`` items; keys must start with ``run.`` or ``logger.``.
    """
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{run_dir} is not a run folder: it has no {CONFIG_FILE}")
    for item in overrides or []:
        if "=" not in item or not item.startswith(RESUME_OVERRIDABLE):
            raise ConfigError(
                f"cannot override {item!r} when resuming: only run.* and logger.* settings "
                f"(key=value) may change, the hyper-parameters are fixed by the run"
            )
    try:
        stored = OmegaConf.load(path)
    except yaml.YAMLError as error:
        problem = str(getattr(error, "problem", None) or str(error).splitlines()[0])
        raise ConfigError(f"{path} is not valid YAML ({problem}); the run's config cannot be read") from error
    if not stored:
        raise ConfigError(f"{path} is empty; the run's config cannot be read")
    try:
        config = OmegaConf.merge(OmegaConf.structured(ExperimentConfig), stored)
    except OmegaConfBaseException as error:
        raise ConfigError(f"{path}: {str(error).splitlines()[0]}") from error
    for item in overrides or []:
        try:
            config = OmegaConf.merge(config, OmegaConf.from_dotlist([item]))
        except OmegaConfBaseException as error:
            raise ConfigError(f"override {item!r}: {str(error).splitlines()[0]}") from error
    return config


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = OneLineArgumentParser(
        prog="python -m nip_like.resume",
        usage="%(prog)s RUN_DIR [run.key=value | logger.key=value ...]",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("run_dir", type=Path, help="the run folder to continue")
    parser.add_argument("overrides", nargs="*", default=[], help="optional run.* or logger.* settings, key=value")
    args = parser.parse_args(argv)
    start_up.pause_for_start_up()  # until the run is built (nip_like.start_up)
    try:
        with report_errors():
            config = load_run_config(args.run_dir, args.overrides)
            # A sweep's job resumed this way still reports to the sweep's progress bar.
            metrics = run_experiment(config, args.run_dir, resume=True, progress=progress_from_environment)
    except KeyboardInterrupt:  # before the run started (a run reports its own interruption)
        print("interrupted", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    finally:
        start_up.start_up_over()  # the run ended, or never got built
        distributed.shutdown()  # under torchrun (see nip_like.distributed)
    # After shutdown the context keeps this process's rank without joining the group again.
    if config.logger.print_metrics and distributed.current().is_writer:
        print(f"Final test metrics ({args.run_dir}):")
        print(format_metrics(metrics))
    return 0


if __name__ == "__main__":
    sys.exit(main())
