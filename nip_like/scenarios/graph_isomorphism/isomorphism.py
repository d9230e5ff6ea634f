"""Colour refinement (1-WL) and an exact isomorphism test on small dense graphs.

A graph is a square boolean adjacency matrix (a NumPy array, or anything
:func:`numpy.asarray` accepts, such as a CPU tensor) that is symmetric and has
no self loops; node ``i`` is row ``i``. Everything here is plain Python on
neighbour lists, meant for graphs of a dozen nodes or so.

Colour refinement (the 1-dimensional Weisfeiler-Leman algorithm, 1-WL) starts
from one colour for every node. Each *round* gives every node a new colour that
is determined by its old colour and the multiset of its neighbours' old
colours. When two graphs are refined *jointly* (as one disjoint union, so that
they share one palette), a colour means the same thing in both, and the graphs
can be compared round by round through their colour histograms. Isomorphic
graphs always have equal histograms; the converse fails (for example a 6-cycle
and two triangles), which is why :func:`are_isomorphic` adds a search.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

#: Value of :func:`wl_rounds_to_distinguish` recorded in datasets for a pair
#: that 1-WL never tells apart (the function itself returns ``None``).
WL_NEVER = -1

_Colours = list[int]
_Neighbours = list[list[int]]


def as_adjacency(adjacency: object) -> np.ndarray:
    """Return ``adjacency`` as a checked square boolean NumPy array.

    Parameters
    ----------
    adjacency : array-like
        A square matrix; non-zero entries are edges.

    Returns
    -------
    numpy.ndarray
        The ``(n, n)`` boolean adjacency matrix.

    Raises
    ------
    ValueError
        If the matrix is not square, not symmetric or has a self loop.
    """
    matrix = np.asarray(adjacency).astype(bool, copy=False)
    if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1]:
        raise ValueError(f"an adjacency matrix must be square, got shape {matrix.shape}")
    if not np.array_equal(matrix, matrix.T):
        raise ValueError("an adjacency matrix must be symmetric (undirected graph)")
    if matrix.diagonal().any():
        raise ValueError("an adjacency matrix must have no self loops (zero diagonal)")
    return matrix


def _union_neighbours(adj_a: np.ndarray, adj_b: np.ndarray) -> _Neighbours:
    """Neighbour lists of the disjoint union: ``adj_a``'s nodes first, then ``adj_b``'s."""
    offset = adj_a.shape[0]
    neighbours = [np.flatnonzero(row).tolist() for row in adj_a]
    neighbours += [(np.flatnonzero(row) + offset).tolist() for row in adj_b]
    return neighbours


def _refine(colours: _Colours, neighbours: _Neighbours) -> tuple[_Colours, int]:
    """One round of colour refinement; return the new colours and how many there are.

    The new colour of a node is a fresh integer for its signature (old colour,
    sorted neighbour colours), numbered in order of first appearance. As the
    signature contains the old colour, the new partition refines the old one.
    """
    palette: dict[tuple[int, tuple[int, ...]], int] = {}
    refined = []
    for colour, around in zip(colours, neighbours):
        signature = (colour, tuple(sorted([colours[u] for u in around])))
        refined.append(palette.setdefault(signature, len(palette)))
    return refined, len(palette)


def _histograms_differ(colours: _Colours, size_a: int) -> bool:
    """Whether the first ``size_a`` nodes and the others have different colour multisets."""
    return sorted(colours[:size_a]) != sorted(colours[size_a:])


def _marked_colours(size_a: int, size_b: int, marks: Sequence[tuple[int, int]]) -> _Colours:
    """Initial colours of the union: pair ``k`` of ``marks`` individualised in a colour of its own."""
    labels: list[list[int]] = [[] for _ in range(size_a + size_b)]
    for index, (node_a, node_b) in enumerate(marks):
        if not (0 <= node_a < size_a and 0 <= node_b < size_b):
            raise ValueError(f"mark {index} ({node_a}, {node_b}) names a node outside the graphs")
        labels[node_a].append(index)
        labels[size_a + node_b].append(index)
    palette: dict[tuple[int, ...], int] = {}
    return [palette.setdefault(tuple(label), len(palette)) for label in labels]


def wl_rounds_to_distinguish(
    adj_a: object, adj_b: object, max_rounds: int | None = None, marks: Sequence[tuple[int, int]] = ()
) -> int | None:
    """Return the first round in which joint 1-WL tells two graphs apart.

    Both graphs are refined together, as their disjoint union, so that they
    share one palette. Round 0 is the initial colouring, one colour for every
    node. Round ``r >= 1`` applies one refinement step to the colouring of round
    ``r - 1``:

    * after round 1, a node's colour encodes its degree, so round 1 tells the
      graphs apart exactly when their degree histograms differ;
    * after round 2, it encodes the degree and the multiset of the neighbours'
      degrees;
    * after round ``r``, the colour-refinement view of the node's neighbourhood
      of radius ``r``.

    The result is the smallest ``r`` at which the colour histograms of the two
    graphs differ. Graphs of different sizes differ from round 1 on.

    Parameters
    ----------
    adj_a, adj_b : array-like
        Symmetric boolean adjacency matrices without self loops.
    max_rounds : int, optional
        Run at most this many rounds. If not given, the refinement runs until
        the joint partition stops splitting, which takes at most
        ``len(adj_a) + len(adj_b)`` rounds.
    marks : sequence of (int, int), optional
        Individualised pairs ``(node of adj_a, node of adj_b)``: before
        refinement, the two nodes of pair ``k`` share a colour of their own (a
        node in several pairs gets the colour of that set of pairs), as in the
        individualise-and-refine isomorphism test. Round 0 is then this
        colouring, and it already tells the graphs apart when the marks are
        inconsistent (a node marked twice in one graph and not in the other).

    Returns
    -------
    int or None
        The first round with differing histograms (0 only with ``marks``), or
        ``None`` if there is none:
        the refinement became stable with equal histograms (then no later round
        can differ either, and 1-WL never tells the graphs apart), or the
        histograms were still equal after ``max_rounds`` rounds.

    Raises
    ------
    ValueError
        If ``max_rounds`` is less than 1 or a matrix is not a valid adjacency matrix.
    """
    if max_rounds is not None and max_rounds < 1:
        raise ValueError(f"max_rounds must be at least 1 or None, got {max_rounds}")
    adj_a, adj_b = as_adjacency(adj_a), as_adjacency(adj_b)
    size_a = adj_a.shape[0]
    neighbours = _union_neighbours(adj_a, adj_b)
    colours = _marked_colours(size_a, adj_b.shape[0], marks)
    if marks and _histograms_differ(colours, size_a):
        return 0
    num_colours = len(set(colours))
    round_ = 0
    while max_rounds is None or round_ < max_rounds:
        round_ += 1
        colours, refined_count = _refine(colours, neighbours)
        if _histograms_differ(colours, size_a):
            return round_
        if refined_count == num_colours:
            return None
        num_colours = refined_count
    return None


def wl_colours(adjacency: object, rounds: int) -> np.ndarray:
    """Return the colours of one graph's nodes after ``rounds`` rounds of refinement.

    The colours are only comparable between nodes of this one graph: two nodes
    have the same colour exactly when refinement cannot tell them apart after
    ``rounds`` rounds (round 1 groups nodes by degree).

    Parameters
    ----------
    adjacency : array-like
        A symmetric boolean adjacency matrix without self loops.
    rounds : int
        Number of refinement rounds, at least 0.

    Returns
    -------
    numpy.ndarray
        ``(n,)`` integer colours.
    """
    if rounds < 0:
        raise ValueError(f"rounds must be at least 0, got {rounds}")
    matrix = as_adjacency(adjacency)
    neighbours = [np.flatnonzero(row).tolist() for row in matrix]
    colours = [0] * len(neighbours)
    for _ in range(rounds):
        colours, _count = _refine(colours, neighbours)
    return np.asarray(colours, dtype=np.int64)


def _stable_balanced(colours: _Colours, neighbours: _Neighbours, size_a: int) -> _Colours | None:
    """Refine to the stable colouring, or ``None`` as soon as the histograms differ."""
    num_colours = len(set(colours))
    while True:
        if _histograms_differ(colours, size_a):
            return None
        colours, refined_count = _refine(colours, neighbours)
        if refined_count == num_colours:
            return None if _histograms_differ(colours, size_a) else colours
        num_colours = refined_count


def _search(colours: _Colours, neighbours: _Neighbours, adj_a: np.ndarray, adj_b: np.ndarray) -> bool:
    """Individualise-and-refine search for an isomorphism compatible with ``colours``.

    ``colours`` is a stable colouring of the union with equal histograms on the
    two sides. Every isomorphism that maps each node to a node of the same
    colour survives individualising ``v`` and its image, so trying every
    same-coloured image of one node ``v`` is exhaustive.
    """
    size = adj_a.shape[0]
    members: dict[int, list[int]] = {}
    for node in range(size):
        members.setdefault(colours[node], []).append(node)
    split = [cell for cell in members.values() if len(cell) > 1]
    if not split:
        position = {colours[size + node]: node for node in range(size)}
        mapping = np.array([position[colours[node]] for node in range(size)], dtype=np.int64)
        return bool(np.array_equal(adj_a, adj_b[np.ix_(mapping, mapping)]))
    node = min(split, key=len)[0]
    fresh = max(colours) + 1
    for image in range(size):
        if colours[size + image] != colours[node]:
            continue
        trial = list(colours)
        trial[node] = trial[size + image] = fresh
        refined = _stable_balanced(trial, neighbours, size)
        if refined is not None and _search(refined, neighbours, adj_a, adj_b):
            return True
    return False


def are_isomorphic(adj_a: object, adj_b: object, marks: Sequence[tuple[int, int]] = ()) -> bool:
    """Decide exactly whether two graphs are isomorphic (mapping each marked node to its partner).

    Cheap invariants (size, edge count, degree sequence) reject most
    non-isomorphic pairs; then joint colour refinement, and, when it cannot
    decide, a backtracking search that individualises one node at a time and
    refines again (the individualisation-refinement scheme of graph
    canonisation tools, without their automorphism pruning). A result ``True``
    is always backed by an explicit node mapping that was checked edge by edge.

    Parameters
    ----------
    adj_a, adj_b : array-like
        Symmetric boolean adjacency matrices without self loops.
    marks : sequence of (int, int), optional
        Pairs ``(node of adj_a, node of adj_b)`` that the isomorphism must map
        onto each other (the search starts from these pairs individualised).

    Returns
    -------
    bool
        Whether some relabelling of ``adj_b``'s nodes gives ``adj_a`` (and
        sends each mark's second node to its first).
    """
    adj_a, adj_b = as_adjacency(adj_a), as_adjacency(adj_b)
    if adj_a.shape != adj_b.shape:
        return False
    if not np.array_equal(np.sort(adj_a.sum(axis=1)), np.sort(adj_b.sum(axis=1))):
        return False
    colours = _marked_colours(adj_a.shape[0], adj_b.shape[0], marks)
    if adj_a.shape[0] == 0:
        return True
    neighbours = _union_neighbours(adj_a, adj_b)
    stable = _stable_balanced(colours, neighbours, adj_a.shape[0])
    return stable is not None and _search(stable, neighbours, adj_a, adj_b)


def permute(adjacency: np.ndarray, permutation: Sequence[int] | np.ndarray) -> np.ndarray:
    """Relabel a graph: node ``i`` of the result is node ``permutation[i]`` of ``adjacency``.

    Parameters
    ----------
    adjacency : numpy.ndarray
        An ``(n, n)`` adjacency matrix.
    permutation : sequence of int
        A permutation of ``range(n)``.

    Returns
    -------
    numpy.ndarray
        The relabelled ``(n, n)`` matrix, isomorphic to ``adjacency``.
    """
    order = np.asarray(permutation, dtype=np.int64)
    return adjacency[np.ix_(order, order)]
