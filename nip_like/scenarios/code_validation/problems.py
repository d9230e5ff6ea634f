"""The family of small Python programming problems that the code-validation dataset is drawn from.

Each :class:`~nip_like.scenarios.code_validation.templates.ProblemTemplate`
is a small task on integers, lists or strings: a signature, a one-sentence
statement, a reference solution and a generator of hidden-test arguments,
with one or more *variants* (the parameters that make a problem: a threshold,
a modulus, a separator, which of two ties to keep, ...). A
:class:`~nip_like.scenarios.code_validation.templates.Problem` is one variant
of one template; its id is ``"<template>/<variant index>"``. The templates
are written by task family in
:mod:`~nip_like.scenarios.code_validation.problems_lists`,
:mod:`~nip_like.scenarios.code_validation.problems_strings` and
:mod:`~nip_like.scenarios.code_validation.problems_arithmetic`, over the
shared machinery of :mod:`~nip_like.scenarios.code_validation.templates`.

This module puts the family together: :data:`TEMPLATES` lists it in a fixed
order, :func:`all_problems` gives every problem, :func:`draw_problems` a
seeded selection that cycles through the templates, :func:`draw_tests` a
problem's hidden test arguments and :func:`reference_outputs` their expected
answers (by running the reference solution, which is trusted code, in this
process).

The reference solutions are written plainly, with loops, comparisons,
ranges, indices and guard clauses, so that the mutations of
:mod:`~nip_like.scenarios.code_validation.mutations` have places to act.
This module registers nothing.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from string import Template
from typing import Any

import numpy as np

from nip_like.errors import ConfigError
from nip_like.scenarios.code_validation.problems_arithmetic import ARITHMETIC_TEMPLATES
from nip_like.scenarios.code_validation.problems_lists import LIST_TEMPLATES
from nip_like.scenarios.code_validation.problems_strings import STRING_TEMPLATES
from nip_like.scenarios.code_validation.templates import Arguments, Problem, ProblemTemplate

#: The family's order: the seeded draws (:func:`draw_problems`) permute the templates by their place in it,
#: so it is fixed here, apart from the task families the templates are written in.
_ORDER = (
    "count_above",
    "sum_of_multiples",
    "largest",
    "min_index",
    "rotate",
    "count_letters",
    "is_palindrome",
    "clip",
    "label",
    "digit_sum",
    "count_long_words",
    "caesar",
    "power_mod",
    "keep_at_most",
    "longest_run",
    "count_pairs",
    "merge",
    "search",
    "capitalize_words",
    "run_length",
    "floor_mean",
    "count_in_range",
    "factorial_mod",
    "sequence",
    "triangle_kind",
    "is_leap",
    "reverse_words",
    "alternating_sum",
    "spread",
    "count_digits",
    "sum_every",
    "balanced",
    "chunks",
    "interleave",
    "inversions",
    "longest_word",
    "gcd_all",
)
_BY_NAME = {template.name: template for template in (*LIST_TEMPLATES, *STRING_TEMPLATES, *ARITHMETIC_TEMPLATES)}

#: Every template of the family, in :data:`_ORDER`.
TEMPLATES: tuple[ProblemTemplate, ...] = tuple(_BY_NAME[name] for name in _ORDER)


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
