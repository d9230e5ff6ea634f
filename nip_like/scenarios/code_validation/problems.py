"""The family of small Python programming problems that the code-validation dataset is drawn from.

Each :class:`ProblemTemplate` is a small task on integers, lists or strings:
a signature, a one-sentence statement, a reference solution and a generator
of hidden-test arguments, with one or more *variants* (the parameters that
make a problem: a threshold, a modulus, a separator, which of two ties to
keep, ...). A :class:`Problem` is one variant of one template; its id is
``"<template>/<variant index>"``. :data:`TEMPLATES` lists the family,
:func:`all_problems` every problem, :func:`draw_problems` a seeded selection
that cycles through the templates, :func:`draw_tests` a problem's hidden
test arguments and :func:`reference_outputs` their expected answers (by
running the reference solution, which is trusted code, in this process).

The reference solutions are written plainly, with loops, comparisons,
ranges, indices and guard clauses, so that the mutations of
:mod:`~nip_like.scenarios.code_validation.mutations` have places to act.
This module registers nothing.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from string import Template
from typing import Any

import numpy as np

from nip_like.errors import ConfigError

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


def _ints(rng: np.random.Generator, low: int, high: int, min_len: int = 0, max_len: int = 8) -> list[int]:
    """A list of ``min_len .. max_len`` integers in ``low .. high``."""
    return [int(value) for value in rng.integers(low, high + 1, size=int(rng.integers(min_len, max_len + 1)))]


def _text(rng: np.random.Generator, alphabet: str, min_len: int = 0, max_len: int = 10) -> str:
    """A string of ``min_len .. max_len`` characters of ``alphabet``."""
    return "".join(rng.choice(list(alphabet), size=int(rng.integers(min_len, max_len + 1))))


def _words(rng: np.random.Generator, sep: str = " ", max_words: int = 6, max_len: int = 7) -> str:
    """Lowercase words of 1 .. ``max_len`` letters joined by ``sep``, sometimes with empty words."""
    words = [_text(rng, "abcdefghij", 1, max_len) for _ in range(int(rng.integers(0, max_words + 1)))]
    if words and rng.random() < 0.2:
        words.insert(int(rng.integers(0, len(words) + 1)), "")
    return sep.join(words)


def _sorted_distinct(rng: np.random.Generator, max_len: int = 8) -> list[int]:
    """A sorted list of distinct integers in ``-20 .. 20``."""
    size = int(rng.integers(0, max_len + 1))
    return sorted(int(value) for value in rng.choice(np.arange(-20, 21), size=size, replace=False))


def _palindrome_case(rng: np.random.Generator, params: Params) -> Arguments:
    """A string that is a palindrome (under the variant's rule) about half of the time."""
    half = _text(rng, "abcAB ", 0, 5)
    middle = _text(rng, "abc", 0, 1)
    text = half + middle + half[::-1] if rng.random() < 0.5 else _text(rng, "abcAB ", 0, 8)
    if rng.random() < 0.4:
        text = "".join(c.swapcase() if rng.random() < 0.3 else c for c in text)
    return [text]


def _brackets_case(rng: np.random.Generator, params: Params) -> Arguments:
    """A string of the variant's brackets and letters, balanced about half of the time."""
    opening, closing = params["open"], params["close"]
    if rng.random() < 0.5:
        text, depth = "", 0
        for _ in range(int(rng.integers(0, 10))):
            if depth and rng.random() < 0.5:
                text, depth = text + closing, depth - 1
            else:
                text, depth = text + (opening if rng.random() < 0.8 else "x"), depth + 1
        return [text.replace("x", "") + closing * depth]
    return [_text(rng, opening + closing + "x", 0, 8)]


# ---------------------------------------------------------------- the family

TEMPLATES: tuple[ProblemTemplate, ...] = (
    ProblemTemplate(
        name="count_above",
        signature="count_above(xs: list[int]) -> int",
        task="returns how many elements of `xs` are greater than $k",
        solution="""
def count_above(xs):
    count = 0
    for x in xs:
        if x > $k:
            count += 1
    return count
""",
        variants=tuple({"k": k} for k in (-3, 0, 2, 3, 5, 7)),
        draw_arguments=lambda rng, p: [_ints(rng, -10, 10)],
        edge_cases=lambda p: [[[]], [[p["k"]]], [[p["k"] + 1, p["k"] - 1]]],
    ),
    ProblemTemplate(
        name="sum_of_multiples",
        signature="sum_of_multiples(n: int) -> int",
        task="returns the sum of the integers from 1 to `n` inclusive that are divisible by $m (0 if `n` < 1)",
        solution="""
def sum_of_multiples(n):
    total = 0
    for i in range(1, n + 1):
        if i % $m == 0:
            total += i
    return total
""",
        variants=tuple({"m": m} for m in (2, 3, 4, 5, 7, 9)),
        draw_arguments=lambda rng, p: [int(rng.integers(-3, 60))],
        edge_cases=lambda p: [[0], [p["m"]], [p["m"] - 1], [3 * p["m"]]],
    ),
    ProblemTemplate(
        name="largest",
        signature="largest(xs: list[int]) -> int",
        task="returns the largest element of `xs`, or $d if `xs` is empty",
        solution="""
def largest(xs):
    if not xs:
        return $d
    best = xs[0]
    for x in xs[1:]:
        if x > best:
            best = x
    return best
""",
        variants=tuple({"d": d} for d in (0, -1, -100)),
        draw_arguments=lambda rng, p: [_ints(rng, -50, 50)],
        edge_cases=lambda p: [[[]], [[-7]], [[-3, -9, -3]], [[1, 2, 9]]],
    ),
    ProblemTemplate(
        name="min_index",
        signature="min_index(xs: list[int]) -> int",
        task="returns the index of the $which occurrence of the smallest element of `xs`, or -1 if `xs` is empty",
        solution="""
def min_index(xs):
    if not xs:
        return -1
    best = 0
    for i in range(1, len(xs)):
        if xs[i] $op xs[best]:
            best = i
    return best
""",
        variants=({"which": "first", "op": "<"}, {"which": "last", "op": "<="}),
        draw_arguments=lambda rng, p: [_ints(rng, 0, 5)],
        edge_cases=lambda p: [[[]], [[4]], [[1, 1]], [[2, 0, 3, 0]], [[0, 5, 6]]],
    ),
    ProblemTemplate(
        name="rotate",
        signature="rotate(xs: list[int], k: int) -> list[int]",
        task="returns `xs` rotated $direction by `k` positions (`k` >= 0, possibly larger than `len(xs)`)",
        solution="""
def rotate(xs, k):
    if not xs:
        return []
    k = k % len(xs)
    return $body
""",
        variants=(
            {"direction": "left", "body": "xs[k:] + xs[:k]"},
            {"direction": "right", "body": "xs[len(xs) - k:] + xs[:len(xs) - k]"},
        ),
        draw_arguments=lambda rng, p: [_ints(rng, 0, 9, 0, 7), int(rng.integers(0, 11))],
        edge_cases=lambda p: [[[], 3], [[1, 2, 3], 0], [[1, 2, 3], 3], [[1, 2, 3], 4], [[5], 2]],
    ),
    ProblemTemplate(
        name="count_letters",
        signature="count_letters(s: str) -> int",
        task='returns how many characters of `s` are among the letters "$letters"',
        solution="""
def count_letters(s):
    count = 0
    for c in s:
        if c in "$letters":
            count += 1
    return count
""",
        variants=tuple({"letters": letters} for letters in ("aeiou", "aeiouy", "xyz", "abc", "st")),
        draw_arguments=lambda rng, p: [_text(rng, "abcdeistuxyz ", 0, 12)],
        edge_cases=lambda p: [[""], [p["letters"]], ["q"]],
    ),
    ProblemTemplate(
        name="is_palindrome",
        signature="is_palindrome(s: str) -> bool",
        task="returns whether `s` reads the same backwards$rule",
        solution="""
def is_palindrome(s):
    t = $prepare
    i = 0
    j = len(t) - 1
    while i < j:
        if t[i] != t[j]:
            return False
        i += 1
        j -= 1
    return True
""",
        variants=(
            {"rule": "", "prepare": "s"},
            {"rule": ", ignoring the case of letters", "prepare": "s.lower()"},
            {"rule": ", ignoring spaces", "prepare": 's.replace(" ", "")'},
            {"rule": ", ignoring spaces and the case of letters", "prepare": 's.lower().replace(" ", "")'},
        ),
        draw_arguments=_palindrome_case,
        edge_cases=lambda p: [[""], ["a"], ["ab"], ["aA"], ["a b a"], ["ab ba"]],
    ),
    ProblemTemplate(
        name="clip",
        signature="clip(xs: list[int]) -> list[int]",
        task="returns a new list in which every element of `xs` below $lo is replaced by $lo "
        "and every element above $hi by $hi",
        solution="""
def clip(xs):
    out = []
    for x in xs:
        if x < $lo:
            out.append($lo)
        elif x > $hi:
            out.append($hi)
        else:
            out.append(x)
    return out
""",
        variants=tuple({"lo": lo, "hi": hi} for lo, hi in ((-5, 5), (0, 9), (-2, 3), (1, 4))),
        draw_arguments=lambda rng, p: [_ints(rng, -10, 12)],
        edge_cases=lambda p: [[[]], [[p["lo"], p["hi"]]], [[p["lo"] - 1, p["hi"] + 1]]],
    ),
    ProblemTemplate(
        name="label",
        signature="label(n: int) -> str",
        task='returns "$both" if `n` is divisible by both $a and $b, "$wa" if only by $a, '
        '"$wb" if only by $b, and `str(n)` otherwise',
        solution="""
def label(n):
    if n % $a == 0 and n % $b == 0:
        return "$both"
    if n % $a == 0:
        return "$wa"
    if n % $b == 0:
        return "$wb"
    return str(n)
""",
        variants=tuple(
            {"a": a, "b": b, "wa": wa, "wb": wb, "both": wa + wb}
            for (a, b), (wa, wb) in zip(((3, 5), (2, 7), (4, 6), (3, 4)), (("Fizz", "Buzz"), ("Ping", "Pong")) * 2)
        ),
        draw_arguments=lambda rng, p: [int(rng.integers(1, 100))],
        edge_cases=lambda p: [[p["a"] * p["b"]], [p["a"]], [p["b"]], [1]],
    ),
    ProblemTemplate(
        name="digit_sum",
        signature="digit_sum(n: int) -> int",
        task="returns the sum of the digits of the non-negative integer `n` written in base $base",
        solution="""
def digit_sum(n):
    total = 0
    while n > 0:
        total += n % $base
        n //= $base
    return total
""",
        variants=tuple({"base": base} for base in (2, 3, 5, 8, 10)),
        draw_arguments=lambda rng, p: [int(rng.integers(0, 5000))],
        edge_cases=lambda p: [[0], [1], [p["base"]], [p["base"] - 1], [p["base"] ** 3 - 1]],
    ),
    ProblemTemplate(
        name="count_long_words",
        signature="count_long_words(s: str) -> int",
        task="returns how many of the space-separated words of `s` have at least $length letters",
        solution="""
def count_long_words(s):
    count = 0
    for word in s.split():
        if len(word) >= $length:
            count += 1
    return count
""",
        variants=tuple({"length": length} for length in (2, 3, 4, 5, 6)),
        draw_arguments=lambda rng, p: [_words(rng)],
        edge_cases=lambda p: [[""], ["a" * p["length"]], ["a" * (p["length"] - 1)]],
    ),
    ProblemTemplate(
        name="caesar",
        signature="caesar(s: str) -> str",
        task="returns `s` with every lowercase letter a-z shifted $shift place(s) forward in the alphabet "
        "(wrapping from z to a) and every other character unchanged",
        solution="""
def caesar(s):
    out = []
    for c in s:
        if "a" <= c <= "z":
            out.append(chr((ord(c) - ord("a") + $shift) % 26 + ord("a")))
        else:
            out.append(c)
    return "".join(out)
""",
        variants=tuple({"shift": shift} for shift in (1, 3, 5, 13, 25)),
        draw_arguments=lambda rng, p: [_text(rng, "abcxyzAZ !{`", 0, 10)],
        edge_cases=lambda p: [[""], ["z"], ["a"], ["{`"]],
    ),
    ProblemTemplate(
        name="power_mod",
        signature="power_mod(b: int, e: int) -> int",
        task="returns `b` to the power `e`, modulo $m (`b`, `e` >= 0; `0 ** 0` is 1)",
        solution="""
def power_mod(b, e):
    result = 1
    b = b % $m
    while e > 0:
        if e % 2 == 1:
            result = result * b % $m
        b = b * b % $m
        e = e // 2
    return result
""",
        variants=tuple({"m": m} for m in (7, 10, 13, 97, 1000)),
        draw_arguments=lambda rng, p: [int(rng.integers(0, 50)), int(rng.integers(0, 40))],
        edge_cases=lambda p: [[0, 0], [5, 0], [3, 1], [p["m"], 3], [2, 10]],
    ),
    ProblemTemplate(
        name="keep_at_most",
        signature="keep_at_most(xs: list[int]) -> list[int]",
        task="returns `xs` keeping only the first $k occurrence(s) of each value, in order",
        solution="""
def keep_at_most(xs):
    counts = {}
    out = []
    for x in xs:
        seen = counts.get(x, 0)
        if seen < $k:
            out.append(x)
        counts[x] = seen + 1
    return out
""",
        variants=tuple({"k": k} for k in (1, 2, 3)),
        draw_arguments=lambda rng, p: [_ints(rng, 0, 4, 0, 10)],
        edge_cases=lambda p: [[[]], [[1, 1, 1, 1]], [[2, 1, 2, 1, 2, 1]]],
    ),
    ProblemTemplate(
        name="longest_run",
        signature="longest_run(xs: list[int]) -> int",
        task="returns the length of the longest run of adjacent elements of `xs` in which each is $relation "
        "the one before it (0 for an empty list)",
        solution="""
def longest_run(xs):
    if not xs:
        return 0
    best = 1
    current = 1
    for i in range(1, len(xs)):
        if xs[i - 1] $op xs[i]:
            current += 1
        else:
            current = 1
        if current > best:
            best = current
    return best
""",
        variants=(
            {"relation": "equal to", "op": "=="},
            {"relation": "strictly greater than", "op": "<"},
            {"relation": "strictly smaller than", "op": ">"},
        ),
        draw_arguments=lambda rng, p: [_ints(rng, 0, 4, 0, 9)],
        edge_cases=lambda p: [[[]], [[3]], [[1, 1, 2, 2, 2]], [[1, 2, 3, 0]], [[3, 2, 1, 4]]],
    ),
    ProblemTemplate(
        name="count_pairs",
        signature="count_pairs(xs: list[int]) -> int",
        task="returns the number of pairs of positions `i < j` with `xs[i] + xs[j] == $target`",
        solution="""
def count_pairs(xs):
    count = 0
    for i in range(len(xs)):
        for j in range(i + 1, len(xs)):
            if xs[i] + xs[j] == $target:
                count += 1
    return count
""",
        variants=tuple({"target": target} for target in (0, 5, 10)),
        draw_arguments=lambda rng, p: [_ints(rng, -5, 10, 0, 8)],
        edge_cases=lambda p: [[[]], [[p["target"]]], [[p["target"] // 2, p["target"] - p["target"] // 2]]],
    ),
    ProblemTemplate(
        name="merge",
        signature="merge(a: list[int], b: list[int]) -> list[int]",
        task="merges the lists `a` and `b`, each sorted in $order order, into one list sorted in $order order",
        solution="""
def merge(a, b):
    out = []
    i = 0
    j = 0
    while i < len(a) and j < len(b):
        if a[i] $op b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    out.extend(a[i:])
    out.extend(b[j:])
    return out
""",
        variants=({"order": "ascending", "op": "<="}, {"order": "descending", "op": ">="}),
        draw_arguments=lambda rng, p: [
            sorted(_ints(rng, 0, 9, 0, 5), reverse=p["order"] == "descending"),
            sorted(_ints(rng, 0, 9, 0, 5), reverse=p["order"] == "descending"),
        ],
        edge_cases=lambda p: [[[], []], [[1], []], [[], [2]]],
    ),
    ProblemTemplate(
        name="search",
        signature="search(xs: list[int], target: int) -> $returns",
        task="returns the index of `target` in `xs`, a list of distinct integers sorted in ascending order, "
        "or $missing_text if it is absent",
        solution="""
def search(xs, target):
    lo = 0
    hi = len(xs) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if xs[mid] == target:
            return mid
        if xs[mid] < target:
            lo = mid + 1
        else:
            hi = mid - 1
    return $missing
""",
        variants=(
            {"missing": "-1", "missing_text": "-1", "returns": "int"},
            {"missing": "None", "missing_text": "None", "returns": "int | None"},
        ),
        draw_arguments=lambda rng, p: (
            lambda xs: [xs, int(rng.choice(xs)) if xs and rng.random() < 0.6 else int(rng.integers(-21, 22))]
        )(_sorted_distinct(rng)),
        edge_cases=lambda p: [[[], 1], [[4], 4], [[1, 3, 5, 7], 3], [[1, 3, 5, 7], 7], [[1, 3, 5, 7], 4], [[4], 5]],
    ),
    ProblemTemplate(
        name="capitalize_words",
        signature="capitalize_words(s: str) -> str",
        task='returns `s` with the first character of every "$sep"-separated word made uppercase '
        "(the separators, including repeated ones, are kept)",
        solution="""
def capitalize_words(s):
    words = s.split("$sep")
    out = []
    for w in words:
        if w:
            out.append(w[0].upper() + w[1:])
        else:
            out.append(w)
    return "$sep".join(out)
""",
        variants=tuple({"sep": sep} for sep in (" ", "-", "_")),
        draw_arguments=lambda rng, p: [_words(rng, p["sep"], 5, 5)],
        edge_cases=lambda p: [[""], [p["sep"]], ["ab" + 2 * p["sep"] + "cd"], ["x"]],
    ),
    ProblemTemplate(
        name="run_length",
        signature="run_length(s: str) -> str",
        task="returns the run-length encoding of `s`: each maximal run of one character becomes the character "
        "followed by the run's length$omit",
        solution="""
def run_length(s):
    if not s:
        return ""
    out = []
    current = s[0]
    count = 1
    for c in s[1:]:
        if c == current:
            count += 1
        else:
            out.append(current + $suffix)
            current = c
            count = 1
    out.append(current + $suffix)
    return "".join(out)
""",
        variants=(
            {"omit": "", "suffix": "str(count)"},
            {"omit": ", the length left out when it is 1", "suffix": '(str(count) if count > 1 else "")'},
        ),
        draw_arguments=lambda rng, p: [_text(rng, "aab", 0, 10)],
        edge_cases=lambda p: [[""], ["a"], ["aaab"], ["abb"]],
    ),
    ProblemTemplate(
        name="floor_mean",
        signature="floor_mean(xs: list[int]) -> int",
        task="returns the mean of `xs` rounded down to an integer, or $d if `xs` is empty",
        solution="""
def floor_mean(xs):
    if len(xs) == 0:
        return $d
    total = 0
    for x in xs:
        total += x
    return total // len(xs)
""",
        variants=tuple({"d": d} for d in (0, -1)),
        draw_arguments=lambda rng, p: [_ints(rng, -20, 20, 0, 6)],
        edge_cases=lambda p: [[[]], [[-3]], [[-1, 0]], [[1, 2]]],
    ),
    ProblemTemplate(
        name="count_in_range",
        signature="count_in_range(xs: list[int]) -> int",
        task="returns how many elements of `xs` lie between $lo and $hi, both included",
        solution="""
def count_in_range(xs):
    return len([x for x in xs if $lo <= x <= $hi])
""",
        variants=tuple({"lo": lo, "hi": hi} for lo, hi in ((0, 5), (-3, 3), (2, 8), (-10, -1))),
        draw_arguments=lambda rng, p: [_ints(rng, -12, 12)],
        edge_cases=lambda p: [[[]], [[p["lo"], p["hi"]]], [[p["lo"] - 1, p["hi"] + 1]]],
    ),
    ProblemTemplate(
        name="factorial_mod",
        signature="factorial_mod(n: int) -> int",
        task="returns `n!` (the product of 1 .. `n`, 1 for `n` = 0) modulo $m",
        solution="""
def factorial_mod(n):
    result = 1
    for i in range(2, n + 1):
        result = result * i % $m
    return result
""",
        variants=tuple({"m": m} for m in (7, 11, 1000, 1000000007)),
        draw_arguments=lambda rng, p: [int(rng.integers(0, 30))],
        edge_cases=lambda p: [[0], [1], [2], [p["m"] % 30]],
    ),
    ProblemTemplate(
        name="sequence",
        signature="sequence(n: int) -> int",
        task="returns term `n` (counting from 0) of the sequence that starts $a, $b and in which every later "
        "term is the sum of the two before it",
        solution="""
def sequence(n):
    a = $a
    b = $b
    for _ in range(n):
        a, b = b, a + b
    return a
""",
        variants=tuple({"a": a, "b": b} for a, b in ((0, 1), (2, 1), (1, 1), (3, 2))),
        draw_arguments=lambda rng, p: [int(rng.integers(0, 25))],
        edge_cases=lambda p: [[0], [1], [2]],
    ),
    ProblemTemplate(
        name="triangle_kind",
        signature="triangle_kind(a: int, b: int, c: int) -> str",
        task='returns "invalid" if side lengths `a`, `b`, `c` cannot form a triangle of positive area, '
        'else "equilateral", "isosceles" or "scalene"',
        solution="""
def triangle_kind(a, b, c):
    x, y, z = sorted([a, b, c])
    if x <= 0 or x + y <= z:
        return "invalid"
    if x == z:
        return "equilateral"
    if x == y or y == z:
        return "isosceles"
    return "scalene"
""",
        variants=({},),
        draw_arguments=lambda rng, p: [int(value) for value in rng.integers(0, 7, size=3)],
        edge_cases=lambda p: [[1, 1, 1], [1, 2, 3], [2, 2, 3], [3, 4, 5], [0, 2, 2], [2, 3, 3], [1, 1, 2]],
    ),
    ProblemTemplate(
        name="is_leap",
        signature="is_leap(year: int) -> bool",
        task="returns whether `year` is a leap year of the Gregorian calendar (divisible by 4, except "
        "years divisible by 100 that are not divisible by 400)",
        solution="""
def is_leap(year):
    if year % 400 == 0:
        return True
    if year % 100 == 0:
        return False
    return year % 4 == 0
""",
        variants=({},),
        draw_arguments=lambda rng, p: [
            int(rng.integers(1, 26)) * (100 if rng.random() < 0.4 else 4) + int(rng.integers(0, 3))
        ],
        edge_cases=lambda p: [[2000], [1900], [2024], [2023], [2100], [1600]],
    ),
    ProblemTemplate(
        name="reverse_words",
        signature="reverse_words(s: str) -> str",
        task='returns the "$sep"-separated words of `s` in reverse order, joined by "$sep"',
        solution="""
def reverse_words(s):
    words = s.split("$sep")
    out = []
    for i in range(len(words) - 1, -1, -1):
        out.append(words[i])
    return "$sep".join(out)
""",
        variants=tuple({"sep": sep} for sep in (" ", ",")),
        draw_arguments=lambda rng, p: [_words(rng, p["sep"])],
        edge_cases=lambda p: [[""], ["one"], ["a" + p["sep"] + "b"]],
    ),
    ProblemTemplate(
        name="alternating_sum",
        signature="alternating_sum(xs: list[int]) -> int",
        task="returns $first`xs[0]` $second `xs[1]` $first2 `xs[2]` ... (0 for an empty list)",
        solution="""
def alternating_sum(xs):
    total = 0
    for i in range(len(xs)):
        if i % 2 == 0:
            total $even= xs[i]
        else:
            total $odd= xs[i]
    return total
""",
        variants=(
            {"first": "", "second": "-", "first2": "+", "even": "+", "odd": "-"},
            {"first": "-", "second": "+", "first2": "-", "even": "-", "odd": "+"},
        ),
        draw_arguments=lambda rng, p: [_ints(rng, -9, 9)],
        edge_cases=lambda p: [[[]], [[5]], [[1, 2, 3]]],
    ),
    ProblemTemplate(
        name="spread",
        signature="spread(xs: list[int]) -> int",
        task="returns the largest element of `xs` minus its smallest, or $d if `xs` is empty",
        solution="""
def spread(xs):
    if not xs:
        return $d
    low = xs[0]
    high = xs[0]
    for x in xs:
        if x < low:
            low = x
        if x > high:
            high = x
    return high - low
""",
        variants=tuple({"d": d} for d in (0, -1)),
        draw_arguments=lambda rng, p: [_ints(rng, -20, 20)],
        edge_cases=lambda p: [[[]], [[4]], [[3, 9, 1]], [[-2, -8]]],
    ),
    ProblemTemplate(
        name="count_digits",
        signature="count_digits(s: str) -> int",
        task="returns how many characters of `s` are $parity decimal digits",
        solution="""
def count_digits(s):
    count = 0
    for c in s:
        if c.isdigit() and int(c) % 2 == $remainder:
            count += 1
    return count
""",
        variants=({"parity": "even", "remainder": 0}, {"parity": "odd", "remainder": 1}),
        draw_arguments=lambda rng, p: [_text(rng, "0123456789ab ", 0, 10)],
        edge_cases=lambda p: [[""], ["0"], ["9"], ["a1b2"]],
    ),
    ProblemTemplate(
        name="sum_every",
        signature="sum_every(xs: list[int]) -> int",
        task="returns the sum of the elements of `xs` at positions 0, $k, $k2, ... (one in every $k, from the first)",
        solution="""
def sum_every(xs):
    total = 0
    for i in range(0, len(xs), $k):
        total += xs[i]
    return total
""",
        variants=tuple({"k": k, "k2": 2 * k} for k in (2, 3, 4)),
        draw_arguments=lambda rng, p: [_ints(rng, -9, 9, 0, 10)],
        edge_cases=lambda p: [[[]], [[7]], [list(range(1, 2 * p["k"] + 2))]],
    ),
    ProblemTemplate(
        name="balanced",
        signature="balanced(s: str) -> bool",
        task='returns whether the brackets "$open" and "$close" in `s` are balanced (every "$close" closes '
        'an earlier unclosed "$open", and none stays open); other characters are ignored',
        solution="""
def balanced(s):
    depth = 0
    for c in s:
        if c == "$open":
            depth += 1
        elif c == "$close":
            depth -= 1
            if depth < 0:
                return False
    return depth == 0
""",
        variants=tuple({"open": o, "close": c} for o, c in ("()", "[]", "{}", "<>")),
        draw_arguments=_brackets_case,
        edge_cases=lambda p: [[""], [p["close"] + p["open"]], [p["open"]], [p["open"] + p["close"]]],
    ),
    ProblemTemplate(
        name="chunks",
        signature="chunks(xs: list[int]) -> list[list[int]]",
        task="splits `xs` into consecutive pieces of $size elements (the last may be shorter) and returns them",
        solution="""
def chunks(xs):
    out = []
    for start in range(0, len(xs), $size):
        out.append(xs[start:start + $size])
    return out
""",
        variants=tuple({"size": size} for size in (2, 3, 4)),
        draw_arguments=lambda rng, p: [_ints(rng, 0, 9, 0, 10)],
        edge_cases=lambda p: [[[]], [list(range(p["size"]))], [list(range(p["size"] + 1))]],
    ),
    ProblemTemplate(
        name="interleave",
        signature="interleave(a: list[int], b: list[int]) -> list[int]",
        task="returns the elements of `a` and `b` alternately, starting with `$first`; when one list runs out, "
        "the rest of the other follows",
        solution="""
def interleave(a, b):
    out = []
    for i in range(max(len(a), len(b))):
        if i < len($first):
            out.append($first[i])
        if i < len($second):
            out.append($second[i])
    return out
""",
        variants=({"first": "a", "second": "b"}, {"first": "b", "second": "a"}),
        draw_arguments=lambda rng, p: [_ints(rng, 0, 9, 0, 5), _ints(rng, 10, 19, 0, 5)],
        edge_cases=lambda p: [[[], []], [[1, 2, 3], [4]], [[1], [4, 5, 6]]],
    ),
    ProblemTemplate(
        name="inversions",
        signature="inversions(xs: list[int]) -> int",
        task="returns the number of pairs of positions `i < j` with `xs[i]` $relation `xs[j]`",
        solution="""
def inversions(xs):
    count = 0
    for i in range(len(xs)):
        for j in range(i + 1, len(xs)):
            if xs[i] $op xs[j]:
                count += 1
    return count
""",
        variants=({"relation": "greater than", "op": ">"}, {"relation": "greater than or equal to", "op": ">="}),
        draw_arguments=lambda rng, p: [_ints(rng, 0, 5, 0, 8)],
        edge_cases=lambda p: [[[]], [[1]], [[2, 2]], [[3, 2, 1]]],
    ),
    ProblemTemplate(
        name="longest_word",
        signature="longest_word(s: str) -> str",
        task='returns the $which longest of the space-separated words of `s`, or "" if there are none',
        solution="""
def longest_word(s):
    best = ""
    for word in s.split():
        if len(word) $op len(best):
            best = word
    return best
""",
        variants=({"which": "first", "op": ">"}, {"which": "last", "op": ">="}),
        draw_arguments=lambda rng, p: [_words(rng, " ", 6, 4)],
        edge_cases=lambda p: [[""], ["ab cd"], ["a bb c"]],
    ),
    ProblemTemplate(
        name="gcd_all",
        signature="gcd_all(xs: list[int]) -> int",
        task="returns the greatest common divisor of the absolute values of the elements of `xs` "
        "(0 for an empty list or a list of zeros)",
        solution="""
def gcd_all(xs):
    result = 0
    for x in xs:
        a = abs(x)
        b = result
        while b:
            a, b = b, a % b
        result = a
    return result
""",
        variants=({},),
        draw_arguments=lambda rng, p: (lambda base: [[base * v for v in _ints(rng, -6, 6, 0, 5)]])(int(rng.integers(1, 7))),
        edge_cases=lambda p: [[[]], [[0, 0]], [[-4]], [[6, 10, 15]], [[12, 18]]],
    ),
)


def _template_named(name: str) -> ProblemTemplate:
    """The template called ``name``."""
    for template in TEMPLATES:
        if template.name == name:
            return template
    raise KeyError(f"no problem template named {name!r}")


def make_problem(template: ProblemTemplate, variant: int) -> Problem:
    """Return variant number ``variant`` of ``template`` as a :class:`Problem`."""
    params = dict(template.variants[variant])
    text = {name: str(value) for name, value in params.items()}
    return Problem(
        problem_id=f"{template.name}/{variant}",
        template=template.name,
        params=params,
        fn_name=template.name,
        signature=Template(template.signature).substitute(text),
        task=Template(template.task).substitute(text),
        solution=Template(template.solution).substitute(text).strip() + "\n",
    )


def all_problems() -> list[Problem]:
    """Return every problem of the family, template by template, variant by variant."""
    return [make_problem(template, variant) for template in TEMPLATES for variant in range(len(template.variants))]


def draw_problems(rng: np.random.Generator, count: int) -> list[Problem]:
    """Draw ``count`` different problems, cycling through the templates in a random order.

    Every template gives one problem per round (a random variant not drawn
    yet) until it has none left, so a small draw covers as many templates as
    possible.

    Raises
    ------
    ConfigError
        If ``count`` exceeds the family's size (``len(all_problems())``).
    """
    total = sum(len(template.variants) for template in TEMPLATES)
    if count > total:
        raise ConfigError(f"the problem family has {total} problems; cannot draw {count}")
    order = [TEMPLATES[int(index)] for index in rng.permutation(len(TEMPLATES))]
    queues = {template.name: [int(index) for index in rng.permutation(len(template.variants))] for template in order}
    problems: list[Problem] = []
    while len(problems) < count:
        for template in order:
            if queues[template.name] and len(problems) < count:
                problems.append(make_problem(template, queues[template.name].pop(0)))
    return problems


def draw_tests(problem: Problem, rng: np.random.Generator, count: int) -> list[Arguments]:
    """Draw the arguments of ``count`` different hidden tests of ``problem``.

    The template's edge cases come first (at most half of the tests), then
    random draws; a draw equal to an earlier test is drawn again (up to 50
    times per test, so a problem with few possible inputs may get fewer).
    """
    template = _template_named(problem.template)
    tests: list[Arguments] = []
    seen: set[str] = set()

    def add(arguments: Arguments) -> None:
        if repr(arguments) not in seen:
            seen.add(repr(arguments))
            tests.append(arguments)

    for arguments in template.edge_cases(problem.params)[: max(1, count // 2)]:
        add(arguments)
    attempts = 0
    while len(tests) < count and attempts < 50 * count:
        add(template.draw_arguments(rng, problem.params))
        attempts += 1
    return tests[:count]


def draw_example(problem: Problem, rng: np.random.Generator) -> Arguments:
    """Draw the arguments of the worked example of ``problem``'s statement."""
    return _template_named(problem.template).draw_arguments(rng, problem.params)


def reference_outputs(problem: Problem, tests: Sequence[Arguments]) -> list[Any]:
    """Return the reference solution's answer to each test (run here: the reference is trusted code).

    Each call gets a deep copy of its arguments, so a solution that changes
    them changes nothing else.
    """
    namespace: dict[str, Any] = {}
    exec(compile(problem.solution, f"<reference {problem.problem_id}>", "exec"), namespace)
    function = namespace[problem.fn_name]
    return [function(*copy.deepcopy(arguments)) for arguments in tests]
