"""Atomic save and checked load of the whole experiment state."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nip_like.errors import CheckpointError

#: Version of the checkpoint layout; bumped when it changes.
CHECKPOINT_FORMAT = 1


def save_atomic(state: dict[str, Any], path: Path) -> None:
    """Write ``state`` to ``path`` so that a crash never leaves a broken file.

    The state goes to a temporary file in the same folder, is flushed to disk,
    and then replaces ``path`` in one ``os.replace``. A crash at any moment
    leaves either the previous file or the new one, whole.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    try:
        with open(temporary, "wb") as handle:
            torch.save({"format": CHECKPOINT_FORMAT, **state}, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        if temporary.exists():
            temporary.unlink()


def load_checked(path: Path, run_id: str | None = None) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_atomic`, or fail in one line.

    Parameters
    ----------
    path : Path
        The checkpoint file.
    run_id : str, optional
        If given, the checkpoint must have been written by a run with these
        hyper-parameters (see :func:`nip_like.config.run_id`).

    Raises
    ------
    CheckpointError
        If the file is missing, unreadable, of another format or of another run.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:  # torch raises many types for a corrupt file
        raise CheckpointError(f"checkpoint {path} is corrupt or unreadable ({type(error).__name__})") from error
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path} is not a nip_like checkpoint of format {CHECKPOINT_FORMAT}")
    if run_id is not None and state.get("run_id") != run_id:
        raise CheckpointError(
            f"checkpoint {path} belongs to run {state.get('run_id')}, not to this config's run {run_id}: "
            f"the hyper-parameters differ"
        )
    return state


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
