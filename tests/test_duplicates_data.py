"""Duplicates data: spec, generator, labels and certificates, splits, cache, script, the solo-verifier bound."""

from __future__ import annotations

import collections
import importlib.util
import itertools
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from nip_like.checkpoint import load_checked, save_atomic
from nip_like.errors import ConfigError
from nip_like.registry import SCENARIOS
from nip_like.scenarios.duplicates import data
from nip_like.scenarios.duplicates.data import (
    DuplicateLists,
    DuplicateSpec,
    cache_path,
    certificate_holds,
    equal_pairs,
    generate_lists,
    load_or_generate,
    solo_verifier_accuracy,
    split_lists,
)
from tests import dataset_checks as checks

REPO_ROOT = Path(__file__).resolve().parent.parent
SMALL = DuplicateSpec(num_lists=600, length=6, num_values=9, seed=1)
DEFAULT_SHAPE = DuplicateSpec(num_lists=4000, seed=3)


def brute_force_pairs(values: list[int]) -> list[tuple[int, int]]:
    """Every pair of positions i < j with equal values, by the definition."""
    return [(i, j) for i in range(len(values)) for j in range(i + 1, len(values)) if values[i] == values[j]]


def rows(lists: DuplicateLists) -> list[tuple[int, ...]]:
    return [tuple(row) for row in lists.values.tolist()]


def chi_square_limit(dof: int, z: float = 3.719) -> float:
    """Upper 1e-4 quantile of the chi-square law (Wilson-Hilferty), so a fair sample exceeds it once in 10,000."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def chi_square(counts: list[int]) -> float:
    expected = sum(counts) / len(counts)
    return sum((count - expected) ** 2 / expected for count in counts)


@pytest.fixture(scope="module")
def small_lists() -> DuplicateLists:
    return generate_lists(SMALL)


@pytest.fixture(scope="module")
def default_shape_lists() -> DuplicateLists:
    return generate_lists(DEFAULT_SHAPE)


# ---------------------------------------------------------------- spec


def test_defaults():
    spec = DuplicateSpec()
    assert (spec.num_lists, spec.length, spec.num_values, spec.seed, spec.positive_fraction) == (4000, 8, 16, 0, 0.5)
    assert spec.num_positives == 2000


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"num_lists": 1}, "num_lists"),
        ({"num_lists": 10.0}, "num_lists"),
        ({"num_lists": True}, "num_lists"),
        ({"length": 1}, "length"),
        ({"num_values": 1, "length": 2}, "num_values"),
        ({"length": 9, "num_values": 8}, "length"),
        ({"seed": -1}, "seed"),
        ({"positive_fraction": 0.0}, "positive_fraction"),
        ({"positive_fraction": 1.0}, "positive_fraction"),
        ({"positive_fraction": float("nan")}, "positive_fraction"),
        ({"positive_fraction": "half"}, "positive_fraction"),
        ({"num_lists": 4, "positive_fraction": 0.1}, "positive_fraction"),  # round(0.4) = 0 positives
        ({"num_lists": 4, "positive_fraction": 0.9}, "positive_fraction"),  # round(3.6) = 4: no negatives
    ],
)
def test_bad_specs_are_rejected_in_one_line_naming_the_field(fields, named):
    with pytest.raises(ConfigError) as caught:
        DuplicateSpec(**fields)
    message = str(caught.value)
    assert message.startswith(f"DuplicateSpec.{named} must be ") and "\n" not in message


def test_edge_specs_are_accepted():
    assert DuplicateSpec(num_lists=2, length=2, num_values=2).num_positives == 1
    assert DuplicateSpec(length=16, num_values=16).length == 16
    assert DuplicateSpec(num_lists=np.int64(10), positive_fraction=np.float32(0.25)).num_positives == 2  # round(2.5)


def test_key_is_stable_and_covers_every_field_and_the_generator_version(monkeypatch):
    spec = DuplicateSpec(num_lists=10)
    assert spec.key() == DuplicateSpec(num_lists=np.int64(10), positive_fraction=1 / 2).key()
    assert re.fullmatch("[0-9a-f]{16}", spec.key()), spec.key()  # 16 hex digits: a cache file name
    changed = [{"num_lists": 11}, {"length": 7}, {"num_values": 17}, {"seed": 1}, {"positive_fraction": 0.4}]
    keys = {DuplicateSpec(**{"num_lists": 10, **change}).key() for change in changed}
    assert len(keys) == len(changed) and spec.key() not in keys
    before = spec.key()
    monkeypatch.setattr(DuplicateSpec, "generator_version", data.GENERATOR_VERSION + 1)
    assert spec.key() != before and spec.key() not in keys


def test_key_of_the_default_spec_is_pinned():
    # A changed key orphans every cache file: bump GENERATOR_VERSION on purpose, never by accident.
    assert DuplicateSpec().key() == "7fe7543c81da7da3"


# ---------------------------------------------------------------- generator


def test_tensors_are_well_formed(small_lists):
    assert len(small_lists) == SMALL.num_lists and small_lists.length == SMALL.length
    assert small_lists.values.dtype == torch.long and small_lists.values.shape == (600, 6)
    assert small_lists.label.dtype == torch.bool and small_lists.label.shape == (600,)
    assert small_lists.certificate.dtype == torch.long and small_lists.certificate.shape == (600, 2)
    assert int(small_lists.values.min()) >= 0 and int(small_lists.values.max()) < SMALL.num_values
    with pytest.raises(ValueError, match="DuplicateLists.certificate"):
        DuplicateLists(**{**small_lists.tensors(), "certificate": small_lists.certificate[:, :1]})


def test_generation_is_deterministic():
    spec = DuplicateSpec(num_lists=200, seed=5)
    first, second = generate_lists(spec), generate_lists(spec)
    assert first.checksum() == second.checksum()
    for name, tensor in first.tensors().items():
        assert torch.equal(tensor, getattr(second, name)), name
    other = generate_lists(DuplicateSpec(num_lists=200, seed=6))
    assert not torch.equal(first.values, other.values)
    assert not torch.equal(first.label, other.label)


def test_labels_and_certificates_are_exact_by_brute_force(small_lists):
    for values, label, certificate in zip(rows(small_lists), small_lists.label.tolist(), small_lists.certificate):
        pairs = brute_force_pairs(list(values))
        assert label == bool(pairs)
        if label:  # exactly one duplicate pair, and the certificate names it
            assert len(pairs) == 1 and tuple(certificate.tolist()) == pairs[0]
            assert len(set(values)) == len(values) - 1
        else:
            assert certificate.tolist() == [-1, -1] and len(set(values)) == len(values)


@pytest.mark.parametrize(
    ("num_lists", "fraction", "positives"), [(600, 0.5, 300), (10, 0.25, 2), (7, 0.3, 2), (10, 0.75, 8)]
)
def test_exactly_round_num_lists_times_fraction_are_positive(num_lists, fraction, positives):
    lists = generate_lists(DuplicateSpec(num_lists=num_lists, length=5, num_values=6, positive_fraction=fraction))
    assert int(lists.label.sum()) == positives == round(num_lists * fraction)


def test_lists_are_uniform_in_each_class():
    # L = V = 3: the 6 permutations are the negatives, the 3 * 3 * 2 lists with one pair the positives.
    lists = generate_lists(DuplicateSpec(num_lists=3600, length=3, num_values=3, seed=2))
    negatives = collections.Counter(rows(lists[~lists.label]))
    positives = collections.Counter(rows(lists[lists.label]))
    assert set(negatives) == set(itertools.permutations(range(3)))
    assert set(positives) == {r for r in itertools.product(range(3), repeat=3) if len(set(r)) == 2}
    assert chi_square(list(negatives.values())) < chi_square_limit(5)
    assert chi_square(list(positives.values())) < chi_square_limit(17)


def test_duplicate_positions_and_values_are_uniform(default_shape_lists):
    positives = default_shape_lists[default_shape_lists.label]
    pairs = collections.Counter(map(tuple, positives.certificate.tolist()))
    assert len(pairs) == math.comb(8, 2)
    assert chi_square(list(pairs.values())) < chi_square_limit(27)
    duplicated = positives.values.gather(1, positives.certificate[:, :1]).flatten()
    assert chi_square(torch.bincount(duplicated, minlength=16).tolist()) < chi_square_limit(15)


def test_equal_pairs_and_certificate_checks():
    values = torch.tensor([[1, 2, 3, 1], [4, 4, 4, 0], [0, 1, 2, 3]])
    assert equal_pairs(values).tolist() == [1, 3, 0]
    certificates = torch.tensor([[0, 3], [2, 0], [0, 1]])
    assert certificate_holds(values, certificates).tolist() == [True, True, False]
    assert certificate_holds(values, torch.tensor([[3, 0], [1, 1], [-1, -1]])).tolist() == [True, False, False]
    assert certificate_holds(values, torch.tensor([[0, 4], [0, 1], [0, 9]])).tolist() == [False, True, False]


def test_stored_certificates_hold_exactly_for_positives(small_lists):
    assert torch.equal(certificate_holds(small_lists.values, small_lists.certificate), small_lists.label)
    positives = small_lists[small_lists.label]
    assert bool((positives.certificate[:, 0] < positives.certificate[:, 1]).all())
    # Every other pair of cells of a positive list fails: the certificate is unique.
    for i, j in itertools.combinations(range(SMALL.length), 2):
        other = torch.tensor([i, j]).expand(len(positives), 2)
        is_it = (positives.certificate == other).all(dim=1)
        assert torch.equal(certificate_holds(positives.values, other), is_it)


# ---------------------------------------------------------------- the solo-verifier bound


def test_bound_values():
    assert solo_verifier_accuracy(8, 0) == solo_verifier_accuracy(8, 1) == 0.5
    assert solo_verifier_accuracy(8, 2) == pytest.approx(0.5 + 1 / 56) == pytest.approx(0.5179, abs=1e-4)
    assert solo_verifier_accuracy(8, 8) == 1.0
    # Few positives: without a match "no" is the better guess, so only matches add to 0.8.
    assert solo_verifier_accuracy(8, 2, positive_fraction=0.2) == pytest.approx(0.8 + 0.2 / 28)
    assert solo_verifier_accuracy(4, 3, positive_fraction=0.8) == pytest.approx(0.8 * 0.5 + 0.8 * 0.5)
    with pytest.raises(ValueError, match="revealed"):
        solo_verifier_accuracy(8, 9)


@pytest.mark.parametrize("fraction", [0.5, 0.3, 0.8])
def test_bound_is_the_bayes_optimum_for_every_set_of_cells(fraction):
    """Enumerate every list of each class (L = 4, V = 5) and every set S of cells a verifier might see.

    The best verifier that sees the values on S answers, for each possible
    sight, the more probable label; its accuracy is the sum over sights of
    ``max(π P(sight | positive), (1 - π) P(sight | negative))``.
    """
    length, num_values = 4, 5
    all_lists = list(itertools.product(range(num_values), repeat=length))
    positive = [r for r in all_lists if len(brute_force_pairs(list(r))) == 1]
    negative = [r for r in all_lists if len(set(r)) == length]
    for k in range(length + 1):
        for cells in itertools.combinations(range(length), k):
            sights = collections.defaultdict(lambda: [0.0, 0.0])
            for r in positive:
                sights[tuple(r[c] for c in cells)][0] += fraction / len(positive)
            for r in negative:
                sights[tuple(r[c] for c in cells)][1] += (1 - fraction) / len(negative)
            best = sum(max(p, n) for p, n in sights.values())
            assert best == pytest.approx(solo_verifier_accuracy(length, k, fraction), abs=1e-12), (k, cells)


@pytest.mark.parametrize("revealed", [2, 3, 5, 7])
def test_bound_matches_monte_carlo_on_generated_lists(default_shape_lists, revealed):
    """A verifier that reveals k random cells and says "duplicate" iff two match scores the bound's accuracy."""
    lists = default_shape_lists
    rng = np.random.default_rng(revealed)
    cells = torch.from_numpy(np.argsort(rng.random((len(lists), lists.length)), axis=1)[:, :revealed])
    seen = lists.values.gather(1, cells)
    says_duplicate = equal_pairs(seen) > 0
    assert not says_duplicate[~lists.label].any()  # a match never happens without a duplicate
    accuracy = (says_duplicate == lists.label).float().mean().item()
    expected = solo_verifier_accuracy(lists.length, revealed)
    # Only the positives vary: each is caught with probability q = 2 * expected - 1.
    q, positives = 2 * expected - 1, int(lists.label.sum())
    noise = math.sqrt(q * (1 - q) * positives) / len(lists)
    assert abs(accuracy - expected) < 4 * noise + 1e-3, (accuracy, expected)


# ---------------------------------------------------------------- splits and files


def test_splits_are_disjoint_complete_and_stratified(default_shape_lists):
    lists = default_shape_lists
    # Lists are drawn independently; with L = 8 and V = 16 no two of these 4000 are equal, so
    # equal multisets of rows below mean that every list is in exactly one split.
    assert len(set(rows(lists))) == len(lists)
    fractions = {"train": 0.8, "val": 0.1, "test": 0.1}
    splits = split_lists(lists, fractions, seed=3)
    assert {name: len(split) for name, split in splits.items()} == {"train": 3200, "val": 400, "test": 400}
    assert {name: int(split.label.sum()) for name, split in splits.items()} == {"train": 1600, "val": 200, "test": 200}
    assert collections.Counter(itertools.chain(*map(rows, splits.values()))) == collections.Counter(rows(lists))
    for split in splits.values():  # each keeps its certificates
        assert torch.equal(certificate_holds(split.values, split.certificate), split.label)
    again = split_lists(lists, fractions, seed=3)
    assert all(again[name].checksum() == splits[name].checksum() for name in fractions)
    assert split_lists(lists, fractions, seed=4)["train"].checksum() != splits["train"].checksum()
    with pytest.raises(ConfigError, match="sum to 1"):
        split_lists(lists, {"train": 0.8, "val": 0.1}, seed=0)


def test_subset_indexing_and_device(small_lists):
    assert len(small_lists.subset(slice(2, 7))) == 5
    assert len(small_lists.subset(3)) == len(small_lists[np.int64(3)]) == len(small_lists[torch.tensor(3)]) == 1
    assert torch.equal(small_lists.subset([4, 1]).values[1], small_lists.values[1])
    assert len(small_lists.subset(small_lists.label)) == int(small_lists.label.sum())
    assert small_lists.to("cpu").checksum() == small_lists.checksum()


def test_save_and_load_round_trip_and_detect_tampering(small_lists, tmp_path):
    checks.check_save_load_and_tampering(small_lists, tmp_path)


# ---------------------------------------------------------------- cache

CACHED = DuplicateSpec(num_lists=50, length=5, num_values=7, seed=2)


def test_second_call_loads_from_the_cache(tmp_path, monkeypatch):
    path = cache_path(CACHED, tmp_path)
    assert path == tmp_path / f"duplicate_lists_{CACHED.key()}.pt"
    checks.check_second_call_loads(
        lambda: load_or_generate(CACHED, tmp_path), path, lambda: checks.forbid(monkeypatch, data, "generate_lists")
    )
    assert DuplicateLists.load(path).checksum() == generate_lists(CACHED).checksum()


def corrupt_other_spec(path: Path) -> None:
    other = DuplicateSpec(num_lists=50, length=5, num_values=7, seed=99)
    generate_lists(other).save(path, metadata=other.cache_metadata())


def corrupt_generator_version(path: Path) -> None:
    state = load_checked(path)
    state["metadata"]["generator_version"] = 0
    save_atomic(state, path)


@pytest.mark.parametrize(
    ("corrupt", "reason"),
    [
        (checks.corrupt_truncated, "cache file .* is damaged: it holds"),
        (checks.corrupt_garbage, "cache file .* is damaged: it does not start with a nip_like header"),
        (checks.corrupt_tensor("values"), "fails its checksum"),
        (corrupt_other_spec, r"another spec \(seed=99 not 2\)"),
        (corrupt_generator_version, r"another spec \(generator_version=0 not 1\)"),
    ],
)
def test_a_bad_cache_file_is_reported_and_rebuilt(tmp_path, monkeypatch, corrupt, reason):
    checks.check_bad_cache_is_rebuilt(
        lambda: load_or_generate(CACHED, tmp_path),
        cache_path(CACHED, tmp_path),
        corrupt,
        f"^rebuilding the duplicate-lists cache: .*{reason}",
        lambda: checks.forbid(monkeypatch, data, "generate_lists"),
    )


# ---------------------------------------------------------------- package and script


def test_the_package_registers_the_duplicates_scenarios_once():
    SCENARIOS.load_builtins()
    assert "nip_like.scenarios.duplicates.data" in sys.modules  # the registry imported it
    found = [e.name for e in SCENARIOS.entries() if e.cls.__module__.startswith("nip_like.scenarios.duplicates")]
    assert sorted(found) == ["duplicates", "duplicates_chat"]  # the token game and its chat rendering


def load_script():
    location = REPO_ROOT / "scripts" / "generate_duplicates_dataset.py"
    module_spec = importlib.util.spec_from_file_location("generate_duplicates_dataset", location)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # a subprocess: seconds of start-up
def test_script_generates_then_loads(tmp_path, capsys):
    args = ["--num-lists", "40", "--length", "4", "--num-values", "6", "--seed", "4", "--cache-dir", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    first = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "generate_duplicates_dataset.py"), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert first.returncode == 0, first.stderr
    spec = DuplicateSpec(num_lists=40, length=4, num_values=6, seed=4)
    assert f"cache: {cache_path(spec, tmp_path)} (generated)" in first.stdout
    assert "lists: 40 of 4 values in 0..5 (with a duplicate 20, without 20;" in first.stdout
    assert "k=2: 0.583" in first.stdout and "wall time:" in first.stdout  # 1/2 + 1/12
    assert load_script().main(args) == 0
    assert "(loaded)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--num-lists", "many"], "invalid int value"),
        (["--length", "20"], "DuplicateSpec.length must be at most num_values (16)"),
        (["--positive-fraction", "1"], "DuplicateSpec.positive_fraction must be"),
        (["--colour", "red"], "unrecognized arguments"),
    ],
)
def test_script_rejects_bad_arguments_in_one_line(args, message, tmp_path, capsys):
    try:
        status = load_script().main([*args, "--cache-dir", str(tmp_path)])
    except SystemExit as exit_:
        status = exit_.code
    assert status == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1 and message in captured.err
    assert captured.out == "" and not list(tmp_path.iterdir())
