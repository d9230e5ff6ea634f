"""The Buggy-APPS layout: reading, labelling and writing code-validation data as JSONL files.

One problem per line, with the fields of Buggy-APPS (APPS problems with
correct and buggy solutions): ``question``, ``solutions``,
``buggy_solutions``, ``input_output`` and optionally ``problem_id``.
:func:`read_buggy_apps` reads and checks a file, :func:`label_buggy_apps`
labels its programs (by running their tests, or by the file's grouping) and
:func:`write_buggy_apps` writes any dataset in the layout. The cached entry
point is :func:`~nip_like.scenarios.code_validation.data.load_buggy_apps`.
This module registers nothing.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from nip_like.checkpoint import write_text_atomic
from nip_like.scenarios.code_validation.dataset import GENERATOR_VERSION, CodeProblem, CodeProgram, CodeValidationData
from nip_like.scenarios.code_validation.sandbox import SandboxLimits, run_programs
from nip_like.scenarios.datasets import DatasetFileError, DatasetSpec, is_real

#: The fields every line of a Buggy-APPS file has.
BUGGY_APPS_FIELDS = ("question", "solutions", "buggy_solutions", "input_output")

#: The largest Buggy-APPS file read, in bytes (1 GiB); a larger one is refused before any line is read.
MAX_FILE_BYTES = 1 << 30

#: The longest line of a Buggy-APPS file, in bytes (16 MiB, the newline not counted); a longer one is
#: refused once that much of it is read, so that reading a file never holds more than one such line.
MAX_LINE_BYTES = 16 << 20

#: How much of a file :func:`file_sha256` reads at once.
_HASH_CHUNK_BYTES = 1 << 20


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
    if fn_name is not None:
        missing = [position for position, item in enumerate(outputs) if item is None]
        if missing:
            raise DatasetFileError(
                f"{where}: field 'input_output.outputs[{missing[0]}]' is null: every test needs the answer it expects "
                f"({len(missing)} of {len(outputs)} are null)"
            )
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


def _size_refusal(what: str, limit: int, constant: str) -> str:
    """The one line refusing ``what`` for being over ``limit`` bytes, the module constant named ``constant``."""
    return f"{what} is over the limit of {limit / 2**20:g} MiB ({constant} in {__name__})"


def _numbered_lines(path: Path) -> Iterator[tuple[int, str]]:
    """Each line of ``path`` with its number (from 1), decoded; at most :data:`MAX_LINE_BYTES` held at once.

    Raises
    ------
    DatasetFileError
        If the file cannot be read, is over :data:`MAX_FILE_BYTES`, or has a
        line over :data:`MAX_LINE_BYTES` or one that is not UTF-8 text.
    """
    try:
        size = path.stat().st_size
        handle = path.open("rb")
    except OSError as error:
        raise DatasetFileError(f"cannot read the Buggy-APPS file {path} ({error.strerror or error})") from None
    with handle:
        if size > MAX_FILE_BYTES:
            raise DatasetFileError(
                _size_refusal(f"the Buggy-APPS file {path} ({size / 2**20:.1f} MiB)", MAX_FILE_BYTES, "MAX_FILE_BYTES")
            )
        number = 0
        while True:
            try:
                raw = handle.readline(MAX_LINE_BYTES + 1)
            except OSError as error:
                raise DatasetFileError(f"cannot read the Buggy-APPS file {path} ({error.strerror or error})") from None
            if not raw:
                return
            number += 1
            raw = raw.removesuffix(b"\n")
            if len(raw) > MAX_LINE_BYTES:
                raise DatasetFileError(_size_refusal(f"{path} line {number}", MAX_LINE_BYTES, "MAX_LINE_BYTES"))
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise DatasetFileError(f"{path} line {number} is not UTF-8 text ({error.reason} at byte {error.start})") from None
            yield number, line


def read_buggy_apps(path: Path) -> list[tuple[CodeProblem, list[str], list[str]]]:
    """Read and check a JSONL file in the Buggy-APPS layout, without running anything.

    Each non-blank line is a JSON object with ``question`` (the statement, a
    non-empty string), ``solutions`` and ``buggy_solutions`` (lists of
    program sources, or strings holding such a JSON list, as in the APPS
    files), ``input_output`` (an object, or a string holding one, with
    ``inputs`` and ``outputs``, lists of equal length, and for call-style
    problems ``fn_name``; no expected output may be null), and optionally
    ``problem_id`` (else ``"line-<n>"``). The file is read line by line: at
    most :data:`MAX_FILE_BYTES` in all and :data:`MAX_LINE_BYTES` per line.

    Returns
    -------
    list of (CodeProblem, list of str, list of str)
        Per line: the problem (with the APPS rule ``lenient_lists``), its
        solutions and its buggy solutions.

    Raises
    ------
    DatasetFileError
        In one line naming the file, the line number and the missing or bad
        field: the file is unreadable or too large, a line is too long, not
        UTF-8 or not a JSON object, a field is missing or of the wrong type,
        the tests are malformed or expect null, two lines have the same
        ``problem_id``, or the file holds no problem or no program.
    """
    path = Path(path)
    records = []
    seen: set[str] = set()
    for number, line in _numbered_lines(path):
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
    if not any(solutions or buggy for _, solutions, buggy in records):
        raise DatasetFileError(
            f"the Buggy-APPS file {path} holds {len(records)} problems but no program: the fields 'solutions' "
            "and 'buggy_solutions' are empty on every line"
        )
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
        check_solutions_pass(path, programs)
    return CodeValidationData(problems, tuple(programs))


def check_solutions_pass(path: Path, programs: Sequence[CodeProgram]) -> None:
    """Refuse labels in which every ``solution`` of a problem failed its own tests, naming the problem.

    A problem whose correct solutions all fail has tests that expect what no
    program gives (wrong or malformed expected outputs) or limits too tight
    for it; labelling by those tests would call every one of its programs
    buggy. Problems without solutions are not checked.

    Raises
    ------
    DatasetFileError
        Naming the file, the first such problem (in the file's order), how
        many solutions it has and why the first failed, and how many problems
        fail so.
    """
    passed: dict[str, bool] = {}
    first_reason: dict[str, str] = {}
    counts: dict[str, int] = {}
    for program in programs:
        if program.origin != "solution":
            continue
        passed[program.problem_id] = passed.get(program.problem_id, False) or program.label
        first_reason.setdefault(program.problem_id, program.reason)
        counts[program.problem_id] = counts.get(program.problem_id, 0) + 1
    failing = [problem_id for problem_id, ok in passed.items() if not ok]
    if failing:
        name = failing[0]
        raise DatasetFileError(
            f"{path}: problem {name!r}: none of its {counts[name]} solutions passes its own tests (the first: "
            f"{first_reason[name]}), so its tests or expected outputs are wrong or its time limits too short; "
            f"{len(failing)} of {len(passed)} problems with solutions fail so"
        )


def file_sha256(path: Path) -> str:
    """Return the SHA-256 of a file's bytes; :class:`~nip_like.scenarios.datasets.DatasetFileError` if unreadable."""
    digest = hashlib.sha256()
    try:
        with Path(path).open("rb") as handle:
            while chunk := handle.read(_HASH_CHUNK_BYTES):
                digest.update(chunk)
    except OSError as error:
        raise DatasetFileError(f"cannot read the Buggy-APPS file {path} ({error.strerror or error})") from None
    return digest.hexdigest()


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
