"""Seeded datasets of short lists of values, labelled by whether two of them are equal, cached on disk.

The task: given a list ``x_0 .. x_{L-1}`` of values in ``0 .. V-1``, does it
hold a duplicate pair ``i != j`` with ``x_i == x_j``? A positive list holds
exactly one such pair, so its certificate ``(i, j)`` is unique and can be
checked by looking at two cells (:func:`certificate_holds`); a verifier that
only sees the cells it names, without a prover, can barely beat chance
(:func:`solo_verifier_accuracy`).

:func:`generate_lists` draws a :class:`DuplicateLists` dataset from a
:class:`DuplicateSpec`; :func:`load_or_generate` keeps it in a checked cache
file; :func:`split_lists` cuts it into label-stratified splits. The
``docs/duplicates_data.rst`` page describes the generator and the bound. This
module registers nothing.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from math import comb
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from nip_like.scenarios.datasets import (
    DatasetSpec,
    TensorDataset,
    is_real,
    load_or_build,
    stratified_split,
)

#: Version of the generation procedure. It enters :meth:`DuplicateSpec.key`, so
#: a change to how lists are drawn never reuses an old cache file.
GENERATOR_VERSION = 1

#: The certificate stored for a list without a duplicate.
NO_CERTIFICATE = (-1, -1)


@dataclass(frozen=True)
class DuplicateSpec(DatasetSpec):
    """The lists that :func:`generate_lists` draws.

    Its ``key()``, a hash of all fields and :data:`GENERATOR_VERSION`, names
    the cache file (:class:`~nip_like.scenarios.datasets.DatasetSpec` gives it
    ``to_dict``, ``key`` and ``cache_metadata``).

    Parameters
    ----------
    num_lists : int
        Number of lists, at least 2.
    length : int
        ``L``, the number of values in a list: ``2 <= length <= num_values``
        (a list without a duplicate needs ``L`` different values).
    num_values : int
        ``V``, the values are ``0 .. V-1``; at least 2.
    seed : int
        Seed of the NumPy generator that draws everything, at least 0.
    positive_fraction : float
        Fraction of lists with a duplicate, strictly between 0 and 1; exactly
        ``round(num_lists * positive_fraction)`` lists (Python's ``round``,
        halves to even) hold one, and that number must be neither 0 nor
        ``num_lists``.

    Raises
    ------
    ConfigError
        If a field is out of range, naming the field and what it allows.
    """

    num_lists: int = 4000
    length: int = 8
    num_values: int = 16
    seed: int = 0
    positive_fraction: float = 0.5

    generator_version: ClassVar[int] = GENERATOR_VERSION

    def __post_init__(self) -> None:
        self._check_integers({"num_lists": 2, "length": 2, "num_values": 2, "seed": 0})
        if self.length > self.num_values:
            allowed = f"at most num_values ({self.num_values}) so that lists without a duplicate exist"
            self._fail("length", allowed, self.length)
        if not is_real(self.positive_fraction) or not 0.0 < self.positive_fraction < 1.0:
            self._fail("positive_fraction", "a number strictly between 0 and 1", self.positive_fraction)
        object.__setattr__(self, "positive_fraction", float(self.positive_fraction))
        if not 0 < self.num_positives < self.num_lists:
            self._fail(
                "positive_fraction",
                f"such that round({self.num_lists} * positive_fraction) is between 1 and {self.num_lists - 1}",
                self.positive_fraction,
            )

    @property
    def num_positives(self) -> int:
        """The number of lists with a duplicate: ``round(num_lists * positive_fraction)``."""
        return round(self.num_lists * self.positive_fraction)


@dataclass(eq=False)
class DuplicateLists(TensorDataset):
    """A batch of ``N`` lists of ``L`` values, with exact labels and certificates.

    Indexing (:meth:`~nip_like.scenarios.datasets.TensorDataset.subset`),
    ``to``, ``checksum``, ``save`` and ``load`` come from
    :class:`~nip_like.scenarios.datasets.TensorDataset`.

    Parameters
    ----------
    values : torch.Tensor
        ``(N, L)`` long: the lists, values in ``0 .. V-1``.
    label : torch.Tensor
        ``(N,)`` bool: whether the list holds two equal values (exact).
    certificate : torch.Tensor
        ``(N, 2)`` long: for a positive list the positions ``i < j`` of its
        one duplicate pair (``values[i] == values[j]``); :data:`NO_CERTIFICATE`
        ``(-1, -1)`` for a negative one.
    """

    values: torch.Tensor
    label: torch.Tensor
    certificate: torch.Tensor

    FILE_KIND = "nip_like.duplicate_lists"
    DESCRIPTION = "duplicate-lists"

    def __post_init__(self) -> None:
        values = self.values
        size, length = tuple(values.shape) if isinstance(values, torch.Tensor) and values.ndim == 2 else (-1, -1)
        expected = {
            "values": ((size, length), torch.long),
            "label": ((size,), torch.bool),
            "certificate": ((size, 2), torch.long),
        }
        self._check_layout(expected)

    @property
    def length(self) -> int:
        """``L``, the number of values in every list."""
        return self.values.shape[1]


def equal_pairs(values: torch.Tensor) -> torch.Tensor:
    """Count the pairs of positions ``i < j`` with equal values in each list.

    Parameters
    ----------
    values : torch.Tensor
        ``(N, L)`` integer lists.

    Returns
    -------
    torch.Tensor
        ``(N,)`` long; a list has a duplicate iff its count is positive.
    """
    equal = values[:, :, None] == values[:, None, :]
    return torch.triu(equal, diagonal=1).sum(dim=(1, 2))


def certificate_holds(values: torch.Tensor, certificate: torch.Tensor) -> torch.Tensor:
    """Check certificates: two different positions of each list that hold equal values.

    This is all a verifier needs to see to accept: the two cells the
    certificate names. The order of ``i`` and ``j`` does not matter.

    Parameters
    ----------
    values : torch.Tensor
        ``(N, L)`` integer lists.
    certificate : torch.Tensor
        ``(N, 2)`` integer positions ``(i, j)``; any values (out of range ones
        fail).

    Returns
    -------
    torch.Tensor
        ``(N,)`` bool: ``0 <= i, j < L``, ``i != j`` and ``values[i] == values[j]``.
    """
    length = values.shape[1]
    inside = ((certificate >= 0) & (certificate < length)).all(dim=1)
    positions = certificate.clamp(0, length - 1).long()
    cells = values.gather(1, positions)
    return inside & (positions[:, 0] != positions[:, 1]) & (cells[:, 0] == cells[:, 1])


def solo_verifier_accuracy(length: int, revealed: int, positive_fraction: float = 0.5) -> float:
    """The best accuracy of a verifier, without a prover, that sees ``revealed`` cells of a list.

    Let ``q = C(k, 2) / C(L, 2) = k (k - 1) / (L (L - 1))`` for ``k = revealed``
    and ``π = positive_fraction``. A negative list never shows two equal cells;
    a positive one does iff both positions of its one duplicate pair are among
    the ``k`` revealed cells, which happens with probability ``q``. No other
    evidence exists: the law of a list of either label does not change when
    the values ``0 .. V-1`` are permuted, so revealed cells without a match
    show a uniformly random sequence of distinct values under both labels, and
    the duplicate pair of a positive list stays uniform among the pairs not
    inside the revealed cells. This holds for cells chosen one at a time,
    each after seeing the earlier ones, too: a new cell completes the pair
    with probability ``t / (C(L, 2) - C(t, 2))`` after ``t`` cells without a
    match, and the product of the complements telescopes to ``1 - q``.

    The best rule says "duplicate" on a match and, without one, whichever
    label is more likely, so its accuracy is::

        π q + max(π (1 - q), 1 - π)        = 1/2 + q/2   at π = 1/2.

    With ``L = 8`` and ``π = 1/2``: 0.5 for ``k = 0`` or ``1``, ``1/2 + 1/56 =
    0.518`` for ``k = 2`` (the two cells of one message ``"i j"``), 0.554 for
    ``k = 3``, 0.607 for ``k = 4``, and 1 for ``k = 8``. ``V`` plays no part.

    Parameters
    ----------
    length : int
        ``L``, at least 2.
    revealed : int
        ``k``, the number of different cells the verifier sees, ``0 .. L``.
    positive_fraction : float
        ``π``, the fraction of lists with a duplicate.

    Returns
    -------
    float
        The accuracy of the best verifier.
    """
    if not 0 <= revealed <= length or length < 2:
        raise ValueError(f"revealed must be in 0 .. length and length >= 2, got revealed={revealed}, length={length}")
    q = comb(revealed, 2) / comb(length, 2)
    return positive_fraction * q + max(positive_fraction * (1 - q), 1 - positive_fraction)


def _distinct_rows(rng: np.random.Generator, rows: int, width: int, num_values: int) -> np.ndarray:
    """Draw ``rows`` uniform sequences of ``width`` distinct values in ``0 .. num_values-1``."""
    return rng.permuted(np.tile(np.arange(num_values, dtype=np.int64), (rows, 1)), axis=1)[:, :width]


def generate_lists(spec: DuplicateSpec) -> DuplicateLists:
    """Draw the dataset that ``spec`` describes; the same spec gives the same tensors.

    Everything is drawn from one ``numpy.random.Generator`` seeded with
    ``spec.seed``, each list independently of the others (so a list may occur
    twice when there are few possible lists; never among the 4000 of the
    default spec):

    * a negative list is ``L`` distinct values, a uniformly random sequence;
    * a positive list draws its duplicate pair ``i < j`` uniformly among the
      ``C(L, 2)`` pairs of positions and ``L - 1`` distinct values uniformly;
      the first fills both ``i`` and ``j``, the others the remaining
      positions in order. It is thus uniform among the lists in which one
      value occurs exactly twice and every other value at most once.

    Labels and certificates are then computed from the values alone
    (:func:`equal_pairs`) and checked against what was drawn; the lists are
    shuffled at the end.

    Parameters
    ----------
    spec : DuplicateSpec
        What to draw.

    Returns
    -------
    DuplicateLists
        ``spec.num_lists`` lists, ``spec.num_positives`` of them positive, on the CPU.
    """
    rng = np.random.default_rng(spec.seed)
    length, positives = spec.length, spec.num_positives
    negatives = spec.num_lists - positives
    negative_values = _distinct_rows(rng, negatives, length, spec.num_values)
    drawn = _distinct_rows(rng, positives, length - 1, spec.num_values)
    pairs = np.array(list(itertools.combinations(range(length), 2)), dtype=np.int64)
    certificates = pairs[rng.integers(len(pairs), size=positives)]
    positive_values = np.empty((positives, length), dtype=np.int64)
    rows = np.arange(positives)
    others = np.ones((positives, length), dtype=bool)
    others[rows, certificates[:, 0]] = others[rows, certificates[:, 1]] = False
    positive_values[others] = drawn[:, 1:].reshape(-1)
    positive_values[rows, certificates[:, 0]] = positive_values[rows, certificates[:, 1]] = drawn[:, 0]

    order = rng.permutation(spec.num_lists)
    values = torch.from_numpy(np.concatenate([negative_values, positive_values])[order])
    intended_label = torch.from_numpy(np.repeat([False, True], [negatives, positives])[order])
    intended_certificate = np.concatenate([np.tile(NO_CERTIFICATE, (negatives, 1)), certificates])[order]
    counts = equal_pairs(values)
    label = counts > 0
    if not torch.equal(label, intended_label) or bool((counts > 1).any()):  # cannot happen
        raise AssertionError("a drawn list does not have the duplicates it was drawn with")
    certificate = torch.full((spec.num_lists, 2), -1, dtype=torch.long)
    equal = torch.triu(values[:, :, None] == values[:, None, :], diagonal=1)
    found = equal.flatten(1).nonzero()
    certificate[found[:, 0], 0], certificate[found[:, 0], 1] = found[:, 1] // length, found[:, 1] % length
    if not torch.equal(certificate, torch.from_numpy(intended_certificate)):  # cannot happen
        raise AssertionError("a drawn list's duplicate pair is not where it was put")
    return DuplicateLists(values=values, label=label, certificate=certificate)


def split_lists(lists: DuplicateLists, fractions: Mapping[str, float], seed: int) -> dict[str, DuplicateLists]:
    """Cut ``lists`` into disjoint label-stratified splits (:func:`~nip_like.scenarios.datasets.stratified_split`).

    ``fractions`` maps split names to fractions that sum to 1, for example
    ``{"train": 0.8, "val": 0.1, "test": 0.1}``; every split gets about the
    dataset's fraction of positive lists, and the same ``seed`` the same splits.
    """
    return stratified_split(lists, fractions, seed)


def cache_path(spec: DuplicateSpec, cache_dir: Path) -> Path:
    """Return the cache file of ``spec`` in ``cache_dir``: ``duplicate_lists_<spec.key()>.pt``."""
    return Path(cache_dir) / f"duplicate_lists_{spec.key()}.pt"


def load_or_generate(spec: DuplicateSpec, cache_dir: Path) -> DuplicateLists:
    """Return the lists of ``spec`` from the cache file :func:`cache_path` in ``cache_dir``, drawing them if needed.

    A cache file that is unreadable, malformed, written for another spec or
    :data:`GENERATOR_VERSION`, or whose checksum fails is rebuilt with a
    :class:`~nip_like.scenarios.datasets.CacheRebuildWarning`; see
    :func:`~nip_like.scenarios.datasets.load_or_build`. The lists are on the CPU.
    """
    return load_or_build(DuplicateLists, cache_path(spec, cache_dir), spec, lambda: generate_lists(spec))
