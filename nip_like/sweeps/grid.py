"""Expand a sweep config into jobs, each with a fixed folder and a known length.

A sweep config is a file ``sweep/<name>.yaml`` in the config folder (or in a
folder given with ``--config-dir``). It is composed exactly as
``python -m nip_like +sweep=<name>`` composes it, and its grid
(``hydra.sweeper.params`` plus any sweep overrides such as ``seed=0,1,2``) is
expanded by Hydra's own basic sweeper, so that a grid means the same thing to
Hydra's multirun and to ``scripts/run_sweep.py``.

Each job's folder is ``<sweep root>/<override dirname>``: the job's overrides,
sorted and joined (``seed=0,trainer=dpo``), less the keys the config excludes
(``hydra.job.config.override_dirname.exclude_keys``). It depends on nothing
but the overrides, so running the same command again finds the same folders.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from nip_like.config import CONFIG_DIR, register_configs, run_id
from nip_like.errors import ConfigError, NipLikeError, one_line
from nip_like.validation import validate_schemas

#: Config group holding the sweep configs.
SWEEP_GROUP = "sweep"


@dataclass
class Job:
    """One grid point of a sweep.

    Parameters
    ----------
    overrides : list of str
        The job's overrides, as ``python -m nip_like`` takes them (they start
        with ``+sweep=<name>``).
    name : str
        The folder name, relative to the sweep root.
    folder : Path
        The job's run folder.
    run_id : str or None
        The run id of the job's config (:func:`nip_like.config.run_id`); ``None``
        when the config does not compose.
    test_run : bool
        Whether the job runs in test-run mode (``run.test_run``).
    iterations : int
        Loop iterations the job's trainer declares (train and test loops); 0
        when the config does not compose.
    error : str or None
        Why the job's config does not compose, in one line.
    """

    overrides: list[str]
    name: str
    folder: Path
    run_id: str | None = None
    test_run: bool = False
    iterations: int = 0
    error: str | None = None


@dataclass
class Sweep:
    """A sweep config expanded into jobs.

    Parameters
    ----------
    name : str
        The sweep config's name (``ppo_vs_dpo``).
    root : Path
        The folder holding the job folders.
    jobs : list of Job
        The grid, in Hydra's order.
    config_dir : Path or None
        An extra config folder (``--config-dir``) that the jobs need too.
    """

    name: str
    root: Path
    jobs: list[Job]
    config_dir: Path | None = None

    @property
    def total_iterations(self) -> int:
        """Iterations declared by all the jobs together."""
        return sum(job.iterations for job in self.jobs)


def available_sweeps(config_dir: Path | None = None) -> list[str]:
    """Return the names of the sweep configs in the config folders.

    Files whose name starts with ``_`` (shared settings) are not sweeps.
    """
    folders = [CONFIG_DIR] + ([Path(config_dir)] if config_dir else [])
    names = {path.stem for folder in folders for path in (folder / SWEEP_GROUP).glob("*.yaml")}
    return sorted(name for name in names if not name.startswith("_"))


def _check_sweep_exists(name: str, config_dir: Path | None) -> None:
    if config_dir is not None and not Path(config_dir).is_dir():
        raise ConfigError(f"--config-dir {config_dir} is not a folder")
    if name not in available_sweeps(config_dir):
        where = f"{CONFIG_DIR / SWEEP_GROUP}" + (f" or {Path(config_dir) / SWEEP_GROUP}" if config_dir else "")
        raise ConfigError(f"no sweep config {name!r} in {where}; available sweeps: {available_sweeps(config_dir)}")


def declared_iterations(config: DictConfig, trainer_class: type) -> int:
    """Return the loop iterations that the job's trainer declares, without building it.

    :meth:`nip_like.trainers.base.Trainer.get_total_num_iterations` sums what
    every loop decorated with :func:`~nip_like.trainers.base.attach_progress_bar`
    declares. Building a trainer makes environments and writes into its run
    folder, so it is called here on a bare instance of the trainer class that
    holds only the config (``config``, which ``trainer_config`` and ``test_run`` read), which
    is what the built-in trainers' declarations read. A trainer whose
    declarations need more falls back to the train loop's iterations plus the
    test loop's, as :class:`~nip_like.trainers.rl.TensorDictRlTrainer` declares
    them.

    Parameters
    ----------
    config : DictConfig
        The job's whole config.
    trainer_class : type
        The trainer class it names (``trainer.trainer_type``, looked up in the registry).
    """
    shell = trainer_class.__new__(trainer_class)
    shell.config = config  # what trainer_config and test_run read (nip_like.trainers.base.Trainer)
    try:
        return int(shell.get_total_num_iterations())
    except (AttributeError, KeyError, TypeError):
        if shell.test_run:
            return 2
        trainer = config.trainer
        test = -(-int(trainer.num_test_episodes) // max(int(trainer.test_batch_episodes), 1))
        return int(trainer.num_iterations) + test


def _sweep_root(config: DictConfig, name: str, out: Path | None) -> Path:
    if out is not None:
        return Path(out).absolute()
    unresolved = OmegaConf.to_container(config.hydra.sweep, resolve=False)["dir"]
    if "${now:" in str(unresolved):
        raise ConfigError(
            f"the sweep folder of {name!r} ({unresolved}) changes with the time, so a second run could not find "
            f"the first one's jobs; give --out DIR or set hydra.sweep.dir in configs/sweep/{name}.yaml"
        )
    return Path(str(config.hydra.sweep.dir)).absolute()


def _quote(value: str) -> str:
    """Quote a value for a Hydra command-line override."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def expand_sweep(
    name: str,
    overrides: list[str] | tuple[str, ...] = (),
    out: Path | None = None,
    config_dir: Path | None = None,
) -> Sweep:
    """Compose sweep config ``name`` and expand its grid into jobs.

    Parameters
    ----------
    name : str
        A sweep config (``configs/sweep/<name>.yaml``).
    overrides : list of str
        Extra overrides for every job; sweep overrides (``seed=0,1,2``) extend
        or replace the config's grid, as on Hydra's command line.
    out : Path, optional
        The sweep root; by default the config's ``hydra.sweep.dir``, which must
        not depend on the time.
    config_dir : Path, optional
        An extra config folder, searched before the built-in one.

    Returns
    -------
    Sweep
        The jobs. A job whose config does not compose has ``error`` set; the
        others are unaffected.

    Raises
    ------
    ConfigError
        If the sweep config does not exist, the grid cannot be parsed, the
        sweep folder is not fixed, or two jobs would share a folder.
    """
    _check_sweep_exists(name, config_dir)
    register_configs()
    hydra_overrides = []
    if config_dir is not None:
        hydra_overrides.append(f"hydra.searchpath=[{_quote(Path(config_dir).absolute().as_uri())}]")
    arguments = [f"+{SWEEP_GROUP}={name}", *overrides]
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        try:
            # With the config loader, glob(...) sweeps over config-group options work too.
            parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
            parsed = parser.parse_overrides(arguments)
            fixed = [item.input_line for item in parsed if not item.is_sweep_override()]
            sweep_config = compose("config", overrides=[*hydra_overrides, *fixed], return_hydra_config=True)
            params = sweep_config.hydra.sweeper.params or {}
            grid = [f"{key}={value}" for key, value in params.items()] + arguments
            batches = BasicSweeper.split_arguments(parser.parse_overrides(grid), None)
        except (OmegaConfBaseException, HydraException) as error:
            raise ConfigError(f"sweep {name!r}: {one_line(error)}") from error
        root = _sweep_root(sweep_config, name, out)
        jobs = [_make_job(job_overrides, hydra_overrides, root) for batch in batches for job_overrides in batch]
    _check_unique_folders(jobs)
    return Sweep(name=name, root=root, jobs=jobs, config_dir=Path(config_dir).absolute() if config_dir else None)


def _make_job(overrides: list[str], hydra_overrides: list[str], root: Path) -> Job:
    # A readable fallback name, used only when the config does not compose.
    fallback = ",".join(sorted(item for item in overrides if not item.startswith(f"+{SWEEP_GROUP}=")))
    try:
        config = compose("config", overrides=[*hydra_overrides, *overrides], return_hydra_config=True)
        folder_name = str(config.hydra.job.override_dirname) or "default"
        with open_dict(config):
            del config["hydra"]
        trainer = validate_schemas(config)
        return Job(
            overrides=list(overrides),
            name=folder_name,
            folder=root / folder_name,
            run_id=run_id(config),
            test_run=bool(config.run.test_run),
            iterations=declared_iterations(config, trainer.cls),
        )
    except NipLikeError as error:
        message = "; ".join(str(error).splitlines())  # a config's problems, on the job's one line
    except (OmegaConfBaseException, HydraException) as error:
        message = f"config: {one_line(error)}"
    return Job(overrides=list(overrides), name=fallback, folder=root / fallback, error=message)


def _check_unique_folders(jobs: list[Job]) -> None:
    seen: dict[Path, Job] = {}
    for job in jobs:
        if job.folder in seen:
            raise ConfigError(
                f"two jobs would share the folder {job.folder} ({' '.join(seen[job.folder].overrides)} and "
                f"{' '.join(job.overrides)}); remove the key that tells them apart from "
                f"hydra.job.config.override_dirname.exclude_keys"
            )
        seen[job.folder] = job


def job_command(job: Job, sweep: Sweep, python: str, threads: int) -> list[str]:
    """Return the command that starts ``job`` as a new run in its folder.

    Parameters
    ----------
    job : Job
        The job.
    sweep : Sweep
        Its sweep (for ``--config-dir``).
    python : str
        The Python interpreter.
    threads : int
        ``run.num_threads`` for the job, unless its overrides set it.
    """
    command = [python, "-m", "nip_like"]
    if sweep.config_dir is not None:
        command += ["--config-dir", str(sweep.config_dir)]
    command += [*job.overrides, "hydra.mode=RUN", f"hydra.run.dir={_quote(str(job.folder))}"]
    return command + _run_settings(job.overrides, threads)


def resume_command(job: Job, python: str, threads: int) -> list[str]:
    """Return the command that resumes ``job`` from its folder's last checkpoint."""
    return [python, "-m", "nip_like.resume", str(job.folder), *_run_settings(job.overrides, threads)]


def _run_settings(overrides: list[str], threads: int) -> list[str]:
    given = {item.split("=", 1)[0].lstrip("+~") for item in overrides}
    settings = {"run.progress_bar": "false", "run.num_threads": str(threads)}
    return [f"{key}={value}" for key, value in settings.items() if key not in given]
