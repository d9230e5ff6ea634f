"""Helpers shared by the command-line entry points."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

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
    except OmegaConfBaseException as error:
        message = str(error).splitlines()[0]
        print(f"error: config: {message}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
