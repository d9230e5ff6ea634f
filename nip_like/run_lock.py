"""One process per run folder: an advisory lock on ``<run folder>/run.lock``.

A run (``python -m nip_like``, ``python -m nip_like.resume``, a job of a
sweep) holds an exclusive :func:`fcntl.flock` on ``run.lock`` in its folder
from before it writes anything there until it ends. The file holds the
process id, the host and the start time as text, for the message that turns
a second process away. The operating system drops the lock when the process
ends, however it ends (SIGKILL included), so a ``run.lock`` that no process
holds is stale and the folder is free; a run that ends normally removes the
file.

The lock is advisory: it stops nip_like commands, not other programs. On a
network file system it holds only if that file system supports ``flock``
across machines.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Iterator

from nip_like.errors import RunInUseError

#: Name of the lock file in a run folder.
LOCK_FILE = "run.lock"

#: Tries to take a lock before giving up (a process that only looks at the lock holds it for an instant).
_TRIES = 5

# Locks this process holds: real path of the folder -> [file descriptor, nesting depth].
_held: dict[str, list[int]] = {}


def _key(run_dir: Path) -> str:
    return os.path.realpath(run_dir)


def _describe(text: str) -> str:
    """``process 1234 (host h, started ...)`` from the text of a lock file."""
    fields = dict(item.partition("=")[::2] for item in text.split())
    pid = fields.get("pid", "")
    if not pid.isdigit():
        return "another process"
    details = ", ".join(f"{name} {fields[name]}" for name in ("host", "started") if fields.get(name))
    return f"process {pid}" + (f" ({details})" if details else "")


def lock_holder(run_dir: Path) -> str | None:
    """Return who holds ``run_dir``'s lock (``process 1234 (host h, started ...)``), or ``None``.

    ``None`` when no process holds it: there is no ``run.lock``, it is stale,
    or this process holds it. Only reads: the folder is not changed.
    """
    if _key(run_dir) in _held:
        return None
    try:
        descriptor = os.open(Path(run_dir) / LOCK_FILE, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _describe(os.read(descriptor, 4096).decode("utf-8", "replace"))
        fcntl.flock(descriptor, fcntl.LOCK_UN)
        return None
    finally:
        os.close(descriptor)


def in_use_message(run_dir: Path, holder: str) -> str:
    """The one-line refusal for a folder that ``holder`` (as :func:`lock_holder` gives it) is running in."""
    words = holder.split()
    stop = f"kill -TERM {words[1]}" if len(words) > 1 and words[1].isdigit() else "kill -TERM <pid>"
    return (
        f"{run_dir} is in use: {holder} is running in it; wait for it to end, or stop it "
        f"(Ctrl-C in its terminal, or {stop}) and then resume it with `python -m nip_like.resume {run_dir}`"
    )


def check_free(run_dir: Path) -> None:
    """Raise :class:`~nip_like.errors.RunInUseError` if another process holds ``run_dir``'s lock."""
    holder = lock_holder(run_dir)
    if holder is not None:
        raise RunInUseError(in_use_message(run_dir, holder))


def acquire(run_dir: Path) -> None:
    """Take ``run_dir``'s lock for this process (the folder is created if needed).

    Nested calls for the same folder only count; the lock goes at the
    matching :func:`release`.

    Raises
    ------
    RunInUseError
        If another process holds it; the message names the process.
    """
    key = _key(run_dir)
    if key in _held:
        _held[key][1] += 1
        return
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    path = Path(run_dir) / LOCK_FILE
    for attempt in range(_TRIES):
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(descriptor)
            time.sleep(0.05)
            continue
        # The previous holder may have removed the file between our open and flock: lock the file at the path.
        try:
            same = os.path.samestat(os.fstat(descriptor), os.stat(path))
        except FileNotFoundError:
            same = False
        if not same:
            os.close(descriptor)
            continue
        started = datetime.now().astimezone().isoformat(timespec="seconds")
        os.ftruncate(descriptor, 0)
        os.write(descriptor, f"pid={os.getpid()} host={socket.gethostname()} started={started}\n".encode())
        _held[key] = [descriptor, 1]
        return
    raise RunInUseError(in_use_message(run_dir, lock_holder(run_dir) or "another process"))


def release(run_dir: Path) -> None:
    """Give back a lock taken by :func:`acquire`; the last release removes ``run.lock``."""
    key = _key(run_dir)
    entry = _held.get(key)
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] > 0:
        return
    del _held[key]
    descriptor = entry[0]
    path = Path(key) / LOCK_FILE
    try:
        # Remove the file while still holding it; a process waiting on this file then sees it gone and retries.
        if os.path.samestat(os.fstat(descriptor), os.stat(path)):
            path.unlink()
    except FileNotFoundError:
        pass
    finally:
        os.close(descriptor)


def release_all() -> None:
    """Give back every lock this process holds (at the end of a command)."""
    for key in list(_held):
        _held[key][1] = 1
        release(Path(key))


@contextmanager
def holding(run_dir: Path) -> Iterator[None]:
    """Hold ``run_dir``'s lock while the block runs."""
    acquire(run_dir)
    try:
        yield
    finally:
        release(run_dir)
