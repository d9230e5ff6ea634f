"""The shared machinery of the code-validation problem family: templates, problems and random inputs.

A :class:`ProblemTemplate` is a small task with variants; a :class:`Problem`
is one variant of one template. The helpers draw the random arguments of
hidden tests (integer lists, strings, words). The templates themselves are
in :mod:`~nip_like.scenarios.code_validation.problems_lists`,
:mod:`~nip_like.scenarios.code_validation.problems_strings` and
:mod:`~nip_like.scenarios.code_validation.problems_arithmetic`;
:mod:`~nip_like.scenarios.code_validation.problems` puts the family together.
This module registers nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

Arguments = list[Any]
Params = Mapping[str, Any]


@dataclass(frozen=True)
class ProblemTemplate:
    """A task with variants: what a :class:`Problem` is made from.

    Parameters
    ----------
    name : str
        The template's name, also its function's name in the solution.
    signature : str
        ``"name(arg: type, ...) -> type"``, as the statement shows it; a
        :class:`string.Template` over the variant's parameters.
    task : str
        What the function returns, completing "Write a function ... that";
        a :class:`string.Template` over the variant's parameters.
    solution : str
        The reference solution's source, a :class:`string.Template` over
        the variant's parameters.
    variants : tuple of dict
        The parameters of each variant (at least one, maybe empty).
    draw_arguments : callable
        ``(rng, params) -> list``: the arguments of one random test.
    edge_cases : callable
        ``params -> list of argument lists`` always tested first (empty
        inputs, boundaries).
    """

    name: str
    signature: str
    task: str
    solution: str
    variants: tuple[dict[str, Any], ...]
    draw_arguments: Callable[[np.random.Generator, Params], Arguments]
    edge_cases: Callable[[Params], list[Arguments]] = field(default=lambda params: [])


@dataclass(frozen=True)
class Problem:
    """One variant of one template: a statement, a signature and a reference solution.

    Parameters
    ----------
    problem_id : str
        ``"<template>/<variant index>"``, unique in the family.
    template : str
        The template's name.
    params : dict
        The variant's parameters.
    fn_name : str
        The function a solution defines.
    signature : str
        ``"fn_name(arg: type, ...) -> type"``.
    task : str
        What the function returns (the statement without its frame).
    solution : str
        The reference solution's source.
    """

    problem_id: str
    template: str
    params: dict[str, Any]
    fn_name: str
    signature: str
    task: str
    solution: str

    def statement(self, example: Arguments | None = None, answer: Any = None) -> str:
        """Return the natural-language statement, with one worked example if ``example`` is given."""
        text = f"Write a Python function `def {self.signature}:` that {self.task}."
        if example is not None:
            call = f"{self.fn_name}({', '.join(repr(argument) for argument in example)})"
            text += f"\nExample: `{call}` returns `{answer!r}`."
        return text


# ---------------------------------------------------------------- input helpers


def random_ints(rng: np.random.Generator, low: int, high: int, min_len: int = 0, max_len: int = 8) -> list[int]:
    """A list of ``min_len .. max_len`` integers in ``low .. high``."""
    return [int(value) for value in rng.integers(low, high + 1, size=int(rng.integers(min_len, max_len + 1)))]


def random_text(rng: np.random.Generator, alphabet: str, min_len: int = 0, max_len: int = 10) -> str:
    """A string of ``min_len .. max_len`` characters of ``alphabet``."""
    return "".join(rng.choice(list(alphabet), size=int(rng.integers(min_len, max_len + 1))))


def random_words(rng: np.random.Generator, sep: str = " ", max_words: int = 6, max_len: int = 7) -> str:
    """Lowercase words of 1 .. ``max_len`` letters joined by ``sep``, sometimes with empty words."""
    words = [random_text(rng, "abcdefghij", 1, max_len) for _ in range(int(rng.integers(0, max_words + 1)))]
    if words and rng.random() < 0.2:
        words.insert(int(rng.integers(0, len(words) + 1)), "")
    return sep.join(words)


def sorted_distinct(rng: np.random.Generator, max_len: int = 8) -> list[int]:
    """A sorted list of distinct integers in ``-20 .. 20``."""
    size = int(rng.integers(0, max_len + 1))
    return sorted(int(value) for value in rng.choice(np.arange(-20, 21), size=size, replace=False))
