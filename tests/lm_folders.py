"""Chat-model folders built once per test session, as a user's downloaded model folders look.

Import :func:`chat_model` (a session fixture) into a test module; it calls
:func:`nip_like.lm.local_models.build_chat_model_folder`, the same builder as
``scripts/build_lm_folder.py``. Tests load the folders back only through the
user-facing path (``pretrained_path``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

from nip_like.lm.local_models import build_chat_model_folder

#: The families every chat-view feature is shown on.
FAMILIES = ("qwen2", "llama", "gpt2")


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory) -> Callable[..., Path]:
    """``chat_model(family, **sizes)``: the folder of a small chat model of ``family`` (built once per arguments)."""
    built: dict[tuple, Path] = {}

    def folder(family: str = "qwen2", **sizes) -> Path:
        key = (family, *sorted(sizes.items()))
        if key not in built:
            name = "-".join(str(part) for part in (family, *(f"{k}{v}" for k, v in sorted(sizes.items()))))
            sizes.setdefault("vocab_size", 1000)
            sizes.setdefault("lines", 4000)
            built[key] = build_chat_model_folder(tmp_path_factory.mktemp("models") / name, family, **sizes)
        return built[key]

    return folder
