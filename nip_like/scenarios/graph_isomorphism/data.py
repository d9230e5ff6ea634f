"""Seeded datasets of graph pairs with exact isomorphism labels, cached on disk.

:func:`generate_pairs` draws a :class:`GraphPairs` dataset from a
:class:`GraphPairSpec`; :func:`load_or_generate` keeps it in a checked cache
file; :func:`split_pairs` cuts it into label-stratified splits. The
``docs/gi_data.rst`` page describes how hard pairs are built.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, NoReturn

import numpy as np
import torch

from nip_like.errors import ConfigError
from nip_like.interrupts import stop_point
from nip_like.scenarios.datasets import (
    DatasetSpec,
    TensorDataset,
    apportion,
    is_real,
    load_or_build,
    stratified_split,
)
from nip_like.scenarios.graph_isomorphism.isomorphism import (
    WL_NEVER,
    are_isomorphic,
    permute,
    wl_colours,
    wl_rounds_to_distinguish,
)

#: Version of the generation procedure. It enters :meth:`GraphPairSpec.key`, so
#: a change to how pairs are drawn never reuses an old cache file.
GENERATOR_VERSION = 1

#: Strata of pairs, as returned by :func:`wl_stratum`.
ISOMORPHIC, WL_ROUND_1, WL_ROUND_2, WL_MORE = 0, 1, 2, 3
STRATUM_NAMES = {
    ISOMORPHIC: "isomorphic",
    WL_ROUND_1: "non-isomorphic, 1-WL round 1",
    WL_ROUND_2: "non-isomorphic, 1-WL round 2",
    WL_MORE: "non-isomorphic, 1-WL round > 2 or never",
}

#: Graphs ``A`` tried for one drawn (size, edge probability) before both are drawn again.
ATTEMPTS_PER_DRAW = 200
#: Draws of (size, edge probability) for one pair before generation gives up.
DRAWS_PER_PAIR = 50

def _fail(field: str, allowed: str, value: object) -> NoReturn:
    raise ConfigError(f"GraphPairSpec.{field} must be {allowed}, got {value!r}")


def _float_tuple(field: str, value: object, allowed: str) -> tuple[float, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        _fail(field, allowed, value)
    if not all(is_real(item) for item in value):
        _fail(field, allowed, value)
    return tuple(float(item) for item in value)


@dataclass(frozen=True)
class GraphPairSpec(DatasetSpec):
    """What :func:`generate_pairs` draws; every field enters :meth:`key`.

    ``to_dict``, ``key`` (with :data:`GENERATOR_VERSION`) and
    ``cache_metadata`` come from :class:`~nip_like.scenarios.datasets.DatasetSpec`.

    Parameters
    ----------
    num_pairs : int
        Number of pairs, at least 1.
    seed : int
        Seed of the NumPy generator that draws everything, at least 0.
    min_nodes, max_nodes : int
        Range of graph sizes; each pair's size is uniform in
        ``min_nodes .. max_nodes`` (both graphs of a pair have the same size).
        ``2 <= min_nodes <= max_nodes <= 64``.
    edge_probabilities : tuple of float
        Erdős–Rényi edge probabilities, each strictly between 0 and 1; each
        pair uses one, drawn uniformly.
    isomorphic_fraction : float
        Fraction of isomorphic pairs, in ``[0, 1]``.
    wl_fractions : tuple of float
        Fractions of the non-isomorphic pairs that joint 1-WL tells apart in
        round 1, in round 2, and later or never (see
        :func:`~nip_like.scenarios.graph_isomorphism.isomorphism.wl_rounds_to_distinguish`);
        three numbers in ``[0, 1]`` that sum to 1.

    Raises
    ------
    ConfigError
        If a field is out of range, naming the field and what it allows.
    """

    num_pairs: int
    seed: int = 0
    min_nodes: int = 7
    max_nodes: int = 11
    edge_probabilities: tuple[float, ...] = (0.2, 0.4, 0.6, 0.8)
    isomorphic_fraction: float = 0.5
    wl_fractions: tuple[float, float, float] = (0.1, 0.2, 0.7)

    generator_version: ClassVar[int] = GENERATOR_VERSION

    def __post_init__(self) -> None:
        self._check_integers({"num_pairs": 1, "seed": 0, "min_nodes": 2, "max_nodes": 2})
        if self.min_nodes > self.max_nodes:
            _fail("min_nodes", f"<= max_nodes ({self.max_nodes})", self.min_nodes)
        if self.max_nodes > 64:
            _fail("max_nodes", "at most 64", self.max_nodes)
        allowed = "a non-empty tuple of numbers strictly between 0 and 1"
        probabilities = _float_tuple("edge_probabilities", self.edge_probabilities, allowed)
        if not probabilities or not all(0.0 < p < 1.0 for p in probabilities):
            _fail("edge_probabilities", allowed, self.edge_probabilities)
        object.__setattr__(self, "edge_probabilities", probabilities)
        if not is_real(self.isomorphic_fraction) or not 0.0 <= self.isomorphic_fraction <= 1.0:
            _fail("isomorphic_fraction", "a number in [0, 1]", self.isomorphic_fraction)
        object.__setattr__(self, "isomorphic_fraction", float(self.isomorphic_fraction))
        allowed = "three numbers in [0, 1] that sum to 1"
        stratum_fractions = _float_tuple("wl_fractions", self.wl_fractions, allowed)
        if (
            len(stratum_fractions) != 3
            or not all(0.0 <= f <= 1.0 for f in stratum_fractions)
            or abs(sum(stratum_fractions) - 1.0) > 1e-6
        ):
            _fail("wl_fractions", allowed, self.wl_fractions)
        object.__setattr__(self, "wl_fractions", stratum_fractions)

    def stratum_counts(self) -> dict[int, int]:
        """Return how many pairs of each stratum (:data:`ISOMORPHIC` .. :data:`WL_MORE`) to draw."""
        isomorphic, non_isomorphic = apportion(
            self.num_pairs, [self.isomorphic_fraction, 1.0 - self.isomorphic_fraction]
        )
        by_rounds = apportion(non_isomorphic, list(self.wl_fractions))
        return {ISOMORPHIC: isomorphic, WL_ROUND_1: by_rounds[0], WL_ROUND_2: by_rounds[1], WL_MORE: by_rounds[2]}


@dataclass(eq=False)
class GraphPairs(TensorDataset):
    """A batch of ``N`` graph pairs, padded to ``max_nodes`` nodes.

    Indexing, ``to``, ``checksum``, ``save`` and ``load`` come from
    :class:`~nip_like.scenarios.datasets.TensorDataset`.

    Parameters
    ----------
    adjacency : torch.Tensor
        ``(N, 2, max_nodes, max_nodes)`` bool: the two graphs of each pair,
        symmetric, no self loops, zero outside the first ``num_nodes`` nodes.
    node_mask : torch.Tensor
        ``(N, 2, max_nodes)`` bool: which nodes exist.
    num_nodes : torch.Tensor
        ``(N,)`` long: the size of both graphs of the pair.
    label : torch.Tensor
        ``(N,)`` bool: whether the two graphs are isomorphic (exact).
    wl_rounds : torch.Tensor
        ``(N,)`` long: the round in which joint 1-WL tells the graphs apart
        (:func:`~nip_like.scenarios.graph_isomorphism.isomorphism.wl_rounds_to_distinguish`);
        0 for isomorphic pairs and
        :data:`~nip_like.scenarios.graph_isomorphism.isomorphism.WL_NEVER` (-1)
        for non-isomorphic pairs that 1-WL never tells apart.
    edge_probability : torch.Tensor
        ``(N,)`` float: the Erdős–Rényi edge probability the pair was drawn with.
    """

    adjacency: torch.Tensor
    node_mask: torch.Tensor
    num_nodes: torch.Tensor
    label: torch.Tensor
    wl_rounds: torch.Tensor
    edge_probability: torch.Tensor

    FILE_KIND = "nip_like.graph_pairs"
    DESCRIPTION = "graph-pairs"

    def __post_init__(self) -> None:
        adjacency = self.adjacency
        well_shaped = isinstance(adjacency, torch.Tensor) and adjacency.ndim == 4
        size, nodes = (adjacency.shape[0], adjacency.shape[-1]) if well_shaped else (-1, -1)
        expected = {
            "adjacency": ((size, 2, nodes, nodes), torch.bool),
            "node_mask": ((size, 2, nodes), torch.bool),
            "num_nodes": ((size,), torch.long),
            "label": ((size,), torch.bool),
            "wl_rounds": ((size,), torch.long),
            "edge_probability": ((size,), torch.float32),
        }
        self._check_layout(expected)

    @property
    def max_nodes(self) -> int:
        """The padded number of nodes of every graph."""
        return self.adjacency.shape[-1]


def wl_stratum(wl_rounds: torch.Tensor) -> torch.Tensor:
    """Map :attr:`GraphPairs.wl_rounds` to strata :data:`ISOMORPHIC` .. :data:`WL_MORE`.

    Parameters
    ----------
    wl_rounds : torch.Tensor
        Rounds as stored in :class:`GraphPairs` (0 isomorphic, -1 never).

    Returns
    -------
    torch.Tensor
        Long tensor: 0 isomorphic, 1 and 2 told apart in that round, 3 later or never.
    """
    strata = torch.full_like(wl_rounds, WL_MORE)
    strata[wl_rounds == 0] = ISOMORPHIC
    strata[wl_rounds == 1] = WL_ROUND_1
    strata[wl_rounds == 2] = WL_ROUND_2
    return strata


def _erdos_renyi(rng: np.random.Generator, size: int, probability: float) -> np.ndarray:
    upper = np.triu(rng.random((size, size)) < probability, k=1)
    return upper | upper.T


def _double_edge_swap(rng: np.random.Generator, adjacency: np.ndarray, colours: np.ndarray | None) -> bool:
    """Replace edges ``a-b, c-d`` by ``a-d, c-b`` in place; keep every degree.

    The swap is drawn uniformly among the possible ones; with ``colours``, only
    among those where ``a, c`` and ``b, d`` have equal colours. Return whether
    there was one.
    """
    rows, cols = np.nonzero(adjacency)
    a, b, c, d = rows[:, None], cols[:, None], rows[None, :], cols[None, :]
    possible = (a != c) & (a != d) & (b != c) & (b != d) & ~adjacency[a, d] & ~adjacency[c, b]
    if colours is not None:
        possible &= (colours[a] == colours[c]) & (colours[b] == colours[d])
    first, second = np.nonzero(possible)
    if len(first) == 0:
        return False
    choice = rng.integers(len(first))
    a, b, c, d = rows[first[choice]], cols[first[choice]], rows[second[choice]], cols[second[choice]]
    adjacency[[a, b, c, d], [b, a, d, c]] = False
    adjacency[[a, d, c, b], [d, a, b, c]] = True
    return True


def _partner(rng: np.random.Generator, graph: np.ndarray, probability: float, stratum: int) -> np.ndarray | None:
    """Build graph B for graph A, aiming at ``stratum``; ``None`` if no swap was possible.

    * isomorphic: a copy of A;
    * round 1: an independent Erdős–Rényi graph;
    * round 2: A after 1 to 3 random double-edge swaps (same degrees, so never round 1);
    * later: A after 1 to 3 swaps between edges whose end points have equal
      degrees, which leaves every node's round-2 colour as it was (so never
      round 1 or 2).

    B is relabelled by the caller.
    """
    if stratum == ISOMORPHIC:
        return graph.copy()
    if stratum == WL_ROUND_1:
        return _erdos_renyi(rng, graph.shape[0], probability)
    colours = wl_colours(graph, 1) if stratum == WL_MORE else None
    partner = graph.copy()
    for _ in range(rng.integers(1, 4)):
        if not _double_edge_swap(rng, partner, colours):
            break
    return None if np.array_equal(partner, graph) else partner


def _stratum_of(rounds: int | None) -> int:
    if rounds is None or rounds > 2:
        return WL_MORE
    return rounds


def _draw_pair(
    rng: np.random.Generator, spec: GraphPairSpec, stratum: int, seen: set[bytes]
) -> tuple[np.ndarray, np.ndarray, int, float]:
    """Draw one new pair of ``stratum``; return A, B, the stored WL rounds and the edge probability."""
    for _draw in range(DRAWS_PER_PAIR):
        size = int(rng.integers(spec.min_nodes, spec.max_nodes + 1))
        probability = spec.edge_probabilities[rng.integers(len(spec.edge_probabilities))]
        for _attempt in range(ATTEMPTS_PER_DRAW):
            graph = _erdos_renyi(rng, size, probability)
            partner = _partner(rng, graph, probability, stratum)
            if partner is None:
                continue
            partner = permute(partner, rng.permutation(size))
            key = bytes([size]) + np.packbits(graph).tobytes() + np.packbits(partner).tobytes()
            if key in seen:
                continue
            if stratum == ISOMORPHIC:
                if not are_isomorphic(graph, partner):  # cannot happen: B is a relabelling of A
                    raise AssertionError("a relabelled graph was found non-isomorphic to itself")
                seen.add(key)
                return graph, partner, 0, probability
            rounds = wl_rounds_to_distinguish(graph, partner)
            if _stratum_of(rounds) != stratum or are_isomorphic(graph, partner):
                continue
            seen.add(key)
            return graph, partner, WL_NEVER if rounds is None else rounds, probability
    raise ConfigError(
        f"GraphPairSpec: could not draw a new '{STRATUM_NAMES[stratum]}' pair with "
        f"{spec.min_nodes}..{spec.max_nodes} nodes and edge probabilities {spec.edge_probabilities} "
        f"in {DRAWS_PER_PAIR * ATTEMPTS_PER_DRAW} tries; allow larger graphs, fewer pairs, or set its fraction to 0"
    )


def generate_pairs(spec: GraphPairSpec) -> GraphPairs:
    """Draw the dataset that ``spec`` describes; the same spec gives the same tensors.

    Every pair draws a size ``n`` and an edge probability ``p``, then a graph A
    from ``G(n, p)`` and a partner B built for the pair's stratum (see
    ``docs/gi_data.rst``); B's nodes are then relabelled uniformly at random. A
    candidate is kept only if it is new, falls into the wanted 1-WL stratum and
    :func:`~nip_like.scenarios.graph_isomorphism.isomorphism.are_isomorphic`
    confirms its label. If :data:`ATTEMPTS_PER_DRAW` graphs A fail, ``n`` and
    ``p`` are drawn again. The pairs are shuffled at the end.

    Parameters
    ----------
    spec : GraphPairSpec
        What to draw.

    Returns
    -------
    GraphPairs
        ``spec.num_pairs`` distinct pairs, padded to ``spec.max_nodes`` nodes, on the CPU.

    Raises
    ------
    ConfigError
        If some stratum cannot be filled (graphs too small for hard pairs, or
        more pairs asked for than there are distinct ones).
    """
    rng = np.random.default_rng(spec.seed)
    total, width = spec.num_pairs, spec.max_nodes
    adjacency = np.zeros((total, 2, width, width), dtype=bool)
    num_nodes = np.zeros(total, dtype=np.int64)
    wl_rounds = np.zeros(total, dtype=np.int64)
    edge_probability = np.zeros(total, dtype=np.float32)
    seen: set[bytes] = set()
    index = 0
    for stratum, count in spec.stratum_counts().items():
        for _ in range(count):
            stop_point("the generation of the graph pairs")
            graph, partner, rounds, probability = _draw_pair(rng, spec, stratum, seen)
            size = graph.shape[0]
            adjacency[index, 0, :size, :size] = graph
            adjacency[index, 1, :size, :size] = partner
            num_nodes[index], wl_rounds[index], edge_probability[index] = size, rounds, probability
            index += 1
    order = rng.permutation(total)
    num_nodes_tensor = torch.from_numpy(num_nodes[order])
    node_mask = torch.arange(width) < num_nodes_tensor[:, None, None]
    return GraphPairs(
        adjacency=torch.from_numpy(adjacency[order]),
        node_mask=node_mask.expand(total, 2, width).clone(),
        num_nodes=num_nodes_tensor,
        label=torch.from_numpy(wl_rounds[order] == 0),
        wl_rounds=torch.from_numpy(wl_rounds[order]),
        edge_probability=torch.from_numpy(edge_probability[order]),
    )


def split_pairs(pairs: GraphPairs, fractions: Mapping[str, float], seed: int) -> dict[str, GraphPairs]:
    """Cut ``pairs`` into disjoint splits, each with about the same isomorphic fraction.

    The isomorphic and the non-isomorphic pairs are each permuted with a
    generator seeded by ``seed`` and cut by ``fractions`` (for example
    ``{"train": 0.8, "val": 0.1, "test": 0.1}``); each split is then shuffled.
    This is :func:`~nip_like.scenarios.datasets.stratified_split`, whose
    parameters and errors it shares.
    """
    return stratified_split(pairs, fractions, seed)


def cache_path(spec: GraphPairSpec, cache_dir: Path) -> Path:
    """Return the cache file of ``spec`` in ``cache_dir``: ``gi_pairs_<spec.key()>.pt``."""
    return Path(cache_dir) / f"gi_pairs_{spec.key()}.pt"


def _cache_metadata(spec: GraphPairSpec) -> dict[str, Any]:
    return spec.cache_metadata()


def load_or_generate(spec: GraphPairSpec, cache_dir: Path) -> GraphPairs:
    """Return the pairs of ``spec`` from the cache, drawing and caching them if needed.

    The file is :func:`cache_path`; it holds the spec, :data:`GENERATOR_VERSION`
    and a checksum beside the tensors. A file that is unreadable, malformed,
    written for another spec or whose checksum fails is never used: a
    :class:`~nip_like.scenarios.datasets.CacheRebuildWarning` says what was wrong, and the pairs are drawn
    again and written atomically (temporary file, then ``os.replace``).

    Parameters
    ----------
    spec : GraphPairSpec
        What to load or draw.
    cache_dir : Path
        Folder of the cache files; created if needed.

    Returns
    -------
    GraphPairs
        The pairs, on the CPU.
    """
    return load_or_build(GraphPairs, cache_path(spec, cache_dir), spec, lambda: generate_pairs(spec))
