"""The arithmetic templates of the code-validation problem family: tasks on integers.

:data:`ARITHMETIC_TEMPLATES`: multiples, digits, modular powers and
factorials, sequences, triangles, leap years, FizzBuzz labels. The family's
order, which the seeded draws depend on, is that of
:data:`~nip_like.scenarios.code_validation.problems.TEMPLATES`. This module
registers nothing.
"""

from __future__ import annotations

from nip_like.scenarios.code_validation.templates import ProblemTemplate


ARITHMETIC_TEMPLATES: tuple[ProblemTemplate, ...] = (
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
)
