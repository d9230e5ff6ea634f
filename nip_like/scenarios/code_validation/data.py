"""The code-validation dataset: programs, each labelled by running a problem's hidden tests; splits, cache, JSONL.

An example is a program written for a problem, with the label 1 if it passes
every hidden test of the problem and 0 otherwise. :func:`generate_programs`
builds a :class:`CodeValidationData` from a :class:`CodeValidationSpec`:
problems of the family in :mod:`~nip_like.scenarios.code_validation.problems`,
for each a few rewritten copies of its reference solution and a few mutants
(:mod:`~nip_like.scenarios.code_validation.mutations`), every one of them run
against the hidden tests in the sandbox
(:mod:`~nip_like.scenarios.code_validation.sandbox`). The label comes from
that run, never from how the program was made: a mutant that passes is
labelled 1, a copy of the reference that failed would be labelled 0.

:func:`load_or_generate` keeps the dataset in a checked cache file (the
machinery of :func:`~nip_like.scenarios.datasets.load_or_build`);
:func:`split_by_problem` cuts it so that all programs of one problem land in
one split. :func:`load_buggy_apps` reads a JSONL file in the Buggy-APPS field
layout (``question``, ``solutions``, ``buggy_solutions``, ``input_output``)
and labels its programs the same way, cached like the generated data;
:func:`write_buggy_apps` writes a dataset in that layout.

The dataset's classes are in :mod:`~nip_like.scenarios.code_validation.dataset`
and the layout's reader and writer in
:mod:`~nip_like.scenarios.code_validation.buggy_apps`; their names stay
importable from here. ``docs/code_validation_data.rst`` is the guide. This
module registers nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from nip_like.errors import ConfigError
from nip_like.scenarios.code_validation.buggy_apps import BuggyAppsSpec, file_sha256, label_buggy_apps
from nip_like.scenarios.code_validation.dataset import GENERATOR_VERSION, CodeProblem, CodeProgram, CodeValidationData
from nip_like.scenarios.code_validation.mutations import draw_mutants, rewrite
from nip_like.scenarios.code_validation.problems import (
    all_problems,
    draw_example,
    draw_problems,
    draw_tests,
    reference_outputs,
)
from nip_like.scenarios.code_validation.sandbox import SandboxLimits, run_programs
from nip_like.scenarios.datasets import DatasetSpec, apportion, is_real, load_or_build

#: How a program that is not a mutant is named in :attr:`CodeProgram.origin`.
REFERENCE = "reference"


@dataclass(frozen=True)
class CodeValidationSpec(DatasetSpec):
    """The dataset that :func:`generate_programs` builds.

    Its ``key()``, a hash of all fields and :data:`GENERATOR_VERSION`, names
    the cache file.

    Parameters
    ----------
    num_problems : int
        Number of problems, at least 2 and at most the family's size
        (``len(problems.all_problems())``, 115).
    correct_per_problem : int
        Rewritten copies of the reference solution per problem, at least 1
        (fewer when the rewrites run out of different surfaces).
    mutants_per_problem : int
        Mutants per problem, at least 1 (fewer when the reference has fewer
        different mutants).
    tests_per_problem : int
        Hidden tests per problem, at least 1: the template's edge cases
        (at most half), then random ones.
    seed : int
        Seed of the NumPy generator that draws everything, at least 0.
    test_time_limit : float
        CPU seconds a program may spend on one test; the tests take
        microseconds, so only a looping program reaches it.
    time_limit : float
        Wall-clock seconds for one program's whole run.
    memory_mib : int
        Address-space limit of a program's process, in MiB, at least 64.

    Raises
    ------
    ConfigError
        If a field is out of range, naming the field and what it allows.
    """

    num_problems: int = 60
    correct_per_problem: int = 2
    mutants_per_problem: int = 3
    tests_per_problem: int = 12
    seed: int = 0
    test_time_limit: float = 0.1
    time_limit: float = 5.0
    memory_mib: int = 256

    generator_version: ClassVar[int] = GENERATOR_VERSION

    def __post_init__(self) -> None:
        lowest = {"num_problems": 2, "correct_per_problem": 1, "mutants_per_problem": 1, "tests_per_problem": 1}
        self._check_integers({**lowest, "seed": 0, "memory_mib": 64})
        family = len(all_problems())
        if self.num_problems > family:
            self._fail("num_problems", f"at most {family}, the number of problems in the family", self.num_problems)
        for name in ("test_time_limit", "time_limit"):
            value = getattr(self, name)
            if not is_real(value) or value <= 0:
                self._fail(name, "a positive number of seconds", value)
            object.__setattr__(self, name, float(value))

    def limits(self) -> SandboxLimits:
        """Return the sandbox limits every program runs under."""
        return SandboxLimits(time_limit=self.time_limit, test_time_limit=self.test_time_limit, memory_mib=self.memory_mib)


# ---------------------------------------------------------------- generation


def _programs_of(problem_solution: str, spec: CodeValidationSpec, rng: np.random.Generator) -> list[tuple[str, str]]:
    """Draw the ``(origin, source)`` of one problem's programs: rewritten references, then rewritten mutants."""
    sources: set[str] = set()
    drawn: list[tuple[str, str]] = []

    def add(origin: str, source: str) -> None:
        for _ in range(10):  # a few tries for a surface not drawn yet
            text = rewrite(source, rng)
            if text not in sources:
                sources.add(text)
                drawn.append((origin, text))
                return

    for _ in range(spec.correct_per_problem):
        add(REFERENCE, problem_solution)
    for name, mutant in draw_mutants(problem_solution, rng, spec.mutants_per_problem):
        add(name, mutant)
    return drawn


def generate_programs(spec: CodeValidationSpec, workers: int = 1) -> CodeValidationData:
    """Build the dataset that ``spec`` describes; the same spec gives the same dataset.

    Everything is drawn from one ``numpy.random.Generator`` seeded with
    ``spec.seed``, problem after problem: the problems
    (:func:`~nip_like.scenarios.code_validation.problems.draw_problems`),
    then for each its hidden tests, their expected answers (from the
    reference solution), the statement's worked example, the rewritten
    references and the mutants. Then every program runs against its
    problem's tests in the sandbox, stopping at the first failed test, and
    its label is whether all passed. The programs are shuffled at the end.

    Parameters
    ----------
    spec : CodeValidationSpec
        What to build.
    workers : int
        Programs run at once (threads, each starting its own process); the
        dataset does not depend on it.

    Returns
    -------
    CodeValidationData
        The problems and their programs.
    """
    rng = np.random.default_rng(spec.seed)
    problems: dict[str, CodeProblem] = {}
    drawn: list[tuple[str, str, str]] = []
    for problem in draw_problems(rng, spec.num_problems):
        tests = draw_tests(problem, rng, spec.tests_per_problem)
        outputs = reference_outputs(problem, tests)
        example = draw_example(problem, rng)
        statement = problem.statement(example, reference_outputs(problem, [example])[0])
        problems[problem.problem_id] = CodeProblem(
            problem.problem_id, statement, problem.fn_name, tuple(tests), tuple(outputs)
        )
        drawn += [(problem.problem_id, origin, text) for origin, text in _programs_of(problem.solution, spec, rng)]
    jobs = [(text, problems[problem_id].suite()) for problem_id, _, text in drawn]
    runs = run_programs(jobs, spec.limits(), stop_at_first_failure=True, workers=workers)
    programs = [
        CodeProgram(problem_id, text, run.passed, origin, run.reason)
        for (problem_id, origin, text), run in zip(drawn, runs)
    ]
    return CodeValidationData(problems, tuple(programs[int(index)] for index in rng.permutation(len(programs))))


def split_by_problem(
    data: CodeValidationData, fractions: Mapping[str, float], seed: int
) -> dict[str, CodeValidationData]:
    """Cut ``data`` into disjoint splits by problem: all programs of one problem are in one split.

    The problem ids (sorted) are permuted with a generator seeded by
    ``seed`` and cut by ``fractions`` (largest-remainder rounding of the
    number of problems); each split's programs are then shuffled. Problems of
    one template with other parameters may land in different splits.

    Parameters
    ----------
    data : CodeValidationData
        The dataset.
    fractions : mapping of str to float
        Split name to fraction of the problems, e.g. ``{"train": 0.8, "test": 0.2}``;
        fractions in ``[0, 1]`` that sum to 1.
    seed : int
        Seed of the permutation.

    Returns
    -------
    dict of str to CodeValidationData
        The splits, in the order of ``fractions``; together they hold every program once.

    Raises
    ------
    ConfigError
        If ``fractions`` is empty, has a value outside ``[0, 1]``, or does not sum to 1.
    """
    values = list(fractions.values())
    if not values or not all(is_real(v) and 0.0 <= v <= 1.0 for v in values) or abs(sum(values) - 1.0) > 1e-6:
        raise ConfigError(f"split fractions must be numbers in [0, 1] that sum to 1, got {dict(fractions)}")
    rng = np.random.default_rng(seed)
    identifiers = sorted({program.problem_id for program in data.programs})
    shuffled = [identifiers[int(index)] for index in rng.permutation(len(identifiers))]
    bounds = np.cumsum([0, *apportion(len(shuffled), values)])
    splits = {}
    for name, start, stop in zip(fractions, bounds[:-1], bounds[1:]):
        members = set(shuffled[start:stop])
        positions = [index for index, program in enumerate(data.programs) if program.problem_id in members]
        splits[name] = data.subset([positions[int(i)] for i in rng.permutation(len(positions))])
    return splits


def statistics(data: CodeValidationData) -> dict[str, Any]:
    """Return the dataset's sizes and label balance, overall and by origin.

    Returns
    -------
    dict
        ``programs``, ``problems``, ``correct``, ``buggy``,
        ``positive_fraction`` and ``by_origin``: origin to
        ``{"programs": n, "correct": k}``.
    """
    by_origin: dict[str, dict[str, int]] = {}
    for program in data.programs:
        entry = by_origin.setdefault(program.origin, {"programs": 0, "correct": 0})
        entry["programs"] += 1
        entry["correct"] += int(program.label)
    correct = sum(program.label for program in data.programs)
    return {
        "programs": len(data),
        "problems": len({program.problem_id for program in data.programs}),
        "correct": correct,
        "buggy": len(data) - correct,
        "positive_fraction": correct / len(data) if len(data) else 0.0,
        "by_origin": dict(sorted(by_origin.items())),
    }


def cache_path(spec: DatasetSpec, cache_dir: Path) -> Path:
    """Return the cache file of ``spec`` in ``cache_dir``: ``code_validation_<spec.key()>.pt``."""
    return Path(cache_dir) / f"code_validation_{spec.key()}.pt"


def load_or_generate(spec: CodeValidationSpec, cache_dir: Path, workers: int = 1) -> CodeValidationData:
    """Return the dataset of ``spec`` from the cache file :func:`cache_path` in ``cache_dir``, building it if needed.

    A cache file that is unreadable, malformed, written for another spec or
    :data:`GENERATOR_VERSION`, or whose checksum fails is rebuilt with a
    :class:`~nip_like.scenarios.datasets.CacheRebuildWarning`; see
    :func:`~nip_like.scenarios.datasets.load_or_build` (which takes this
    dataset as it takes a tensor dataset: it only needs ``read``, ``save``
    and ``DESCRIPTION``).
    """
    build = lambda: generate_programs(spec, workers)  # noqa: E731
    return load_or_build(CodeValidationData, cache_path(spec, cache_dir), spec, build)  # type: ignore[type-var]


# ---------------------------------------------------------------- the Buggy-APPS layout, cached


def load_buggy_apps(
    path: Path,
    cache_dir: Path | None = None,
    *,
    label_by: str = "tests",
    max_tests_per_problem: int = 0,
    limits: SandboxLimits | None = None,
    workers: int = 1,
) -> CodeValidationData:
    """Return the labelled programs of a Buggy-APPS JSONL file, cached in ``cache_dir`` if given.

    The cache file is keyed by a :class:`BuggyAppsSpec`: the file's SHA-256
    and the labelling options, so an edited file or other options are
    labelled afresh; a damaged cache is rebuilt with a
    :class:`~nip_like.scenarios.datasets.CacheRebuildWarning`, as for the
    generated data. ``limits`` defaults to ``BuggyAppsSpec``'s (2 CPU
    seconds per test, 30 s per program, 512 MiB); only its time and memory
    limits enter the key.
    """
    limits = limits or BuggyAppsSpec().limits()
    spec = BuggyAppsSpec(
        file_sha256=file_sha256(path),
        label_by=label_by,
        max_tests_per_problem=max_tests_per_problem,
        test_time_limit=limits.test_time_limit,
        time_limit=limits.time_limit,
        memory_mib=limits.memory_mib,
    )
    if cache_dir is None:
        return label_buggy_apps(path, spec, workers)
    build = lambda: label_buggy_apps(path, spec, workers)  # noqa: E731
    return load_or_build(CodeValidationData, cache_path(spec, cache_dir), spec, build)  # type: ignore[type-var]
