"""Helpers shared by the command-line entry points."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from nip_like.errors import NipLikeError

#: The Hydra config folder (``configs/`` at the top of the repository).
CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"

#: Exit status of a run stopped by bad input.
EXIT_BAD_INPUT = 2


@contextmanager
def report_errors() -> Iterator[None]:
    """Turn a :class:`NipLikeError` or a config error into one line and exit status 2."""
    try:
        yield
    except NipLikeError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    except (OmegaConfBaseException, HydraException) as error:
        print(f"error: config: {one_line(error)}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)


def one_line(error: BaseException) -> str:
    """Fold a Hydra or OmegaConf error message (and its cause) into one line."""
    parts: list[str] = []
    for source in (error, error.__cause__):
        if source is None:
            continue
        for line in str(source).splitlines():
            text = line.strip()
            if text.startswith("Config search path"):
                break
            if text and not text.startswith(("reference_type", "object_type")) and text not in parts:
                parts.append(text)
    return "; ".join(parts).replace(":; ", ": ")
