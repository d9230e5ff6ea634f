"""Checks that every cached dataset (``nip_like.scenarios.datasets``) must pass, shared by each dataset's tests.

Each ``check_*`` function asserts; a dataset's test module calls it with its
own dataset, loader and generator.
"""

from __future__ import annotations

import os
import types
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from nip_like.checkpoint import load_checked, save_atomic
from nip_like.scenarios.datasets import CacheRebuildWarning, DatasetFileError, TensorDataset


def forbid(monkeypatch: pytest.MonkeyPatch, module: types.ModuleType, generator: str) -> None:
    """Make ``module.generator`` fail, so that a later load must come from the cache."""

    def fail(spec):
        raise AssertionError(f"{generator} was called")

    monkeypatch.setattr(module, generator, fail)


def corrupt_truncated(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def corrupt_garbage(path: Path) -> None:
    path.write_bytes(os.urandom(2000))


def corrupt_tensor(name: str) -> Callable[[Path], None]:
    """Return a corruption that changes the first element of tensor ``name`` but not the stored checksum."""

    def corrupt(path: Path) -> None:
        state = load_checked(path)
        flat = state["tensors"][name].view(-1)
        flat[0] = ~flat[0] if flat.dtype == torch.bool else flat[0] + 1
        save_atomic(state, path)  # the file's own checksum is right; only the tensors' checksum tells

    return corrupt


def check_save_load_and_tampering(dataset: TensorDataset, tmp_path: Path) -> None:
    """A saved dataset loads back equal; a flipped label, a wrong dtype, garbage, another kind or no file fail."""
    cls, path = type(dataset), tmp_path / "dataset.pt"
    dataset.save(path, metadata={"note": "x"})
    loaded = cls.load(path)
    assert loaded.checksum() == dataset.checksum()
    assert all(torch.equal(tensor, getattr(loaded, name)) for name, tensor in dataset.tensors().items())
    state = load_checked(path)
    state["tensors"]["label"] = ~state["tensors"]["label"]
    save_atomic(state, path)  # a whole file of changed tensors: only their own checksum tells
    with pytest.raises(DatasetFileError, match="fails its checksum"):
        cls.load(path)
    first = next(iter(state["tensors"]))
    state["tensors"][first] = state["tensors"][first].to(torch.float64)
    save_atomic(state, path)
    with pytest.raises(DatasetFileError, match=f"malformed tensors .*{cls.__name__}.{first} must be"):
        cls.load(path)
    path.write_bytes(b"not a torch file")
    with pytest.raises(DatasetFileError, match=f"{cls.DESCRIPTION} file .* is damaged"):
        cls.load(path)
    save_atomic({"something": "else"}, path)
    with pytest.raises(DatasetFileError, match=f"not a {cls.DESCRIPTION} file"):
        cls.load(path)
    with pytest.raises(DatasetFileError, match=f"no {cls.DESCRIPTION} file at"):
        cls.load(tmp_path / "missing.pt")


def check_second_call_loads(
    load: Callable[[], TensorDataset], path: Path, forbid_generation: Callable[[], None]
) -> None:
    """The first ``load()`` writes ``path``; the second reads it, generating nothing and warning nothing."""
    first = load()
    assert path.is_file()
    forbid_generation()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = load()
    assert second.checksum() == first.checksum()


def check_bad_cache_is_rebuilt(
    load: Callable[[], TensorDataset],
    path: Path,
    corrupt: Callable[[Path], None],
    reason: str,
    forbid_generation: Callable[[], None],
) -> None:
    """After ``corrupt(path)``, ``load()`` warns once, in one line matching ``reason``, and rebuilds the file."""
    fresh = load()
    corrupt(path)
    with pytest.warns(CacheRebuildWarning, match=reason) as caught:
        rebuilt = load()
    assert len(caught) == 1 and "\n" not in str(caught[0].message)
    assert caught[0].filename == load.__code__.co_filename  # the warning points at the loader's caller
    assert rebuilt.checksum() == fresh.checksum()
    assert not list(path.parent.glob(".*.tmp"))
    forbid_generation()
    assert load().checksum() == fresh.checksum()
