"""Folders a run writes into, checked before anything is written."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from nip_like.errors import ConfigError


def check_writable_folder(folder: Path, what: str) -> None:
    """Refuse, in one line, a folder that cannot be made or written (before anything is written).

    The folder is refused when it is a file, when a part of its path is a file,
    when a name in its path is too long for the file system, or when it (or
    the nearest existing folder above it) is not writable.

    Parameters
    ----------
    folder : Path
        The folder that a run will create or write into.
    what : str
        What the folder is, for the message (``"the run folder"``).

    Raises
    ------
    ConfigError
        Naming the folder and what is wrong.
    """
    folder = Path(folder).expanduser()
    existing = folder
    while not _exists(existing) and existing != existing.parent:
        existing = existing.parent
    limit = os.pathconf(existing, "PC_NAME_MAX") if _exists(existing) else 255
    long_names = [part for part in folder.parts if len(os.fsencode(part)) > limit]
    if long_names:
        raise ConfigError(
            f"{what} {str(folder)[:60]}... has a name longer than the file system allows ({limit} bytes): "
            f"{long_names[0][:40]}..."
        )
    if not existing.is_dir():
        where = "is a file" if existing == folder else f"lies under a file ({existing})"
        raise ConfigError(f"{what} {folder} {where}; choose a folder path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} {folder} cannot be written: {existing} is read-only")


def _exists(path: Path) -> bool:
    """Whether ``path`` exists; a path the system cannot even look up (a name too long) does not."""
    try:
        return path.exists()
    except OSError:
        return False


def resume_command(run_dir: Path) -> str:
    """The command that resumes the run in ``run_dir``."""
    return f"python -m nip_like.resume {shlex.quote(str(run_dir))}"
