"""Graph-isomorphism data: exact isomorphism test and 1-WL rounds."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from nip_like.scenarios.graph_isomorphism.isomorphism import (
    are_isomorphic,
    permute,
    wl_colours,
    wl_rounds_to_distinguish,
)


def graph(size: int, edges: list[tuple[int, int]]) -> np.ndarray:
    adjacency = np.zeros((size, size), dtype=bool)
    for a, b in edges:
        adjacency[a, b] = adjacency[b, a] = True
    return adjacency


def cycle(size: int, start: int = 0) -> list[tuple[int, int]]:
    return [(start + i, start + (i + 1) % size) for i in range(size)]


def path_edges(size: int) -> list[tuple[int, int]]:
    return [(i, i + 1) for i in range(size - 1)]


def brute_force_isomorphic(adj_a: np.ndarray, adj_b: np.ndarray) -> bool:
    if adj_a.shape != adj_b.shape:
        return False
    return any(np.array_equal(adj_a, permute(adj_b, p)) for p in itertools.permutations(range(len(adj_a))))


def reference_wl_rounds(adj_a: np.ndarray, adj_b: np.ndarray) -> int | None:
    """1-WL on each graph separately, colours interned in one shared table, run for 2n rounds."""
    colours = [[0] * len(adj_a), [0] * len(adj_b)]
    for round_ in range(1, len(adj_a) + len(adj_b) + 2):
        table: dict = {}
        colours = [
            [
                table.setdefault((old[v], tuple(sorted(old[u] for u in np.flatnonzero(adj[v])))), len(table))
                for v in range(len(adj))
            ]
            for adj, old in zip((adj_a, adj_b), colours)
        ]
        if sorted(colours[0]) != sorted(colours[1]):
            return round_
    return None


def random_graph(rng: np.random.Generator, size: int, probability: float) -> np.ndarray:
    upper = np.triu(rng.random((size, size)) < probability, k=1)
    return upper | upper.T


def swap_two_edges(rng: np.random.Generator, adjacency: np.ndarray) -> np.ndarray:
    """Replace edges a-b, c-d by a-d, c-b (same degrees) for a random possible choice, if any."""
    edges = [tuple(edge) for edge in np.argwhere(adjacency)]
    for index in rng.permutation(len(edges) ** 2):
        (a, b), (c, d) = edges[index // len(edges)], edges[index % len(edges)]
        if len({a, b, c, d}) == 4 and not adjacency[a, d] and not adjacency[c, b]:
            swapped = adjacency.copy()
            swapped[[a, b, c, d], [b, a, d, c]] = False
            swapped[[a, d, c, b], [d, a, b, c]] = True
            return swapped
    return adjacency.copy()


# ---------------------------------------------------------------- isomorphism


def test_six_cycle_and_two_triangles_are_never_told_apart_by_wl():
    hexagon = graph(6, cycle(6))
    triangles = graph(6, cycle(3) + cycle(3, start=3))
    assert wl_rounds_to_distinguish(hexagon, triangles) is None
    assert not are_isomorphic(hexagon, triangles)
    assert not brute_force_isomorphic(hexagon, triangles)


def test_a_graph_and_a_relabelling_of_it_are_isomorphic():
    rng = np.random.default_rng(0)
    petersen = graph(10, cycle(5) + [(5, 7), (7, 9), (9, 6), (6, 8), (8, 5)] + [(i, i + 5) for i in range(5)])
    for adjacency in (petersen, random_graph(rng, 9, 0.5), graph(6, cycle(6)), np.zeros((7, 7), bool)):
        shuffled = permute(adjacency, rng.permutation(len(adjacency)))
        assert are_isomorphic(adjacency, shuffled)
        assert wl_rounds_to_distinguish(adjacency, shuffled) is None


def test_path_and_star_differ_in_round_one():
    path = graph(4, path_edges(4))
    star = graph(4, [(0, 1), (0, 2), (0, 3)])
    assert wl_rounds_to_distinguish(path, star) == 1
    assert not are_isomorphic(path, star)


def test_square_plus_edge_and_six_path_differ_only_in_round_two():
    # Both have degrees (2, 2, 2, 2, 1, 1). In C4 + K2 a degree-1 node's neighbour
    # has degree 1; in P6 it has degree 2: the round-2 colours differ.
    square_plus_edge = graph(6, cycle(4) + [(4, 5)])
    path = graph(6, path_edges(6))
    assert wl_rounds_to_distinguish(square_plus_edge, path) == 2
    assert wl_rounds_to_distinguish(square_plus_edge, path, max_rounds=1) is None
    assert wl_rounds_to_distinguish(path, square_plus_edge, max_rounds=2) == 2
    assert not are_isomorphic(square_plus_edge, path)


def test_graphs_of_different_sizes():
    assert wl_rounds_to_distinguish(np.zeros((3, 3), bool), np.zeros((4, 4), bool)) == 1
    assert not are_isomorphic(np.zeros((3, 3), bool), np.zeros((4, 4), bool))
    assert are_isomorphic(np.zeros((0, 0), bool), np.zeros((0, 0), bool))


def test_invalid_matrices_are_rejected():
    with pytest.raises(ValueError, match="symmetric"):
        are_isomorphic(np.triu(np.ones((3, 3), bool), k=1), np.zeros((3, 3), bool))
    with pytest.raises(ValueError, match="self loops"):
        wl_rounds_to_distinguish(np.eye(3, dtype=bool), np.zeros((3, 3), bool))
    with pytest.raises(ValueError, match="max_rounds"):
        wl_rounds_to_distinguish(np.zeros((3, 3), bool), np.zeros((3, 3), bool), max_rounds=0)


def test_exact_test_and_wl_rounds_agree_with_brute_force_on_random_small_graphs():
    rng = np.random.default_rng(7)
    outcomes = set()
    for _ in range(250):
        size = int(rng.integers(1, 7))
        adj_a = random_graph(rng, size, rng.choice([0.3, 0.5, 0.7]))
        kind = rng.integers(3)
        if kind == 0:  # a relabelling
            adj_b = permute(adj_a, rng.permutation(size))
        elif kind == 1:  # same degrees: a double-edge swap, when one exists
            adj_b = permute(swap_two_edges(rng, adj_a), rng.permutation(size))
        else:
            adj_b = random_graph(rng, size, 0.5)
        expected = brute_force_isomorphic(adj_a, adj_b)
        assert are_isomorphic(adj_a, adj_b) == expected
        rounds = wl_rounds_to_distinguish(adj_a, adj_b)
        assert rounds == reference_wl_rounds(adj_a, adj_b)
        assert rounds == wl_rounds_to_distinguish(adj_b, adj_a)
        outcomes.add((expected, rounds))
    assert {(True, None), (False, 1), (False, 2)} <= outcomes


def test_there_are_34_graphs_on_five_nodes_up_to_isomorphism():
    slots = list(itertools.combinations(range(5), 2))
    classes: list[np.ndarray] = []
    for bits in range(2 ** len(slots)):
        adjacency = graph(5, [slot for k, slot in enumerate(slots) if bits >> k & 1])
        if not any(are_isomorphic(adjacency, known) for known in classes):
            classes.append(adjacency)
    assert len(classes) == 34


def test_wl_colours_of_round_one_are_degree_classes():
    star = graph(5, [(0, 1), (0, 2), (0, 3), (0, 4)])
    colours = wl_colours(star, 1)
    assert colours[1] == colours[2] == colours[3] == colours[4] != colours[0]
    assert (wl_colours(star, 0) == 0).all()
