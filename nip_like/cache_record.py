"""The cache entries a run read or wrote, recorded in its folder; ``run.fresh_cache`` puts its caches there.

Datasets, warm-started agents, GGUF conversions, merged frozen co-players and
small chat models built from config live in caches outside the run folder
(``~/.cache/nip_like/...``), shared between runs and keyed by what determines
them. Each cache site reports the entry it used to :func:`record`: its kind
(:data:`KINDS`), its key, a checksum of its contents, its path, and whether
the run built it or reused it. While a run is recorded (:func:`recording`,
entered by :func:`nip_like.experiment.run_experiment`), the record is written
to ``<run folder>/caches.json`` at each new entry, so that a killed run keeps
it; the finished run copies it into its ``summary.json`` (``"caches"``), and
each entry is one line of the job log.

The checksum is the one the cache already keeps where it keeps one: the
SHA-256 in the header of a file written by
:func:`~nip_like.checkpoint.save_atomic` (datasets, warm starts), the SHA-256
of a folder's ``checksums.json`` manifest (GGUF conversions); otherwise the
SHA-256 of the folder's files (:func:`folder_checksum`). :func:`changes` takes
it again, so that resuming or evaluating a run can say, one line per entry,
which entries changed or are gone since the run used them (:func:`warn_changes`).

With ``run.fresh_cache=true`` every cache of the run lives in the run folder,
``<run folder>/cache/``: each ``cache_dir`` field of the config moves to a
folder named after its section (``cache/scenario``, ``cache/trainer.pretrain``,
:func:`redirected`) and the GGUF conversions go to ``cache/gguf``
(:func:`fresh_folder`). Nothing is read from the shared caches, so every entry
is built, and a cold-start timing or an isolated reproduction needs no edit of
cache folders.
"""

from __future__ import annotations

import copy
import hashlib
import json
import sys
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator, TextIO

from omegaconf import DictConfig, ListConfig

from nip_like.checkpoint import HEADER_PREFIX, MANIFEST_FILE, file_sha256, write_text_atomic
from nip_like.errors import ConfigError
from nip_like.job_log import write_job_log

#: The record of a run's cache entries in its folder (written at each new entry).
CACHES_FILE = "caches.json"
#: Where ``run.fresh_cache`` puts a run's caches, inside its folder.
FRESH_FOLDER = "cache"
#: The config fields that name a cache folder, at any depth.
CACHE_DIR_KEY = "cache_dir"
#: The kinds of cache entries, as the cache sites report them.
KINDS = ("dataset", "warm start", "gguf conversion", "frozen merge", "chat model")
#: The fields of an entry, in ``caches.json`` and ``summary.json``.
ENTRY_FIELDS = ("kind", "key", "checksum", "path", "action")
#: What happened to an entry in the run: made (or made again) by it, or read as another run left it.
ACTIONS = ("built", "reused")


@dataclass(frozen=True)
class CacheEntry:
    """One cache entry a run used.

    Parameters
    ----------
    kind : str
        One of :data:`KINDS`.
    key : str
        What the cache keys the entry by (a file or folder name, a hash).
    checksum : str
        SHA-256 of its contents (:func:`content_checksum`).
    path : str
        The file or folder, absolute.
    action : str
        ``built`` or ``reused`` (:data:`ACTIONS`).
    """

    kind: str
    key: str
    checksum: str
    path: str
    action: str

    def line(self) -> str:
        """The entry in one line: ``dataset gi_pairs_0a1b... built (sha256 0123456789ab) /path``."""
        return f"{self.kind} {self.key} {self.action} (sha256 {self.checksum[:12]}) {self.path}"


class CacheRecord:
    """The entries one run used, in the order they were first used; written to ``file`` at each new one.

    Parameters
    ----------
    file : Path, optional
        Where the record is written (``<run folder>/caches.json``); None keeps it in memory only.
    fresh_root : Path, optional
        The run's own cache folder (``run.fresh_cache``); None: the shared caches.
    entries : list of CacheEntry, optional
        Entries recorded before (an earlier session of a resumed run).
    """

    def __init__(self, file: Path | None = None, fresh_root: Path | None = None, entries: list[CacheEntry] | None = None) -> None:
        self.file = None if file is None else Path(file)
        self.fresh_root = None if fresh_root is None else Path(fresh_root)
        self.entries: list[CacheEntry] = list(entries or [])

    def add(self, entry: CacheEntry) -> bool:
        """Add ``entry`` unless the same contents at the same path are recorded already; return whether it was added."""
        if any((seen.kind, seen.path, seen.checksum) == (entry.kind, entry.path, entry.checksum) for seen in self.entries):
            return False
        self.entries.append(entry)
        self.save()
        return True

    def save(self) -> None:
        """Write the record to its file, if it has one (atomically)."""
        if self.file is not None:
            write_text_atomic(json.dumps({"entries": self.as_dicts()}, indent=2) + "\n", self.file)

    def as_dicts(self) -> list[dict[str, str]]:
        """The entries as plain dicts (for ``caches.json`` and ``summary.json``)."""
        return [asdict(entry) for entry in self.entries]


#: The record of the run in progress in this process; None outside a run.
_current: CacheRecord | None = None


@contextmanager
def recording(file: Path | None = None, fresh_root: Path | None = None, keep: bool = False) -> Iterator[CacheRecord]:
    """Record the cache entries used inside the block (a run), in a record of their own.

    Parameters
    ----------
    file : Path, optional
        The record's file (``<run folder>/caches.json``), written at once and
        at each new entry; None keeps it in memory (another rank of a torchrun run, an evaluation).
    fresh_root : Path, optional
        The caches' folder inside the run folder (``run.fresh_cache``); see :func:`fresh_folder`.
    keep : bool
        Start from the entries already in ``file`` (a resumed run): the record
        then lists what every session of the run used (an unreadable file is
        started again).

    Yields
    ------
    CacheRecord
        The record; the one in effect before the block is restored on leaving it.
    """
    global _current
    previous = _current
    entries = []
    if keep and file is not None:
        try:
            entries = _read_entries(Path(file))
        except ConfigError:  # said by warn_changes before the run; the record starts again
            entries = []
    _current = CacheRecord(file, fresh_root, entries)
    _current.save()
    try:
        yield _current
    finally:
        _current = previous


def record(kind: str, key: str, path: Path, built: bool) -> CacheEntry | None:
    """Report a cache entry the run in progress used; nothing outside a run (:func:`recording`).

    Its checksum is taken by :func:`content_checksum`; a new entry is written
    to the record's file and to the job log.

    Parameters
    ----------
    kind : str
        One of :data:`KINDS`.
    key : str
        What the cache keys the entry by.
    path : Path
        The entry's file or folder.
    built : bool
        Whether this run made it (else it read one that was there).

    Returns
    -------
    CacheEntry or None
        The entry, or None outside a run.
    """
    if kind not in KINDS:
        raise ValueError(f"cache entry kind must be one of {list(KINDS)}, got {kind!r}")
    if _current is None:
        return None
    path = Path(path).expanduser().resolve()
    entry = CacheEntry(kind, str(key), content_checksum(path), str(path), ACTIONS[0] if built else ACTIONS[1])
    if _current.add(entry):
        write_job_log(f"cache: {entry.line()}")
    return entry


def current() -> CacheRecord | None:
    """The record of the run in progress, or None."""
    return _current


def fresh_root() -> Path | None:
    """The run's own cache folder when the run in progress has ``run.fresh_cache``; else None."""
    return None if _current is None else _current.fresh_root


def fresh_folder(name: str, shared: Path) -> Path:
    """Where a cache that the config does not name (the GGUF conversions) lives: ``<fresh root>/<name>``, else ``shared``."""
    root = fresh_root()
    return Path(shared) if root is None else root / name


def redirected(config: DictConfig, root: Path) -> DictConfig:
    """A copy of ``config`` whose every ``cache_dir`` field, at any depth, names a folder under ``root``.

    The folder is named after the field's section: ``scenario.cache_dir`` ->
    ``root/scenario``, ``trainer.pretrain.cache_dir`` -> ``root/trainer.pretrain``.
    Cache folders are locations (:data:`nip_like.config.LOCATION_KEYS`), so
    the run id and every cache key stay the same.
    """
    config = copy.deepcopy(config)
    _redirect(config, Path(root), ())
    return config


def _redirect(node: Any, root: Path, where: tuple[str, ...]) -> None:
    if isinstance(node, DictConfig):
        for key in list(node.keys()):
            value = node._get_node(key)
            if key == CACHE_DIR_KEY and where and isinstance(node.get(key), str):
                node[key] = str(root / ".".join(where))
            elif isinstance(value, (DictConfig, ListConfig)):
                _redirect(value, root, (*where, str(key)))
    elif isinstance(node, ListConfig):
        for index, item in enumerate(node):
            if isinstance(item, (DictConfig, ListConfig)):
                _redirect(item, root, (*where, str(index)))


def folder_checksum(*folders: Path) -> str:
    """SHA-256 over every file in ``folders`` (relative names and contents, in a fixed order; hidden files left out)."""
    digest = hashlib.sha256()
    for folder in folders:
        for path in sorted(item for item in Path(folder).rglob("*") if item.is_file()):
            relative = path.relative_to(folder)
            if any(part.startswith(".") for part in relative.parts):
                continue
            digest.update(str(relative).encode() + b"\0")
            with path.open("rb") as stream:
                for block in iter(lambda: stream.read(1 << 20), b""):
                    digest.update(block)
    return digest.hexdigest()


def content_checksum(path: Path) -> str:
    """The SHA-256 that stands for an entry's contents, taken as cheaply as the entry allows.

    A file written by :func:`~nip_like.checkpoint.save_atomic`: the checksum
    in its header (only its first line is read). A folder with a
    ``checksums.json`` manifest: the manifest's SHA-256 (the manifest holds
    each file's). Any other file or folder: the SHA-256 of its contents
    (:func:`folder_checksum` for a folder).

    Raises
    ------
    FileNotFoundError
        If ``path`` is gone.
    """
    path = Path(path)
    if path.is_dir():
        manifest = path / MANIFEST_FILE
        return file_sha256(manifest) if manifest.is_file() else folder_checksum(path)
    with open(path, "rb") as stream:
        head = stream.readline(512)
    if head.startswith(HEADER_PREFIX):
        fields = dict(item.partition("=")[::2] for item in head[len(HEADER_PREFIX):].decode("ascii", "replace").split())
        if len(fields.get("sha256", "")) == 64:
            return fields["sha256"]
    return file_sha256(path)


def recorded_entries(run_dir: Path) -> list[dict[str, str]]:
    """The cache entries a run folder records in its ``caches.json``; [] if it has none.

    Raises
    ------
    ConfigError
        If the file cannot be read as a record, in one line.
    """
    return [asdict(entry) for entry in _read_entries(Path(run_dir) / CACHES_FILE)]


def _read_entries(file: Path) -> list[CacheEntry]:
    """The entries of a ``caches.json``; [] if there is none."""
    if not file.is_file():
        return []
    try:
        return [CacheEntry(**{name: str(item[name]) for name in ENTRY_FIELDS}) for item in json.loads(file.read_text())["entries"]]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ConfigError(f"{file} cannot be read as a record of cache entries ({type(error).__name__})") from error


def changes(run_dir: Path) -> list[str]:
    """One line per cache entry the run in ``run_dir`` used that has changed (another checksum) or is gone since.

    An entry whose path the run used again later, with other contents (a
    resumed session that read it as it was then), is compared as that later
    session found it. A ``caches.json`` that cannot be read is one line too.
    """
    try:
        latest = {(entry["kind"], entry["path"]): entry for entry in recorded_entries(run_dir)}
    except ConfigError as error:  # a warning too: the run can go on without its record
        return [str(error)]
    lines = []
    for entry in latest.values():
        what = f"the {entry['kind']} cache entry {entry['key']} that the run used ({entry['path']})"
        path = Path(entry["path"])
        if not path.exists():
            lines.append(f"{what} is gone; it will be built again if needed")
            continue
        try:
            now = content_checksum(path)
        except OSError as error:
            lines.append(f"{what} cannot be read ({error.strerror or type(error).__name__})")
            continue
        if now != entry["checksum"]:
            lines.append(f"{what} has changed since: sha256 {now[:12]} now, {entry['checksum'][:12]} then")
    return lines


def warn_changes(run_dir: Path, stream: TextIO | None = None) -> list[str]:
    """Print :func:`changes` as ``warning: ...`` lines on ``stream`` (standard error) and return them; a warning, not a refusal."""
    lines = changes(run_dir)
    for line in lines:
        print(f"warning: {line}", file=stream or sys.stderr)
    return lines
