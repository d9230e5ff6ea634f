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
and labels its programs the same way; :func:`write_buggy_apps` writes a
dataset in that layout. ``docs/code_validation_data.rst`` is the guide. This
module registers nothing.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from nip_like.checkpoint import load_checked, save_atomic, write_text_atomic
from nip_like.errors import CheckpointError, ConfigError
from nip_like.scenarios.code_validation.mutations import draw_mutants, rewrite
from nip_like.scenarios.code_validation.problems import (
    all_problems,
    draw_example,
    draw_problems,
    draw_tests,
    reference_outputs,
)
from nip_like.scenarios.code_validation.sandbox import SandboxLimits, TestSuite, run_programs
from nip_like.scenarios.datasets import DatasetFileError, DatasetSpec, apportion, is_real, load_or_build

#: Version of the generation procedure. It enters :meth:`CodeValidationSpec.key`,
#: so a change to the family, the mutations or the labelling never reuses an old cache file.
GENERATOR_VERSION = 1

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


@dataclass(frozen=True)
class CodeProblem:
    """A problem: its statement and hidden tests.

    Parameters
    ----------
    problem_id : str
        Unique in a dataset (``"count_above/3"`` for the generated family).
    statement : str
        The natural-language statement, with the signature for call-style problems.
    fn_name : str or None
        The function a solution defines; ``None`` for a program that reads
        standard input and prints its answer.
    inputs : tuple
        One JSON value per hidden test (see :class:`~nip_like.scenarios.code_validation.sandbox.TestSuite`).
    outputs : tuple
        The expected answers, one per test.
    lenient_lists : bool
        Accept the first element of a list answer too (the APPS rule).
    """

    problem_id: str
    statement: str
    fn_name: str | None
    inputs: tuple[Any, ...]
    outputs: tuple[Any, ...]
    lenient_lists: bool = False

    def suite(self) -> TestSuite:
        """Return the hidden tests as a :class:`~nip_like.scenarios.code_validation.sandbox.TestSuite`."""
        return TestSuite(self.inputs, self.outputs, self.fn_name, self.lenient_lists)


@dataclass(frozen=True)
class CodeProgram:
    """One example: a program for a problem and its label.

    Parameters
    ----------
    problem_id : str
        The problem it was written for.
    source : str
        The program.
    label : bool
        Whether it passed every hidden test of its problem (from running them).
    origin : str
        How it was made: :data:`REFERENCE` for a rewritten reference, a
        mutation's name for a mutant, ``"solution"`` or ``"buggy_solution"``
        for a program read from a Buggy-APPS file. Not a label.
    reason : str
        Why it failed (the first failed test), empty if it passed or was not run.
    """

    problem_id: str
    source: str
    label: bool
    origin: str
    reason: str = ""


@dataclass(eq=False)
class CodeValidationData:
    """A dataset of programs with labels, and the problems they were written for.

    Parameters
    ----------
    problems : dict of str to CodeProblem
        Every problem a program refers to, by id (maybe more).
    programs : tuple of CodeProgram
        The examples.

    Raises
    ------
    ValueError
        If a problem is filed under another id or a program refers to an
        unknown problem, naming the first.
    """

    problems: dict[str, CodeProblem]
    programs: tuple[CodeProgram, ...]

    FILE_KIND: ClassVar[str] = "nip_like.code_validation"
    DESCRIPTION: ClassVar[str] = "code-validation"

    def __post_init__(self) -> None:
        self.programs = tuple(self.programs)
        for key, problem in self.problems.items():
            if not isinstance(problem, CodeProblem) or problem.problem_id != key:
                raise ValueError(f"CodeValidationData.problems[{key!r}] is not the CodeProblem of that id")
        for index, program in enumerate(self.programs):
            if not isinstance(program, CodeProgram) or program.problem_id not in self.problems:
                raise ValueError(f"CodeValidationData.programs[{index}] does not belong to a problem of the dataset")

    def __len__(self) -> int:
        return len(self.programs)

    @property
    def label(self) -> torch.Tensor:
        """``(N,)`` bool: the programs' labels."""
        return torch.tensor([program.label for program in self.programs], dtype=torch.bool)

    def subset(self, index: Sequence[int] | torch.Tensor) -> CodeValidationData:
        """Return the programs at the positions ``index`` with the problems they refer to."""
        positions = torch.as_tensor(index, dtype=torch.long).reshape(-1).tolist()
        programs = tuple(self.programs[position] for position in positions)
        used = {program.problem_id for program in programs}
        return CodeValidationData({key: value for key, value in self.problems.items() if key in used}, programs)

    def to_state(self) -> dict[str, Any]:
        """Return the dataset as plain JSON values (what is saved and checksummed)."""
        problems = [
            {**{f.name: getattr(problem, f.name) for f in fields(problem)}, "inputs": list(problem.inputs),
             "outputs": list(problem.outputs)}
            for problem in self.problems.values()
        ]
        programs = [{f.name: getattr(program, f.name) for f in fields(program)} for program in self.programs]
        return {"problems": problems, "programs": programs}

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> CodeValidationData:
        """Rebuild a dataset from :meth:`to_state`; ``KeyError``, ``TypeError`` or ``ValueError`` if malformed."""
        problems = {}
        for entry in state["problems"]:
            problem = CodeProblem(**{**entry, "inputs": tuple(entry["inputs"]), "outputs": tuple(entry["outputs"])})
            problems[problem.problem_id] = problem
        programs = tuple(CodeProgram(**entry) for entry in state["programs"])
        if not all(isinstance(program.label, bool) and isinstance(program.source, str) for program in programs):
            raise TypeError("a program's label is not a bool or its source not a string")
        return cls(problems, programs)

    def checksum(self) -> str:
        """Return the SHA-256 of the dataset's JSON form (keys sorted)."""
        text = json.dumps(self.to_state(), sort_keys=True, ensure_ascii=True)
        return hashlib.sha256(text.encode()).hexdigest()

    def save(self, path: Path, metadata: Mapping[str, Any] | None = None) -> None:
        """Write the dataset, its checksum and ``metadata`` atomically to ``path`` (``save_atomic``)."""
        state = {"kind": self.FILE_KIND, "metadata": dict(metadata or {}), "checksum": self.checksum(),
                 "data": self.to_state()}
        save_atomic(state, Path(path))

    @classmethod
    def load(cls, path: Path) -> CodeValidationData:
        """Read a dataset written by :meth:`save`; :class:`~nip_like.scenarios.datasets.DatasetFileError` if damaged."""
        return cls.read(Path(path))[0]

    @classmethod
    def read(cls, path: Path, what: str | None = None) -> tuple[CodeValidationData, dict[str, Any]]:
        """Return the dataset and the metadata of a file written by :meth:`save`.

        ``what`` names the file in the messages (``"cache file"`` for the cache).

        Raises
        ------
        DatasetFileError
            If the file is missing, unreadable, damaged, not a file of this
            dataset, malformed, or fails its checksum; in one line.
        """
        try:
            state = load_checked(Path(path), what=what or f"{cls.DESCRIPTION} file")
        except CheckpointError as error:
            raise DatasetFileError(str(error)) from error
        if state.get("kind") != cls.FILE_KIND:
            raise DatasetFileError(f"{path} is not a {cls.DESCRIPTION} file")
        try:
            dataset = cls.from_state(state["data"])
        except (KeyError, TypeError, ValueError) as error:
            raise DatasetFileError(f"{path} has malformed data ({error})") from error
        if dataset.checksum() != state.get("checksum"):
            raise DatasetFileError(f"{path} fails its checksum: its data changed after it was written")
        return dataset, state.get("metadata", {})


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


# ---------------------------------------------------------------- the Buggy-APPS layout

#: The fields every line of a Buggy-APPS file has.
BUGGY_APPS_FIELDS = ("question", "solutions", "buggy_solutions", "input_output")


@dataclass(frozen=True)
class BuggyAppsSpec(DatasetSpec):
    """What a labelled Buggy-APPS file depends on: the file's contents and how it is labelled.

    Parameters
    ----------
    file_sha256 : str
        SHA-256 of the JSONL file.
    label_by : str
        ``"tests"``: run every program against its problem's tests (the
        default, as for the generated data); ``"field"``: trust the file
        (``solutions`` are 1, ``buggy_solutions`` 0) and run nothing.
    max_tests_per_problem : int
        Run only the first this many tests of a problem; 0 runs all.
    test_time_limit, time_limit : float
        The sandbox's per-test CPU seconds and per-program wall-clock seconds.
    memory_mib : int
        The sandbox's address-space limit, in MiB.
    """

    file_sha256: str = ""
    label_by: str = "tests"
    max_tests_per_problem: int = 0
    test_time_limit: float = 2.0
    time_limit: float = 30.0
    memory_mib: int = 512

    generator_version: ClassVar[int] = GENERATOR_VERSION

    def __post_init__(self) -> None:
        self._check_integers({"max_tests_per_problem": 0, "memory_mib": 64})
        if self.label_by not in ("tests", "field"):
            self._fail("label_by", '"tests" or "field"', self.label_by)
        for name in ("test_time_limit", "time_limit"):
            value = getattr(self, name)
            if not is_real(value) or value <= 0:
                self._fail(name, "a positive number of seconds", value)
            object.__setattr__(self, name, float(value))

    def limits(self) -> SandboxLimits:
        """Return the sandbox limits every program runs under."""
        return SandboxLimits(time_limit=self.time_limit, test_time_limit=self.test_time_limit, memory_mib=self.memory_mib)


def _field_list(record: Mapping[str, Any], name: str, where: str) -> list[str]:
    """A list of program sources: a JSON list of strings, or a string holding one (the APPS files' way)."""
    value = record[name]
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except json.JSONDecodeError as error:
            raise DatasetFileError(f"{where}: field {name!r} is a string but not a JSON list ({error.msg})") from None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise DatasetFileError(f"{where}: field {name!r} must be a list of program sources (strings)")
    return value


def _tests_of(record: Mapping[str, Any], where: str) -> tuple[list[Any], list[Any], str | None]:
    """The inputs, outputs and function name of a record's ``input_output`` field, checked."""
    value = record["input_output"]
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise DatasetFileError(f"{where}: field 'input_output' is not valid JSON ({error.msg})") from None
    if not isinstance(value, dict):
        raise DatasetFileError(f"{where}: field 'input_output' must be an object with 'inputs' and 'outputs'")
    for key in ("inputs", "outputs"):
        if not isinstance(value.get(key), list) or not value[key]:
            raise DatasetFileError(f"{where}: field 'input_output.{key}' must be a non-empty list")
    inputs, outputs, fn_name = value["inputs"], value["outputs"], value.get("fn_name")
    if len(inputs) != len(outputs):
        raise DatasetFileError(
            f"{where}: field 'input_output' has {len(inputs)} inputs but {len(outputs)} outputs"
        )
    if fn_name is not None and (not isinstance(fn_name, str) or not fn_name.isidentifier()):
        raise DatasetFileError(f"{where}: field 'input_output.fn_name' must be a function name, got {fn_name!r}")
    if fn_name is None:
        for key, items in (("inputs", inputs), ("outputs", outputs)):
            for position, item in enumerate(items):
                if isinstance(item, list) and all(isinstance(line, str) for line in item):
                    items[position] = "\n".join(item)
                elif not isinstance(item, str):
                    raise DatasetFileError(
                        f"{where}: field 'input_output.{key}[{position}]' must be text for a standard-input problem"
                    )
    return inputs, outputs, fn_name


def read_buggy_apps(path: Path) -> list[tuple[CodeProblem, list[str], list[str]]]:
    """Read and check a JSONL file in the Buggy-APPS layout, without running anything.

    Each non-blank line is a JSON object with ``question`` (the statement, a
    non-empty string), ``solutions`` and ``buggy_solutions`` (lists of
    program sources, or strings holding such a JSON list, as in the APPS
    files), ``input_output`` (an object, or a string holding one, with
    ``inputs`` and ``outputs``, lists of equal length, and for call-style
    problems ``fn_name``), and optionally ``problem_id`` (else
    ``"line-<n>"``).

    Returns
    -------
    list of (CodeProblem, list of str, list of str)
        Per line: the problem (with the APPS rule ``lenient_lists``), its
        solutions and its buggy solutions.

    Raises
    ------
    DatasetFileError
        In one line naming the file, the line number and the missing or bad
        field: the file is unreadable, a line is not a JSON object, a field is
        missing or of the wrong type, the tests are malformed, or two lines
        have the same ``problem_id``.
    """
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise DatasetFileError(f"cannot read the Buggy-APPS file {path} ({error})") from None
    records = []
    seen: set[str] = set()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path} line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise DatasetFileError(f"{where} is not valid JSON ({error.msg})") from None
        if not isinstance(record, dict):
            raise DatasetFileError(f"{where} is not a JSON object")
        missing = [name for name in BUGGY_APPS_FIELDS if name not in record]
        if missing:
            raise DatasetFileError(f"{where}: field {missing[0]!r} is missing")
        if not isinstance(record["question"], str) or not record["question"].strip():
            raise DatasetFileError(f"{where}: field 'question' must be a non-empty string")
        solutions = _field_list(record, "solutions", where)
        buggy = _field_list(record, "buggy_solutions", where)
        inputs, outputs, fn_name = _tests_of(record, where)
        identifier = str(record.get("problem_id", f"line-{number}"))
        if identifier in seen:
            raise DatasetFileError(f"{where}: problem_id {identifier!r} is already used by an earlier line")
        seen.add(identifier)
        problem = CodeProblem(identifier, record["question"], fn_name, tuple(inputs), tuple(outputs), True)
        records.append((problem, solutions, buggy))
    if not records:
        raise DatasetFileError(f"the Buggy-APPS file {path} holds no problems")
    return records


def label_buggy_apps(path: Path, spec: BuggyAppsSpec | None = None, workers: int = 1) -> CodeValidationData:
    """Read a Buggy-APPS JSONL file (:func:`read_buggy_apps`) and label its programs.

    With ``spec.label_by == "tests"`` (the default) every program runs
    against its problem's tests (the first ``max_tests_per_problem`` if set)
    in the sandbox and is labelled by the outcome, so a buggy solution that
    passes is 1 and a solution that fails is 0; with ``"field"`` the file's
    grouping is the label. ``spec.file_sha256`` is not checked here (see
    :func:`load_buggy_apps`).
    """
    spec = spec or BuggyAppsSpec()
    problems: dict[str, CodeProblem] = {}
    drawn: list[tuple[str, str, str]] = []
    for problem, solutions, buggy in read_buggy_apps(path):
        if spec.max_tests_per_problem:
            keep = spec.max_tests_per_problem
            problem = CodeProblem(problem.problem_id, problem.statement, problem.fn_name, problem.inputs[:keep],
                                  problem.outputs[:keep], problem.lenient_lists)
        problems[problem.problem_id] = problem
        drawn += [(problem.problem_id, "solution", source) for source in solutions]
        drawn += [(problem.problem_id, "buggy_solution", source) for source in buggy]
    if spec.label_by == "field":
        programs = [CodeProgram(problem_id, text, origin == "solution", origin) for problem_id, origin, text in drawn]
    else:
        jobs = [(text, problems[problem_id].suite()) for problem_id, _, text in drawn]
        runs = run_programs(jobs, spec.limits(), stop_at_first_failure=True, workers=workers)
        programs = [
            CodeProgram(problem_id, text, run.passed, origin, run.reason)
            for (problem_id, origin, text), run in zip(drawn, runs)
        ]
    return CodeValidationData(problems, tuple(programs))


def file_sha256(path: Path) -> str:
    """Return the SHA-256 of a file's bytes; :class:`~nip_like.scenarios.datasets.DatasetFileError` if unreadable."""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError as error:
        raise DatasetFileError(f"cannot read the Buggy-APPS file {path} ({error.strerror or error})") from None


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


def write_buggy_apps(data: CodeValidationData, path: Path) -> None:
    """Write ``data`` as a Buggy-APPS JSONL file, atomically: one line per problem, in the dataset's order.

    Programs labelled 1 go to ``solutions`` and those labelled 0 to
    ``buggy_solutions`` (the labels, not the origins), so reading the file
    back with ``label_by="field"`` gives the same labels.
    """
    lines = []
    for problem in data.problems.values():
        programs = [program for program in data.programs if program.problem_id == problem.problem_id]
        tests: dict[str, Any] = {"inputs": list(problem.inputs), "outputs": list(problem.outputs)}
        if problem.fn_name is not None:
            tests["fn_name"] = problem.fn_name
        record = {
            "problem_id": problem.problem_id,
            "question": problem.statement,
            "solutions": [program.source for program in programs if program.label],
            "buggy_solutions": [program.source for program in programs if not program.label],
            "input_output": json.dumps(tests),
        }
        lines.append(json.dumps(record) + "\n")
    write_text_atomic("".join(lines), Path(path))
