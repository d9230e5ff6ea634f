"""Helpers shared by the command-line entry points."""

from __future__ import annotations

import argparse
import re
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, NoReturn, TypeVar

from hydra import initialize_config_dir
from hydra.experimental.callback import Callback
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from nip_like.composition import compose_from_kept_groups
from nip_like.config import CONFIG_DIR
from nip_like.errors import ConfigError, NipLikeError, RunInterrupted, SweepJobError, one_line

if TYPE_CHECKING:
    from nip_like.registry import Registry

#: Exit status of a run stopped by bad input.
EXIT_BAD_INPUT = 2
#: Exit status of a command stopped by Ctrl-C (128 + SIGINT, as a shell reports it).
EXIT_INTERRUPTED = 130

T = TypeVar("T")


class OneLineArgumentParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, ``error: ...``, and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"error: {message}\n")


def run_dataset_command(path: Path, load: Callable[[], T], summarise: Callable[[T], list[str]]) -> int:
    """Load or generate a dataset cached at ``path`` for a script, say what happened, return the exit status.

    Prints ``cache: <path> (loaded)`` or ``(generated)`` (loaded: the file was
    there before and was not rewritten), the lines of ``summarise(dataset)``
    and ``wall time: <seconds> s`` of ``load()``; on stderr, each warning that
    ``load()`` raised as ``warning: ...`` (a rebuilt cache). A
    :class:`NipLikeError` from ``load()`` prints one line ``error: ...``
    instead and gives status 2.

    Parameters
    ----------
    path : Path
        The cache file that ``load`` reads or writes.
    load : callable
        Loads the dataset from ``path`` or generates and caches it.
    summarise : callable
        Returns the lines that describe the dataset.
    """
    before = path.stat().st_mtime_ns if path.exists() else None
    try:
        start = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dataset = load()
        elapsed = time.perf_counter() - start
    except NipLikeError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for warning in caught:
        print(f"warning: {warning.message}", file=sys.stderr)
    loaded = before is not None and before == path.stat().st_mtime_ns
    print(f"cache: {path} ({'loaded' if loaded else 'generated'})")
    for line in summarise(dataset):
        print(line)
    print(f"wall time: {elapsed:.1f} s")
    return 0


def _config_dir_flags(arguments: list[str]) -> tuple[list[Path], list[str]]:
    """The folders of the ``--config-dir`` (``-cd``) flags of a command line, and the other arguments."""
    folders: list[Path] = []
    rest: list[str] = []
    items = iter(arguments)
    for item in items:
        if item in ("--config-dir", "-cd"):
            folder = next(items, None)
            if folder is not None:
                folders.append(Path(folder))
        elif item.startswith("--config-dir="):
            folders.append(Path(item.split("=", 1)[1]))
        else:
            rest.append(item)
    return folders, rest


def _search_path_entries(arguments: list[str]) -> list[str]:
    """The entries of a ``hydra.searchpath=[...]`` override of a command line (``file://...``, ``pkg://...``)."""
    entries: list[str] = []
    for item in arguments:
        if item.lstrip("+").startswith("hydra.searchpath="):
            entries += [entry.strip().strip("'\"") for entry in item.split("=", 1)[1].strip("[]").split(",")]
    return [entry for entry in entries if entry]


def _config_dirs(arguments: list[str]) -> list[Path] | None:
    """The config folders a command line composes from: the package's, ``--config-dir`` and file search paths.

    ``None`` when a search path is not a plain folder (a ``pkg://`` entry): its
    options cannot be listed here.
    """
    flagged, rest = _config_dir_flags(arguments)
    folders = [CONFIG_DIR, *flagged]
    for entry in _search_path_entries(rest):
        if not entry.startswith("file://"):
            return None
        folders.append(Path(entry[len("file://"):]))
    return folders


def _is_dotted(value: str) -> bool:
    """Whether an override's value names a class by dotted path (one value, not a sweep or an interpolation)."""
    return "." in value and not any(mark in value for mark in ",${}[]'\"")


def check_arguments_text(arguments: list[str]) -> None:
    """Refuse, in one line, a command-line argument holding a byte that is not UTF-8 text.

    Such a byte reaches Python as a lone surrogate (``\\udce9``), which
    tokenizers and files cannot take: it would fail deep inside a run (a
    fine-tune job, say); here it is named, with its field, before anything is
    built.
    """
    for argument in arguments:
        try:
            argument.encode("utf-8")
        except UnicodeEncodeError as error:
            key = argument.partition("=")[0].encode("utf-8", "backslashreplace").decode()
            raise ConfigError(
                f"{key.lstrip('+~')}: the command-line argument holds a byte that is not UTF-8 text at character "
                f"{error.start}; give it as UTF-8"
            ) from None


def check_group_options(arguments: list[str]) -> None:
    """Refuse ``group=option`` for a config group that has no such option, listing the group's options.

    The options are the YAML files of the group in the package's config folder
    and in any ``--config-dir`` or ``hydra.searchpath`` folder of the command
    line. Hydra's own message would also list the schema nodes the registries
    store (``nip_schema``, ...), which are not options to choose. A dotted
    path chosen in a group whose choice may name a class (``scenario=my_module.MyScenario``)
    is left to :func:`select_user_components`.

    Raises
    ------
    ConfigError
        Naming the group, the option and the options there are.
    """
    check_arguments_text(arguments)
    from nip_like.registry import REGISTRIES

    folders = _config_dirs(arguments)
    if folders is None:
        return
    class_groups = {registry.config_group: registry for registry in REGISTRIES.values() if registry.group_names_class}
    for item in arguments:
        key, sep, value = item.partition("=")
        group = key.lstrip("+")
        if not sep or "." in group or key.startswith(("~", "-")) or "," in value or value == "null":
            continue
        if group in class_groups and _is_dotted(value):
            continue
        options = _group_options(group, folders)
        if options and value not in options:
            own = f" or {class_groups[group].own_class_hint()}" if group in class_groups else ""
            raise ConfigError(f"unknown {group} {value!r}; choose one of {options}{own}")


def _group_options(group: str, folders: list[Path]) -> list[str]:
    """The options of config group ``group``: the names of its YAML files in ``folders``, sorted."""
    return sorted(
        {
            path.stem
            for folder in folders
            if (folder / group).is_dir()
            for path in (folder / group).glob("*.yaml")
            if not path.stem.startswith("_")
        }
    )


def select_user_components(arguments: list[str]) -> list[str]:
    """Import the classes of the user's own named by dotted path, and select their options.

    A component class in the user's own file is named by its dotted path:
    ``trainer.trainer_type=my_module.MyTrainer``, ``scenario=my_module.MyScenario``
    (or ``scenario.name=...``), ``protocol=my_module.MyProtocol`` (or
    ``protocol.name=...``). Importing the module before the config is
    composed lets it register its options schema
    (``@register_scenario("mine", MyConfig)``) in Hydra's ConfigStore. Then
    the component's options group (``trainer/objective``, ``scenario``,
    ``protocol``) is set to the options registered for the class, unless the
    overrides choose that group otherwise: the YAML file named after the
    registered name if a config folder of the command line holds one
    (``scenario/mine.yaml`` under ``--config-dir``), else the schema node
    (``mine_schema``). A class that registers nothing takes the options of
    its nearest registered base class (a subclass of the duplicates scenario:
    ``scenario=duplicates``). The class key (``scenario.name``) keeps the
    dotted path, as ``trainer.trainer_type`` does, so a run's saved config
    names the class, importable again on resume.

    Parameters
    ----------
    arguments : list of str
        Hydra overrides (command-line flags such as ``--config-dir`` are kept).

    Returns
    -------
    list of str
        The overrides, with the dotted group choices replaced and the options selected.

    Raises
    ------
    ConfigError
        If a dotted path does not import, names no class of the component's
        base class, or names one that has no registered options where the
        group choice needs them.
    """
    from nip_like.registry import REGISTRIES

    overrides = list(arguments)
    folders = _config_dirs(overrides) or [CONFIG_DIR]
    for registry in REGISTRIES.values():
        overrides = _select_user_component(registry, overrides, folders)
    return overrides


def _select_user_component(registry: Registry, overrides: list[str], folders: list[Path]) -> list[str]:
    """:func:`select_user_components` for the components of one registry.

    The overrides it adds take the place of the one that names the class, so
    that they stay among the overrides, before any flag (``--cfg job``).
    """
    group, class_key = registry.config_group, registry.class_key
    naming_keys = {class_key, group} if registry.group_names_class else {class_key}
    found = [
        (index, value)
        for index, (key, sep, value) in enumerate(item.partition("=") for item in overrides)
        if sep and key.lstrip("+") in naming_keys and _is_dotted(value)
    ]
    if not found:
        return list(overrides)
    index, dotted = found[-1]
    entry = registry.registered_entry(registry.entry(dotted).cls)
    rest = [item for number, item in enumerate(overrides) if number != index]
    keys = [item.partition("=")[0].lstrip("+~") for item in rest]
    added = [f"{class_key}={dotted}"] if class_key not in keys else []
    if group not in keys:
        if entry is not None and entry.schema is not None:
            options = _group_options(group, folders)
            added.insert(0, f"{group}={entry.name if entry.name in options else registry.node_name(entry.name)}")
        elif registry.group_names_class:
            raise ConfigError(
                f"{registry.kind} {dotted!r} has no options schema: register it with "
                f"@register_{registry.kind}(\"<name>\", <Schema>) or subclass a registered {registry.kind} "
                f"(one of {registry.names()})"
            )
    return [*rest[:index], *added, *rest[index:]]


def compose_config(overrides: list[str], config_dir: str | Path | None = None) -> DictConfig:
    """Compose the experiment config from ``configs/`` with ``overrides``, as ``python -m nip_like`` would.

    For scripts and notebooks: no run folder is made and nothing runs. As on
    the command line, a class of your own named by dotted path
    (``scenario=my_module.MyScenario``, ``trainer.trainer_type=...``) is
    imported first (:func:`select_user_components`), and a config folder of
    your own adds options to the groups (``scenario/mine.yaml``).

    Parameters
    ----------
    overrides : list of str
        Hydra overrides (``key=value``, ``group=option``); a command line's
        ``--config-dir <folder>`` (``-cd``) flags are taken as ``config_dir``.
    config_dir : str or Path, optional
        A config folder searched after the package's, like ``--config-dir``.

    Raises
    ------
    ConfigError
        If a config folder does not exist, or an option or class is unknown.
    """
    from nip_like.config import register_configs

    folders, overrides = _config_dir_flags(list(overrides))
    folders += [Path(config_dir)] if config_dir is not None else []
    for folder in folders:
        if not folder.is_dir():
            raise ConfigError(f"config folder {str(folder)!r} not found (--config-dir)")
    if folders:
        # Hydra's compose API has no --config-dir: its folders join the search path instead.
        entries = [*_search_path_entries(overrides), *(f"file://{folder.resolve()}" for folder in folders)]
        overrides = [item for item in overrides if not item.lstrip("+").startswith("hydra.searchpath=")]
        overrides.append("hydra.searchpath=[" + ",".join(f"'{entry}'" for entry in entries) + "]")
    register_configs()
    check_group_options(overrides)
    overrides = select_user_components(overrides)
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        try:
            return compose_from_kept_groups("config", overrides)
        except HydraException as error:
            line = unknown_override(error)
            if line is None:
                raise
            raise ConfigError(line) from None


def unknown_override(error: BaseException) -> str | None:
    """The one line for an override of a key its section does not declare (a typo), or None for another error.

    Hydra's own message advises ``+key=value``, which adds the key and leaves
    the typo for the config's checks to refuse; this line names the key and
    the section's nearest keys instead
    (:func:`nip_like.validation.unknown_key_line`).
    """
    from nip_like.validation import unknown_key_line

    cause = error.__cause__
    section = getattr(cause, "parent_node", None)
    key = getattr(cause, "full_key", None)
    if not str(error).startswith("Could not override") or not isinstance(section, DictConfig) or not key:
        return None
    schema = getattr(getattr(cause, "object_type", None), "__name__", None)
    parent, _, name = str(key).rpartition(".")
    nested = [
        f"{parent}.{child}.{name}" if parent else f"{child}.{name}"
        for child, node in section.items_ex(resolve=False)
        if isinstance(node, DictConfig) and name in node
    ]
    return unknown_key_line(str(key), section.keys(), schema, nested)


@contextmanager
def report_errors() -> Iterator[None]:
    """Turn a :class:`NipLikeError` or a config error into one line (a line per problem of a config) and exit status 2.

    A run stopped by a signal (:class:`RunInterrupted`) prints its line, which
    says how to resume, and exits with 128 + the signal number. Under torchrun,
    a rank other than 0 names itself (``error: rank 1: ...``), and a rank
    stopped because another one failed (which reported its own error) prints
    nothing and exits with status 1. A config error is the same on every rank:
    rank 0 alone prints it (the others exit with status 2 in silence). Under
    torchrun every rank also records its line in torchrun's error file
    (:func:`~nip_like.distributed.record_for_torchrun`), so that torchrun's
    report of the failed ranks ends with it.
    """
    from nip_like.distributed import PeerFailure, launched_rank

    try:
        yield
    except RunInterrupted as error:
        _stop(error.exit_status, str(error), shown=launched_rank() == 0)
    except PeerFailure as error:
        # A quiet one: the rank that failed reports (and records) its own error.
        _stop(1, None if error.quiet else f"error: {error}", shown=True)
    except ConfigError as error:  # one line per problem (nip_like.validation reports a config's problems together)
        lines = "\n".join(f"error: {line}" for line in str(error).splitlines() or [""])
        _stop(EXIT_BAD_INPUT, lines, shown=launched_rank() == 0)
    except NipLikeError as error:
        rank = launched_rank()
        _stop(EXIT_BAD_INPUT, f"error: {f'rank {rank}: ' if rank else ''}{error}", shown=True)
    except (OmegaConfBaseException, HydraException) as error:
        unknown = unknown_override(error)
        line = f"error: {unknown}" if unknown else f"error: config: {one_line(error)}{_preset_hint(error)}{_quoting_hint()}"
        _stop(EXIT_BAD_INPUT, line, shown=launched_rank() == 0)


def _stop(status: int, line: str | None, shown: bool) -> NoReturn:
    """Print ``line`` on stderr if ``shown``, record it for torchrun's report (under torchrun), exit with ``status``."""
    from nip_like.distributed import record_for_torchrun

    if line is not None:
        line = line.encode("utf-8", "backslashreplace").decode()  # a value quoted from bad input prints all the same
        if shown:
            print(line, file=sys.stderr)
        record_for_torchrun(line)
    sys.exit(status)


class RunFolderCallback(Callback):
    """Hydra callback (``hydra.callbacks.run_folder`` in ``configs/config.yaml``): check a run's folder first.

    Hydra writes ``.hydra/`` (and opens the job log) in the run folder before
    the app runs. For a single run this refuses, before that, a folder that
    another process is running in or that already holds a run, so that the
    refused command leaves it untouched; otherwise it takes the folder's lock
    (:mod:`nip_like.run_lock`), which the run then holds to its end. The jobs
    of a multirun are checked by :func:`nip_like.sweeps.multirun.run_multirun_job`.
    """

    def __init__(self) -> None:
        self.run_dir: Path | None = None

    def on_run_start(self, config: DictConfig, **kwargs: object) -> None:
        from nip_like import distributed, run_lock
        from nip_like.experiment import check_run_folder, preflight

        if not distributed.current().is_writer:  # another rank of a torchrun run: rank 0 checks and holds the folder
            return
        try:
            run_dir = Path(str(OmegaConf.select(config, "hydra.run.dir", throw_on_missing=True)))
        except Exception:  # a folder that needs the running job to resolve: run_experiment checks it
            return
        # Hydra swallows an Exception raised by a callback; exit here instead, in one line.
        with report_errors():
            check_run_folder(run_dir)
            # What can be refused without data or weights is refused before Hydra makes the folder.
            preflight(OmegaConf.masked_copy(config, [key for key in config if key != "hydra"]))
            run_lock.acquire(run_dir)
        self.run_dir = run_dir

    def on_run_end(self, config: DictConfig, **kwargs: object) -> None:
        from nip_like import run_lock

        if self.run_dir is not None:
            run_lock.release(self.run_dir)
            self.run_dir = None

    def on_multirun_start(self, config: DictConfig, **kwargs: object) -> None:
        """Record the ``.hydra/`` files of the job folders a sweep finds, before Hydra rewrites them.

        Hydra rewrites a job's ``.hydra/`` before the job can look at its
        folder; a job that is then refused (its folder holds a run of another
        config) or skipped puts them back (:func:`nip_like.sweeps.multirun.run_multirun_job`).
        """
        from nip_like.sweeps.multirun import record_hydra_files

        record_hydra_files(Path(str(OmegaConf.select(config, "hydra.sweep.dir"))))

    def on_multirun_end(self, config: DictConfig, **kwargs: object) -> None:
        """Remove the record of ``.hydra/`` files (a sweep that ends in a failure leaves it; the next one replaces it)."""
        from nip_like.sweeps.multirun import HYDRA_FILES_RECORD

        (Path(str(OmegaConf.select(config, "hydra.sweep.dir"))) / HYDRA_FILES_RECORD).unlink(missing_ok=True)


@contextmanager
def report_job_errors(run_dir: Path) -> Iterator[None]:
    """Report a failing sweep job in one line, then raise :class:`SweepJobError`.

    Used for the jobs of a Hydra multirun instead of :func:`report_errors`,
    which would exit the process and so stop the whole sweep. Bad input is
    reported as ``error: <run_dir>: <message>``; any other exception (a bug)
    also prints its traceback first. Hydra records the raised error as the
    job's failure, runs the remaining jobs, and raises the first failure at the
    end, which :func:`report_errors` turns into exit status 2.
    """
    try:
        yield
    except Exception as error:
        if isinstance(error, NipLikeError):
            message = str(error)
        elif isinstance(error, (OmegaConfBaseException, HydraException)):
            message = f"config: {one_line(error)}"
        else:
            traceback.print_exc()
            message = f"{type(error).__name__}: {error}"
        print(f"error: {run_dir}: {message}", file=sys.stderr)
        raise SweepJobError(f"sweep job {run_dir} failed: {message}") from error


def _preset_hint(error: Exception) -> str:
    """A hint for a preset that sets a key the chosen scenario (or trainer) lacks: it was made for another one."""
    found = re.search(r"In 'preset/([\w/-]+)'.*Key '[^']+' not in '[^']+'; full_key: ([\w.]+)", one_line(error))
    if found is None:
        return ""
    preset, key = found.groups()
    return (
        f"; preset {preset} sets {key}, which this choice does not have: the preset is made for another "
        "scenario or trainer (add preset=none, or choose a preset made for this one)"
    )


def _quoting_hint() -> str:
    """A hint for an override with non-ASCII characters, which Hydra's grammar reads only inside quotes."""
    for item in sys.argv[1:]:
        key, sep, value = item.partition("=")
        if sep and not value.isascii() and value[:1] not in ("'", '"'):
            return f"; quote a value with non-ASCII characters: {key}='{value}'"
    return ""
