"""Graph-isomorphism data: exact isomorphism test, 1-WL rounds, generator, splits, cache and script."""

from __future__ import annotations

import importlib.util
import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from nip_like.errors import ConfigError
from nip_like.scenarios.graph_isomorphism import data
from nip_like.scenarios.graph_isomorphism.data import (
    ISOMORPHIC,
    WL_MORE,
    WL_ROUND_1,
    WL_ROUND_2,
    GraphPairs,
    GraphPairSpec,
    cache_path,
    generate_pairs,
    load_or_generate,
    split_pairs,
    wl_stratum,
)
from nip_like.scenarios.graph_isomorphism.isomorphism import (
    WL_NEVER,
    are_isomorphic,
    permute,
    wl_colours,
    wl_rounds_to_distinguish,
)
from tests import dataset_checks as checks

REPO_ROOT = Path(__file__).resolve().parent.parent
SMALL = GraphPairSpec(num_pairs=300, seed=1, min_nodes=5, max_nodes=8)


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


def test_individualised_pairs_separate_what_refinement_alone_cannot():
    # 1-WL never tells a 6-cycle from two triangles. Mark one node in each: the
    # marked node's two neighbours are adjacent in a triangle and not in the
    # cycle, which the second round sees.
    six_cycle = graph(6, cycle(6))
    triangles = graph(6, cycle(3) + [(3, 4), (4, 5), (3, 5)])
    assert wl_rounds_to_distinguish(six_cycle, triangles) is None
    assert wl_rounds_to_distinguish(six_cycle, triangles, marks=[(0, 0)]) == 2
    assert wl_rounds_to_distinguish(six_cycle, triangles, max_rounds=1, marks=[(0, 0)]) is None
    # Isomorphic paths: marks on corresponding nodes never separate them, a
    # mark on a node that does not correspond does.
    path = graph(4, path_edges(4))  # 0-1-2-3
    relabelled = graph(4, [(1, 3), (3, 0), (0, 2)])  # 1-3-0-2: node 1 of the first is 3 or 0 here
    assert wl_rounds_to_distinguish(path, relabelled, marks=[(1, 3)]) is None
    assert wl_rounds_to_distinguish(path, relabelled, marks=[(1, 3), (0, 1)]) is None
    assert wl_rounds_to_distinguish(path, relabelled, marks=[(1, 1)]) == 1
    # The exact test with the same marks: an isomorphism must map each pair onto each other.
    assert are_isomorphic(path, relabelled, marks=[(1, 3)]) and are_isomorphic(path, relabelled, marks=[(1, 0)])
    assert are_isomorphic(path, relabelled, marks=[(1, 3), (0, 1)])
    assert not are_isomorphic(path, relabelled, marks=[(1, 1)])
    assert not are_isomorphic(path, relabelled, marks=[(1, 3), (0, 2)])  # 0 is next to 1, 2 is not next to 3
    # Inconsistent marks (one node in both pairs here, two nodes there) differ before any refinement.
    assert wl_rounds_to_distinguish(path, relabelled, marks=[(1, 3), (1, 0)]) == 0
    with pytest.raises(ValueError, match="outside the graphs"):
        wl_rounds_to_distinguish(path, relabelled, marks=[(4, 0)])


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


# ---------------------------------------------------------------- spec


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"num_pairs": 0}, "num_pairs"),
        ({"num_pairs": 10, "min_nodes": 9, "max_nodes": 7}, "min_nodes"),
        ({"num_pairs": 10, "min_nodes": 1}, "min_nodes"),
        ({"num_pairs": 10, "max_nodes": 65}, "max_nodes"),
        ({"num_pairs": 10, "seed": -1}, "seed"),
        ({"num_pairs": 10, "edge_probabilities": (0.0, 0.5)}, "edge_probabilities"),
        ({"num_pairs": 10, "edge_probabilities": (0.5, 1.0)}, "edge_probabilities"),
        ({"num_pairs": 10, "edge_probabilities": ()}, "edge_probabilities"),
        ({"num_pairs": 10, "isomorphic_fraction": 1.5}, "isomorphic_fraction"),
        ({"num_pairs": 10, "wl_fractions": (0.5, 0.5, 0.5)}, "wl_fractions"),
        ({"num_pairs": 10, "wl_fractions": (0.5, 0.5)}, "wl_fractions"),
        ({"num_pairs": 10, "wl_fractions": (-0.5, 0.5, 1.0)}, "wl_fractions"),
        ({"num_pairs": 2.5}, "num_pairs"),
    ],
)
def test_bad_specs_are_rejected_in_one_line_naming_the_field(fields, named):
    with pytest.raises(ConfigError) as caught:
        GraphPairSpec(**fields)
    message = str(caught.value)
    assert f"GraphPairSpec.{named}" in message and "\n" not in message


def test_key_is_stable_and_covers_every_field():
    spec = GraphPairSpec(num_pairs=10)
    assert spec.key() == GraphPairSpec(num_pairs=10, edge_probabilities=[0.2, 0.4, 0.6, 0.8]).key()
    assert spec.key() == GraphPairSpec(num_pairs=10, isomorphic_fraction=0.5, wl_fractions=(0.1, 0.2, 0.7)).key()
    assert re.fullmatch("[0-9a-f]{16}", spec.key()), spec.key()  # 16 hex digits: a cache file name
    # A changed key orphans every cache file: bump GENERATOR_VERSION on purpose, never by accident.
    assert spec.key() == "de0a145388e458bf"
    changed = [
        {"num_pairs": 11},
        {"seed": 1},
        {"min_nodes": 6},
        {"max_nodes": 12},
        {"edge_probabilities": (0.3,)},
        {"isomorphic_fraction": 0.4},
        {"wl_fractions": (0.2, 0.2, 0.6)},
    ]
    keys = {GraphPairSpec(**{"num_pairs": 10, **change}).key() for change in changed}
    assert len(keys) == len(changed) and spec.key() not in keys


def test_infeasible_stratum_raises_a_config_error(monkeypatch):
    monkeypatch.setattr(data, "ATTEMPTS_PER_DRAW", 5)
    monkeypatch.setattr(data, "DRAWS_PER_PAIR", 4)
    # No two non-isomorphic graphs on 4 nodes need more than one round of 1-WL.
    spec = GraphPairSpec(num_pairs=1, min_nodes=4, max_nodes=4, isomorphic_fraction=0.0, wl_fractions=(0, 0, 1))
    with pytest.raises(ConfigError, match="round > 2"):
        generate_pairs(spec)


# ---------------------------------------------------------------- generator


@pytest.fixture(scope="module")
def small_pairs() -> GraphPairs:
    return generate_pairs(SMALL)


def pair_keys(pairs: GraphPairs) -> list[bytes]:
    return [
        bytes([int(n)]) + adjacency.numpy().tobytes() for n, adjacency in zip(pairs.num_nodes, pairs.adjacency)
    ]


def test_generated_tensors_are_well_formed(small_pairs):
    pairs = small_pairs
    assert len(pairs) == SMALL.num_pairs and pairs.max_nodes == SMALL.max_nodes
    adjacency = pairs.adjacency
    assert torch.equal(adjacency, adjacency.transpose(-1, -2))
    assert not adjacency.diagonal(dim1=-2, dim2=-1).any()
    expected_mask = torch.arange(SMALL.max_nodes) < pairs.num_nodes[:, None, None]
    assert torch.equal(pairs.node_mask, expected_mask.expand(-1, 2, -1))
    outside = ~(pairs.node_mask[..., :, None] & pairs.node_mask[..., None, :])
    assert not (adjacency & outside).any()
    assert pairs.num_nodes.min() >= SMALL.min_nodes and pairs.num_nodes.max() <= SMALL.max_nodes
    assert set(pairs.edge_probability.tolist()) <= {np.float32(p) for p in SMALL.edge_probabilities}
    assert torch.equal(pairs.label, pairs.wl_rounds == 0)


def test_generated_labels_and_wl_rounds_are_exact(small_pairs):
    for adjacency, size, label, rounds in zip(
        small_pairs.adjacency, small_pairs.num_nodes, small_pairs.label, small_pairs.wl_rounds
    ):
        adj_a, adj_b = adjacency[0, :size, :size].numpy(), adjacency[1, :size, :size].numpy()
        exact = brute_force_isomorphic(adj_a, adj_b) if size <= 6 else are_isomorphic(adj_a, adj_b)
        assert exact == bool(label)
        expected_rounds = wl_rounds_to_distinguish(adj_a, adj_b)
        if label:
            assert expected_rounds is None and rounds == 0
        else:
            assert rounds == (WL_NEVER if expected_rounds is None else expected_rounds)


def test_stratum_counts_follow_the_spec(small_pairs):
    strata = wl_stratum(small_pairs.wl_rounds)
    counts = {stratum: int((strata == stratum).sum()) for stratum in (ISOMORPHIC, WL_ROUND_1, WL_ROUND_2, WL_MORE)}
    assert counts == SMALL.stratum_counts() == {ISOMORPHIC: 150, WL_ROUND_1: 15, WL_ROUND_2: 30, WL_MORE: 105}
    # Every size occurs in an easy stratum (hard pairs need at least 6 nodes).
    assert set(small_pairs.num_nodes[strata == WL_ROUND_1].tolist()) >= {5, 6, 7, 8}


def test_isomorphic_pairs_are_relabelled(small_pairs):
    isomorphic = small_pairs[small_pairs.label]
    same = (isomorphic.adjacency[:, 0] == isomorphic.adjacency[:, 1]).flatten(1).all(1)
    assert same.float().mean() < 0.2


def test_no_two_pairs_are_identical(small_pairs):
    keys = pair_keys(small_pairs)
    assert len(set(keys)) == len(keys)


@pytest.mark.slow
def test_generation_is_deterministic():
    spec = GraphPairSpec(num_pairs=40, seed=5, min_nodes=5, max_nodes=7)
    first, second = generate_pairs(spec), generate_pairs(spec)
    assert first.checksum() == second.checksum()
    for name, tensor in first.tensors().items():
        assert torch.equal(tensor, getattr(second, name)), name
    other = generate_pairs(GraphPairSpec(num_pairs=40, seed=6, min_nodes=5, max_nodes=7))
    assert not torch.equal(first.adjacency, other.adjacency)


def test_wl_stratum_maps_rounds():
    rounds = torch.tensor([0, 1, 2, 3, 7, WL_NEVER])
    assert wl_stratum(rounds).tolist() == [ISOMORPHIC, WL_ROUND_1, WL_ROUND_2, WL_MORE, WL_MORE, WL_MORE]


# ---------------------------------------------------------------- GraphPairs and splits


def test_indexing_and_device(small_pairs):
    assert len(small_pairs[2:7]) == 5
    assert len(small_pairs[3]) == len(small_pairs[np.int64(3)]) == len(small_pairs[torch.tensor(3)]) == 1
    assert torch.equal(small_pairs[[4, 1]].adjacency[1], small_pairs.adjacency[1])
    assert len(small_pairs[small_pairs.label]) == int(small_pairs.label.sum())
    assert small_pairs.to("cpu").checksum() == small_pairs.checksum()
    with pytest.raises(ValueError, match="wl_rounds"):
        GraphPairs(**{**small_pairs.tensors(), "wl_rounds": small_pairs.wl_rounds.int()})


def test_splits_are_disjoint_complete_and_stratified(small_pairs):
    fractions = {"train": 0.8, "val": 0.1, "test": 0.1}
    splits = split_pairs(small_pairs, fractions, seed=3)
    keys = {name: pair_keys(split) for name, split in splits.items()}
    assert sorted(sum(keys.values(), [])) == sorted(pair_keys(small_pairs))
    assert {name: len(split) for name, split in splits.items()} == {"train": 240, "val": 30, "test": 30}
    overall = small_pairs.label.float().mean().item()
    for split in splits.values():
        assert abs(split.label.float().mean().item() - overall) <= 0.04
    again = split_pairs(small_pairs, fractions, seed=3)
    assert all(again[name].checksum() == splits[name].checksum() for name in fractions)
    assert split_pairs(small_pairs, fractions, seed=4)["train"].checksum() != splits["train"].checksum()
    with pytest.raises(ConfigError, match="sum to 1"):
        split_pairs(small_pairs, {"train": 0.8, "val": 0.1}, seed=0)


def test_save_and_load_round_trip_and_detect_tampering(small_pairs, tmp_path):
    checks.check_save_load_and_tampering(small_pairs, tmp_path)


# ---------------------------------------------------------------- cache

CACHED = GraphPairSpec(num_pairs=30, seed=2, min_nodes=5, max_nodes=7)


def test_second_call_loads_from_the_cache(tmp_path, monkeypatch):
    assert cache_path(CACHED, tmp_path).name == f"gi_pairs_{CACHED.key()}.pt"
    checks.check_second_call_loads(
        lambda: load_or_generate(CACHED, tmp_path),
        cache_path(CACHED, tmp_path),
        lambda: checks.forbid(monkeypatch, data, "generate_pairs"),
    )


def corrupt_other_spec(path: Path) -> None:
    other = GraphPairSpec(num_pairs=30, seed=99, min_nodes=5, max_nodes=7)
    generate_pairs(other).save(path, metadata=data._cache_metadata(other))


@pytest.mark.parametrize(
    ("corrupt", "reason"),
    [
        (checks.corrupt_truncated, "cache file .* is damaged: it holds"),
        (checks.corrupt_garbage, "cache file .* is damaged: it does not start with a nip_like header"),
        (checks.corrupt_tensor("adjacency"), "checksum"),
        pytest.param(corrupt_other_spec, "another spec .*seed=99 not 2", marks=pytest.mark.slow),
    ],
)
def test_a_bad_cache_file_is_reported_and_rebuilt(tmp_path, monkeypatch, corrupt, reason):
    checks.check_bad_cache_is_rebuilt(
        lambda: load_or_generate(CACHED, tmp_path),
        cache_path(CACHED, tmp_path),
        corrupt,
        reason,
        lambda: checks.forbid(monkeypatch, data, "generate_pairs"),
    )


# ---------------------------------------------------------------- script


def run_script(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "generate_gi_dataset.py"), *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def load_script(name: str = "generate_gi_dataset"):
    """Import a script as a module, to run its ``main`` in this process."""
    location = REPO_ROOT / "scripts" / f"{name}.py"
    module_spec = importlib.util.spec_from_file_location(name, location)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # a subprocess: seconds of start-up
def test_script_generates_then_loads(tmp_path, capsys):
    args = ["--name", "small", "--num-pairs", "20", "--seed", "4", "--cache-dir", str(tmp_path)]
    first = run_script(*args)
    assert first.returncode == 0, first.stderr
    spec = GraphPairSpec(num_pairs=20, seed=4, min_nodes=5, max_nodes=8)
    assert f"cache: {cache_path(spec, tmp_path)} (generated)" in first.stdout
    assert "pairs: 20 (isomorphic 10, non-isomorphic 10)" in first.stdout
    assert "non-isomorphic, 1-WL round 2: 2" in first.stdout and "wall time:" in first.stdout
    assert load_script().main(args) == 0
    assert "(loaded)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args",
    [
        ["--name", "nope", "--num-pairs", "5"],
        ["--name", "small"],
        ["--name", "small", "--num-pairs", "many"],
        ["--name", "small", "--num-pairs", "0"],
    ],
)
def test_script_rejects_bad_arguments_in_one_line(args, tmp_path, capsys):
    try:
        status = load_script().main([*args, "--cache-dir", str(tmp_path)])
    except SystemExit as exit_:
        status = exit_.code
    assert status == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1
    assert captured.out == ""


def test_refinement_bound_is_exact_on_a_cycle_against_triangles():
    bound = load_script("gi_refinement_bound")
    six_cycle = graph(6, cycle(6))
    triangles = graph(6, cycle(3) + [(3, 4), (4, 5), (3, 5)])
    # Refinement alone never sees the difference; one individualised pair, two
    # rounds later, always does, whatever the prover answers; one round does not.
    assert bound.undetected(six_cycle, triangles, rounds=2, exchanges=0, marks=[]) == 1.0
    assert bound.undetected(six_cycle, triangles, rounds=2, exchanges=1, marks=[]) == 0.0
    assert bound.undetected(six_cycle, triangles, rounds=1, exchanges=1, marks=[]) == 1.0


def test_refinement_bound_script_on_a_small_dataset(tmp_path, capsys):
    bound = load_script("gi_refinement_bound")
    overrides = ["scenario.num_pairs=60", f"scenario.cache_dir={tmp_path}"]
    rows = bound.main(["--preset", "quick", "--rounds", "3", "--exchanges", "0", "1", "--pairs", "0", *overrides])
    assert [row["exchanges"] for row in rows] == [0, 1]
    assert "12 pairs, 50% isomorphic" in capsys.readouterr().out
    # Without exchanges, a verifier of 3 refinement rounds misses exactly the non-isomorphic pairs
    # that 1-WL needs more rounds for, or never tells apart (the generator's record of each pair).
    pairs = bound.load_split(["preset=quick", *overrides], "test")
    rounds = [int(pairs.wl_rounds[i]) for i in range(len(pairs)) if not pairs.label[i]]
    assert rows[0]["undetected"] == pytest.approx(sum(r == WL_NEVER or r > 3 for r in rounds) / len(rounds))
    assert rows[1]["undetected"] <= rows[0]["undetected"]
    for row in rows:  # isomorphic pairs are always accepted; detected non-isomorphic ones rejected
        assert row["accuracy"] == pytest.approx(0.5 + 0.5 * (1 - row["undetected"]))
