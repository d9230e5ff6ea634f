"""What every scenario's seeded, cached dataset shares: tensors, checksums, splits and the cache.

A dataset is a dataclass of tensors that subclasses :class:`TensorDataset`;
what its generator draws is a frozen spec dataclass that subclasses
:class:`DatasetSpec`. :func:`stratified_split` cuts a dataset into
label-stratified splits and :func:`load_or_build` keeps it in a checked cache
file. The graph-isomorphism pairs
(:mod:`nip_like.scenarios.graph_isomorphism.data`) and the duplicate lists
(:mod:`nip_like.scenarios.duplicates.data`) are built on it. This module
registers nothing.
"""

from __future__ import annotations

import hashlib
import json
import numbers
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any, ClassVar, NoReturn, TypeVar

import numpy as np
import torch

from nip_like import cache_record
from nip_like.checkpoint import load_checked, save_atomic
from nip_like.errors import CheckpointError, ConfigError, NipLikeError

D = TypeVar("D", bound="TensorDataset")


class DatasetFileError(NipLikeError):
    """A saved dataset file is unreadable, malformed or fails its checksum."""


class CacheRebuildWarning(UserWarning):
    """A cache file was unusable and is being rebuilt."""


def is_int(value: object) -> bool:
    """Whether ``value`` is an integer (``bool`` is not)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: object) -> bool:
    """Whether ``value`` is a finite real number (``bool`` is not)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and np.isfinite(float(value))


def apportion(total: int, weights: Sequence[float]) -> list[int]:
    """Split ``total`` into integer parts proportional to ``weights`` (largest remainder)."""
    scale = sum(weights)
    if total == 0 or scale <= 0:
        return [0] * len(weights)
    shares = [total * weight / scale for weight in weights]
    counts = [int(np.floor(share)) for share in shares]
    by_remainder = sorted(range(len(weights)), key=lambda i: counts[i] - shares[i])
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


class DatasetSpec:
    """Base of a frozen spec dataclass: what a dataset's generator draws.

    Every field and the class's :attr:`generator_version` enter :meth:`key`,
    so neither another spec nor a changed generator ever reuses a cache file.
    """

    #: Version of the generation procedure; a subclass sets it, and bumps it
    #: whenever a spec would draw other tensors than before.
    generator_version: ClassVar[int] = 0

    def _fail(self, field: str, allowed: str, value: object) -> NoReturn:
        """Raise a one-line :class:`~nip_like.errors.ConfigError` naming the field and what it allows."""
        raise ConfigError(f"{type(self).__name__}.{field} must be {allowed}, got {value!r}")

    def _check_integers(self, lowest: Mapping[str, int]) -> None:
        """Check that each field named in ``lowest`` is an integer at least that large; store it as an ``int``."""
        for name, minimum in lowest.items():
            value = getattr(self, name)
            if not is_int(value) or value < minimum:
                self._fail(name, f"an integer >= {minimum}", value)
            object.__setattr__(self, name, int(value))

    def to_dict(self) -> dict[str, Any]:
        """Return the fields as plain JSON values (tuples become lists)."""
        return {
            field.name: list(value) if isinstance(value, tuple) else value
            for field in fields(self)
            for value in [getattr(self, field.name)]
        }

    def key(self) -> str:
        """Return a stable 16-hex-digit hash of all fields and :attr:`generator_version`.

        Unlike :func:`hash`, it is the same in every process; it names the
        dataset's cache file.
        """
        text = json.dumps({"generator_version": self.generator_version, **self.to_dict()}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def cache_metadata(self) -> dict[str, Any]:
        """Return what a cache file stores beside its tensors: the generator version and the fields."""
        return {"generator_version": self.generator_version, "spec": self.to_dict()}


class TensorDataset:
    """Base of a dataset dataclass whose fields are tensors of ``N`` examples each.

    A subclass is a ``@dataclass(eq=False)`` whose fields are all tensors with
    the same first dimension; it sets :attr:`FILE_KIND` and
    :attr:`DESCRIPTION` and checks its layout in ``__post_init__`` with
    :meth:`_check_layout`.
    """

    #: The ``kind`` entry of the dataset's files (e.g. ``"nip_like.graph_pairs"``).
    FILE_KIND: ClassVar[str] = ""
    #: What the dataset is called in messages (e.g. ``"graph-pairs"``).
    DESCRIPTION: ClassVar[str] = ""

    def _check_layout(self, expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        """Raise ``ValueError`` naming the first field that is not a tensor of the expected shape and dtype."""
        for name, (shape, dtype) in expected.items():
            tensor = getattr(self, name)
            if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != shape or tensor.dtype != dtype:
                found = (tuple(tensor.shape), tensor.dtype) if isinstance(tensor, torch.Tensor) else type(tensor)
                raise ValueError(f"{type(self).__name__}.{name} must be a {dtype} tensor of shape {shape}, got {found}")

    def tensors(self) -> dict[str, torch.Tensor]:
        """Return the tensors by field name, in field order."""
        return {field.name: getattr(self, field.name) for field in fields(self)}

    def __len__(self) -> int:
        return next(iter(self.tensors().values())).shape[0]

    def subset(self: D, index: torch.Tensor | slice | Sequence[int] | int) -> D:
        """Select examples; the result is always a dataset (an int ``i`` selects ``[i]``).

        ``index`` is a slice, a bool mask, or integer positions (a tensor, a
        sequence, or one int).
        """
        if not isinstance(index, slice):
            index = torch.as_tensor(index, device=next(iter(self.tensors().values())).device)
            index = index.reshape(1) if index.ndim == 0 else index
            if index.dtype != torch.bool:
                index = index.long()
        return type(self)(**{name: tensor[index] for name, tensor in self.tensors().items()})

    def __getitem__(self: D, index: torch.Tensor | slice | Sequence[int] | int) -> D:
        """The same as :meth:`subset`."""
        return self.subset(index)

    def to(self: D, device: torch.device | str) -> D:
        """Return the dataset with every tensor on ``device``."""
        return type(self)(**{name: tensor.to(device) for name, tensor in self.tensors().items()})

    def checksum(self) -> str:
        """Return the SHA-256 of every tensor's name, dtype, shape and contents."""
        digest = hashlib.sha256()
        for name, tensor in self.tensors().items():
            digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
            digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
        return digest.hexdigest()

    def save(self, path: Path, metadata: Mapping[str, Any] | None = None) -> None:
        """Write the tensors, their checksum and ``metadata`` atomically to ``path``.

        Parameters
        ----------
        path : Path
            The file; its folder is created if needed.
        metadata : mapping, optional
            Plain values (str, numbers, lists, dicts) stored beside the tensors.
        """
        state = {
            "kind": self.FILE_KIND,
            "metadata": dict(metadata or {}),
            "checksum": self.checksum(),
            "tensors": {name: tensor.detach().cpu() for name, tensor in self.tensors().items()},
        }
        save_atomic(state, Path(path))

    @classmethod
    def load(cls: type[D], path: Path) -> D:
        """Read a dataset written by :meth:`save`, checking its layout and checksum.

        Raises
        ------
        DatasetFileError
            If the file is missing, unreadable, not a file of this dataset, or
            its checksum does not match its tensors.
        """
        return cls.read(Path(path))[0]

    @classmethod
    def read(cls: type[D], path: Path, what: str | None = None) -> tuple[D, dict[str, Any]]:
        """Return the dataset and the metadata of a file written by :meth:`save`; like :meth:`load`.

        ``what`` names the file in the messages (``"cache file"`` for the
        cache); by default the dataset's own name.
        """
        try:
            state = load_checked(path, what=what or f"{cls.DESCRIPTION} file")
        except CheckpointError as error:
            raise DatasetFileError(str(error)) from error
        if state.get("kind") != cls.FILE_KIND:
            raise DatasetFileError(f"{path} is not a {cls.DESCRIPTION} file")
        try:
            dataset = cls(**state["tensors"])
        except (KeyError, TypeError, ValueError) as error:
            raise DatasetFileError(f"{path} has malformed tensors ({error})") from error
        if dataset.checksum() != state.get("checksum"):
            raise DatasetFileError(f"{path} fails its checksum: its tensors changed after it was written")
        return dataset, state.get("metadata", {})


def stratified_split(dataset: D, fractions: Mapping[str, float], seed: int) -> dict[str, D]:
    """Cut ``dataset`` into disjoint splits, each with about the same fraction of positive labels.

    The examples with ``label`` true and those with ``label`` false are each
    permuted with a generator seeded by ``seed`` and cut by ``fractions``
    (largest-remainder rounding); each split is then shuffled.

    Parameters
    ----------
    dataset : TensorDataset
        A dataset with a ``label`` field: a ``(N,)`` bool tensor.
    fractions : mapping of str to float
        Split name to fraction, e.g. ``{"train": 0.8, "val": 0.1, "test": 0.1}``;
        fractions in ``[0, 1]`` that sum to 1.
    seed : int
        Seed of the permutation.

    Returns
    -------
    dict of str to TensorDataset
        The splits, in the order of ``fractions``; together they hold every example once.

    Raises
    ------
    ConfigError
        If ``fractions`` is empty, has a value outside ``[0, 1]``, or does not sum to 1.
    """
    values = list(fractions.values())
    if not values or not all(is_real(v) and 0.0 <= v <= 1.0 for v in values) or abs(sum(values) - 1.0) > 1e-6:
        raise ConfigError(f"split fractions must be numbers in [0, 1] that sum to 1, got {dict(fractions)}")
    rng = np.random.default_rng(seed)
    labels = dataset.label.cpu().numpy()
    parts: dict[str, list[np.ndarray]] = {name: [] for name in fractions}
    for value in (True, False):
        members = rng.permutation(np.flatnonzero(labels == value))
        bounds = np.cumsum([0, *apportion(len(members), values)])
        for name, start, stop in zip(fractions, bounds[:-1], bounds[1:]):
            parts[name].append(members[start:stop])
    return {name: dataset[torch.from_numpy(rng.permutation(np.concatenate(chunks)))] for name, chunks in parts.items()}


def _cache_problem(cls: type[D], path: Path, expected: Mapping[str, Any]) -> tuple[D | None, str | None]:
    """Read the cache file; return the dataset, or ``None`` and what is wrong with it."""
    try:
        dataset, metadata = cls.read(path, what="cache file")
    except DatasetFileError as error:
        return None, str(error)
    if metadata != expected:
        stored = metadata.get("spec", {}) if isinstance(metadata.get("spec"), dict) else {}
        differ = [
            f"{name}={stored.get(name)!r} not {value!r}"
            for name, value in expected["spec"].items()
            if stored.get(name) != value
        ]
        version = expected["generator_version"]
        if metadata.get("generator_version") != version:
            differ.append(f"generator_version={metadata.get('generator_version')!r} not {version}")
        return None, f"{path} was written for another spec ({', '.join(differ)})"
    return dataset, None


def load_or_build(cls: type[D], path: Path, spec: DatasetSpec, build: Callable[[], D]) -> D:
    """Return the dataset of ``spec`` cached at ``path``, building and caching it if needed.

    The file holds :meth:`DatasetSpec.cache_metadata` (the spec and the
    generator version) and a checksum beside the tensors. A file that is
    unreadable, malformed, written for another spec or generator version, or
    whose checksum fails is never used: a :class:`CacheRebuildWarning` says in
    one line what was wrong (it points at the caller of the function that
    calls this one), and ``build()`` is called again and its result written
    atomically (temporary file, flush, ``os.replace``: a crash never leaves
    half a file under the cache name). The run in progress records the file
    it used (:func:`nip_like.cache_record.record`).

    Parameters
    ----------
    cls : type
        The dataset class, a :class:`TensorDataset`.
    path : Path
        The cache file; its folder is created if needed.
    spec : DatasetSpec
        What the dataset is drawn from.
    build : callable
        Draws the dataset of ``spec``.

    Returns
    -------
    TensorDataset
        The dataset, on the CPU.
    """
    path, metadata = Path(path), spec.cache_metadata()
    if path.exists():
        dataset, problem = _cache_problem(cls, path, metadata)
        if dataset is not None:
            cache_record.record("dataset", path.stem, path, built=False)
            return dataset
        warnings.warn(f"rebuilding the {cls.DESCRIPTION} cache: {problem}", CacheRebuildWarning, stacklevel=3)
    dataset = build()
    dataset.save(path, metadata=metadata)
    cache_record.record("dataset", path.stem, path, built=True)
    return dataset
