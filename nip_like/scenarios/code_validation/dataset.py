"""The code-validation dataset's classes: problems with hidden tests, labelled programs, and the dataset file.

:class:`CodeProblem` (a statement and its hidden tests), :class:`CodeProgram`
(a program with its label) and :class:`CodeValidationData` (a dataset of
programs with the problems they were written for, saved and read as a
checked file). The generated family is built by
:mod:`~nip_like.scenarios.code_validation.data`, a Buggy-APPS file read by
:mod:`~nip_like.scenarios.code_validation.buggy_apps`. This module registers
nothing.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

import torch

from nip_like.checkpoint import load_checked, save_atomic
from nip_like.errors import CheckpointError
from nip_like.scenarios.code_validation.sandbox import TestSuite
from nip_like.scenarios.datasets import DatasetFileError

#: Version of the generation procedure. It enters :meth:`CodeValidationSpec.key`,
#: so a change to the family, the mutations or the labelling never reuses an old cache file.
GENERATOR_VERSION = 1

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
