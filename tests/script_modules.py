"""The scripts of ``scripts/`` imported as modules by their tests."""

from __future__ import annotations

import importlib.util
import sys
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Iterator

import torch

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


@contextmanager
def script_module(name: str) -> Iterator[ModuleType]:
    """``scripts/<name>.py`` as module ``name``, registered in ``sys.modules`` while in use (as dataclasses need).

    The benchmark scripts set torch's thread count; it is restored on exit.
    """
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    threads = torch.get_num_threads()
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        torch.set_num_threads(threads)
        sys.modules.pop(spec.name, None)
