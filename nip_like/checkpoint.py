"""Atomic save and checked load of the whole experiment state.

A file written by :func:`save_atomic` is one header line followed by the
``torch.save`` bytes of the state::

    nip_like-checkpoint format=2 size=<payload bytes> sha256=<hex digest of the payload>

:func:`load_checked` compares the payload with its size and checksum before
``torch.load`` sees a byte of it, so a damaged file (flipped bits, a truncated
copy) is refused in one line, never loaded.

A folder of files written by other libraries (a language-model agent's
``save_pretrained`` folder) gets the same protection from a manifest,
``checksums.json``, that lists the size and SHA-256 of each of its files:
:func:`write_manifest` writes it last, :func:`check_manifest` compares the
files with it before they are loaded.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import secrets
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from nip_like.errors import CheckpointError, WriteError

#: Version of the checkpoint layout; bumped when it changes (2: the checksum header).
CHECKPOINT_FORMAT = 2

#: How the header line of a checkpoint file starts.
HEADER_PREFIX = b"nip_like-checkpoint "

#: Longest header line that is read (the real one is about 120 bytes).
_MAX_HEADER = 512


def write_failed(path: Path, error: BaseException) -> WriteError:
    """The one-line :class:`~nip_like.errors.WriteError` of a failed atomic write of ``path`` (the previous one is kept)."""
    while isinstance(error, WriteError) and error.__cause__ is not None:  # a file of a folder being written
        error = error.__cause__
    reason = error.strerror if isinstance(error, OSError) and error.strerror else " ".join(str(error).split())
    return WriteError(f"could not write {path}: {reason or type(error).__name__}; its previous version is kept")


def temporary_sibling(path: Path) -> Path:
    """A hidden temporary file beside ``path`` that no other writer uses: ``.NAME.<pid>-<random>.tmp``.

    Several processes may write one file at once (the jobs of a sweep filling
    a shared data cache): each writes its own temporary file and the last
    ``os.replace`` wins, whole, where one shared temporary name would let a
    writer rename or remove another's half-written file.
    """
    return path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")


def write_text_atomic(text: str, path: Path) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder and one ``os.replace``.

    A crash leaves the previous file or the new one, whole (the folder is
    created if needed).

    Raises
    ------
    WriteError
        If the file cannot be written (a full disk, say), in one line; the
        previous file is kept and the temporary one removed.
    """
    path = Path(path)
    temporary = temporary_sibling(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary.write_text(text)
        os.replace(temporary, path)
    except OSError as error:
        raise write_failed(path, error) from error
    finally:
        if temporary.exists():
            temporary.unlink()


def save_atomic(state: dict[str, Any], path: Path) -> None:
    """Write ``state`` to ``path`` with a checksum, so that a crash never leaves a broken file.

    The state is serialised in memory, its SHA-256 goes into the header line,
    and header and state go to a temporary file in the same folder, which is
    flushed to disk and then replaces ``path`` in one ``os.replace``. A crash at
    any moment leaves either the previous file or the new one, whole.

    Raises
    ------
    WriteError
        If the file cannot be written (a full disk, say), in one line; the
        previous file is kept and the temporary one removed.
    """
    path = Path(path)
    buffer = io.BytesIO()
    torch.save({"format": CHECKPOINT_FORMAT, **state}, buffer)
    payload = buffer.getbuffer()
    header = HEADER_PREFIX + (
        f"format={CHECKPOINT_FORMAT} size={len(payload)} sha256={hashlib.sha256(payload).hexdigest()}\n"
    ).encode()
    temporary = temporary_sibling(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(temporary, "wb") as handle:
            handle.write(header)
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except OSError as error:
        raise write_failed(path, error) from error
    finally:
        if temporary.exists():
            temporary.unlink()


def _checked_payload(path: Path, what: str) -> bytes:
    """Return the payload of a file written by :func:`save_atomic`, after checking its size and checksum."""
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except OSError as error:
        raise CheckpointError(f"{what} {path} is unreadable ({error.strerror or type(error).__name__})") from error
    end = data.find(b"\n", 0, _MAX_HEADER)
    if not data.startswith(HEADER_PREFIX) or end < 0:
        if data.startswith(b"PK\x03\x04"):  # a bare torch.save zip: nip_like before checksums
            raise CheckpointError(
                f"{path} is not a nip_like {what} of format {CHECKPOINT_FORMAT}: it has no checksum header "
                f"(written by an older nip_like or by torch.save)"
            )
        raise CheckpointError(f"{what} {path} is damaged: it does not start with a nip_like header; it was not loaded")
    fields = dict(item.partition("=")[::2] for item in data[len(HEADER_PREFIX):end].decode("ascii", "replace").split())
    payload = data[end + 1:]
    if fields.get("format") != str(CHECKPOINT_FORMAT):
        raise CheckpointError(
            f"{path} is a nip_like {what} of format {fields.get('format')}, not {CHECKPOINT_FORMAT} "
            f"(written by another nip_like version, or damaged)"
        )
    size, digest = fields.get("size", ""), fields.get("sha256", "")
    if not size.isdigit() or len(digest) != 64:
        raise CheckpointError(f"{what} {path} is damaged: its header is unreadable; it was not loaded")
    if len(payload) != int(size):
        raise CheckpointError(
            f"{what} {path} is damaged: it holds {len(payload)} of its {int(size)} bytes (truncated or extended); "
            f"it was not loaded"
        )
    if hashlib.sha256(payload).hexdigest() != digest:
        raise CheckpointError(
            f"{what} {path} is damaged: its sha256 checksum does not match its contents; it was not loaded"
        )
    return payload


def load_checked(path: Path, run_id: str | None = None, what: str = "checkpoint") -> dict[str, Any]:
    """Load a file written by :func:`save_atomic`, or fail in one line.

    Parameters
    ----------
    path : Path
        The checkpoint file.
    run_id : str, optional
        If given, the checkpoint must have been written by a run with these
        hyper-parameters (see :func:`nip_like.config.run_id`).
    what : str
        What the file is, for the error messages (``"checkpoint"``, ``"cache file"``, ...).

    Raises
    ------
    CheckpointError
        If the file is missing or unreadable, is damaged (its size or its
        SHA-256 checksum does not match its header), is of another format, or
        belongs to another run. The message is one line and names the file.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no {what} at {path}")
    payload = _checked_payload(path, what)
    try:
        state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=False)
    except Exception as error:  # the checksum matched: written by something that torch cannot read back
        raise CheckpointError(f"{what} {path} is unreadable ({type(error).__name__})") from error
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path} is not a nip_like {what} of format {CHECKPOINT_FORMAT}")
    if run_id is not None and state.get("run_id") != run_id:
        raise CheckpointError(
            f"{what} {path} belongs to run {state.get('run_id')}, not to this config's run {run_id}: "
            f"the hyper-parameters differ"
        )
    return state


#: The manifest of a folder's files (:func:`write_manifest`).
MANIFEST_FILE = "checksums.json"
#: Version of the manifest's layout.
MANIFEST_FORMAT = 1

#: Folders (with their files' sizes and modification times) that :func:`check_manifest` found whole in this process.
_checked_folders: dict[str, tuple] = {}


def file_sha256(path: Path) -> str:
    """The SHA-256 of file ``path``'s contents, read 1 MiB at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _manifest_entries(folder: Path, root: Path) -> Iterator[Path]:
    """The files a manifest of ``root`` lists, under ``folder``: a subfolder with a manifest of its own is its manifest."""
    for entry in sorted(folder.iterdir()):
        if entry.name.startswith(".") or (folder == root and entry.name == MANIFEST_FILE):
            continue
        if entry.is_dir():
            if (entry / MANIFEST_FILE).is_file():
                yield entry / MANIFEST_FILE  # checked in its turn when its own manifest is checked
            else:
                yield from _manifest_entries(entry, root)
        elif entry.is_file():
            yield entry


def write_manifest(folder: Path) -> Path:
    """Write ``folder/checksums.json``: the size and SHA-256 of every file in ``folder``, written atomically.

    Call it last, when every file of the folder is written. Hidden files are
    left out; a subfolder that has a manifest of its own is listed by that
    manifest (which :func:`check_manifest` then checks in its turn), others
    file by file.

    Parameters
    ----------
    folder : Path
        The folder.

    Returns
    -------
    Path
        The manifest.

    Raises
    ------
    WriteError
        If it cannot be written, in one line.
    """
    folder = Path(folder)
    try:
        files = {
            path.relative_to(folder).as_posix(): {"size": path.stat().st_size, "sha256": file_sha256(path)}
            for path in _manifest_entries(folder, folder)
        }
    except OSError as error:
        raise write_failed(folder / MANIFEST_FILE, error) from error
    record = {"format": MANIFEST_FORMAT, "algorithm": "sha256", "files": files}
    write_text_atomic(json.dumps(record, indent=1, sort_keys=True) + "\n", folder / MANIFEST_FILE)
    return folder / MANIFEST_FILE


def _read_manifest(manifest: Path) -> dict[str, dict[str, Any]]:
    """The ``files`` of a manifest, or a one-line :class:`CheckpointError` if it cannot be read."""
    try:
        record = json.loads(manifest.read_text())
        files = record["files"]
        if record.get("format") != MANIFEST_FORMAT or not isinstance(files, dict):
            raise ValueError(f"format {record.get('format')}")
        return {str(name): {"size": int(entry["size"]), "sha256": str(entry["sha256"])} for name, entry in files.items()}
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(
            f"{manifest} is damaged or not a nip_like manifest of format {MANIFEST_FORMAT} ({type(error).__name__}); "
            f"the files of {manifest.parent} were not loaded"
        ) from error


def _signature(folder: Path, names: list[str]) -> tuple:
    """Sizes and modification times of ``folder``'s manifest and the files it lists (None for a missing one)."""
    def stamp(path: Path):
        try:
            status = path.stat()
        except OSError:
            return None
        return status.st_size, status.st_mtime_ns, status.st_ino

    return tuple(stamp(folder / name) for name in (MANIFEST_FILE, *names))


def check_manifest(folder: Path, what: str = "folder") -> bool:
    """Compare the files of ``folder`` with its ``checksums.json``; a one-line error naming the first that differs.

    A folder without a manifest (written by an older nip_like, by another
    program, or by the user) is accepted as it is. Files that the manifest
    does not list are not checked; a subfolder's manifest that it lists is
    checked in its turn. A folder found whole is not read again in this
    process while its files keep their sizes and modification times.

    Parameters
    ----------
    folder : Path
        The folder (a language-model agent's or model's).
    what : str
        What the folder is, for the messages.

    Returns
    -------
    bool
        Whether the folder had a manifest (and so was checked).

    Raises
    ------
    CheckpointError
        If a listed file is missing, has another size or another SHA-256, or
        the manifest cannot be read; the message names the file.
    """
    folder = Path(folder)
    manifest = folder / MANIFEST_FILE
    if not manifest.is_file():
        return False
    files = _read_manifest(manifest)
    key, signature = str(folder.resolve()), _signature(folder, sorted(files))
    if _checked_folders.get(key) == signature:
        return True
    for name, expected in sorted(files.items()):
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{what} {folder} is incomplete: {path} is missing, which its {MANIFEST_FILE} lists; nothing was loaded")
        size = path.stat().st_size
        if size != expected["size"]:
            raise CheckpointError(
                f"{path} is damaged: it holds {size} bytes, its folder's {MANIFEST_FILE} says {expected['size']} "
                f"(truncated or extended); nothing of {what} {folder} was loaded"
            )
        if file_sha256(path) != expected["sha256"]:
            raise CheckpointError(
                f"{path} is damaged: its sha256 does not match its folder's {MANIFEST_FILE} (flipped bytes, or edited "
                f"since it was written); nothing of {what} {folder} was loaded"
            )
        if path.name == MANIFEST_FILE:
            check_manifest(path.parent, what)
    _checked_folders[key] = signature
    return True


def check_checkpoint_folders(checkpoint_folder: Path) -> None:
    """Check each folder saved beside a checkpoint (``checkpoints/<name>/<agent>/``) against its manifest.

    A checkpoint without such folders (agents that are not language models)
    and folders without a manifest pass unchecked.

    Raises
    ------
    CheckpointError
        If a file differs from its folder's manifest, in one line naming it.
    """
    folder = Path(checkpoint_folder)
    if not folder.is_dir():
        return
    for agent in sorted(path for path in folder.iterdir() if path.is_dir() and not path.name.startswith(".")):
        check_manifest(agent, "agent folder")


def get_rng_states() -> dict[str, Any]:
    """Return the states of Python's, NumPy's and torch's global generators."""
    states: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore the generators from :func:`get_rng_states`."""
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def derive_seed(seed: int, purpose: str) -> int:
    """Derive a stable seed for one purpose (``"train_env"``, ``"eval_env"``, ...).

    Unlike Python's ``hash``, the result does not change between processes.
    """
    digest = 0
    for byte in f"{seed}:{purpose}".encode():
        digest = (digest * 131 + byte) % (2**61 - 1)
    return digest % (2**31)
