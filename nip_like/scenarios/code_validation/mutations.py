"""Buggy variants of a program by small AST mutations, and surface rewrites that keep a program's meaning.

A *mutation* changes one place of a program the way a programmer's slip
would (:data:`MUTATIONS`, each with its description):

=========================  ==============================================================
``off_by_one_constant``    an integer literal ``c`` becomes ``c + 1`` or ``c - 1``
``off_by_one_range``       a ``range(...)`` start or stop moves by one
``off_by_one_index``       an index ``a[i]`` or a slice bound moves by one
``flip_comparison``        a comparison is negated: ``<`` / ``>=``, ``>`` / ``<=``,
                           ``==`` / ``!=``, ``in`` / ``not in``, ``is`` / ``is not``
``relax_comparison``       a strict comparison becomes non-strict or back:
                           ``<`` / ``<=``, ``>`` / ``>=``
``reverse_comparison``     a comparison points the other way: ``<`` / ``>``, ``<=`` / ``>=``
``drop_branch``            an edge case is lost: a guard clause (an ``if`` without
                           ``else`` that returns, raises, breaks or continues) is
                           removed, an ``if`` is replaced by its ``else`` part, or a
                           conditional expression by one of its two values
``drop_condition``         one operand of an ``and`` / ``or`` is dropped
``swap_and_or``            ``and`` becomes ``or`` or back
``negate_condition``       an ``if`` / ``while`` / conditional test that is not a
                           comparison is negated (or loses its ``not``)
``swap_arguments``         two adjacent positional arguments of a call, or two adjacent
                           parameters of the function, change places
``swap_operands``          the operands of ``-``, ``/``, ``//``, ``%``, ``**`` (or of a
                           ``+`` without a number literal) change places
``wrong_operator``         an arithmetic operator (also in ``+=`` and friends) is replaced:
                           ``+`` / ``-``, ``*`` to ``+`` or ``//``, ``//`` to ``%`` or
                           ``/``, ``%`` to ``//``, ``/`` to ``//``, ``**`` to ``*``
``wrong_return``           a returned value is replaced: a name by another variable of the
                           function, ``True`` / ``False`` by the other, a string literal by
                           ``""``, ``a op b`` by ``a`` or ``b``
``drop_statement``         a call statement, an augmented assignment or an assignment is
                           removed from a block of two or more statements
=========================  ==============================================================

A mutation is only a *candidate* bug: whether the mutant is buggy is decided
by running the hidden tests (:mod:`~nip_like.scenarios.code_validation.data`);
a mutant that passes them (``max(a, b)`` with its arguments swapped, a loop
from 2 instead of 1 in a product) is labelled correct.

A *rewrite* changes a program's surface but never its meaning
(:func:`rewrite`): local variables renamed, ``a < b`` written ``b > a``,
``x += y`` written ``x = x + y``. Every program of the dataset, correct or
buggy, is rewritten, and every source is printed by :func:`ast.unparse`, so
that neither the names nor the layout tell a mutant from a reference.
This module registers nothing.
"""

from __future__ import annotations

import ast
import copy
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

Replacement = ast.AST | list[ast.stmt]


@dataclass(frozen=True)
class Mutation:
    """One kind of small bug.

    Parameters
    ----------
    name : str
        Its name, stored with each mutant.
    description : str
        What it changes, in one sentence.
    alternatives : callable
        ``(node, variables) -> list``: the replacements of ``node`` that this
        mutation makes (empty if it does not apply there); ``variables`` are
        the function's parameter and variable names in order of appearance.
        A replacement is a node, or a list of statements for a statement.
    """

    name: str
    description: str
    alternatives: Callable[[ast.AST, list[str]], list[Replacement]]


@dataclass(frozen=True)
class Site:
    """One place where one mutation applies: the mutation, the node's index in ``ast.walk`` order, the alternative."""

    mutation: str
    node: int
    alternative: int


def _shift(expression: ast.expr, delta: int) -> ast.expr:
    """Return ``expression + delta``, folded into a literal ``+ c`` or ``- c`` where there is one."""
    expression = copy.deepcopy(expression)
    if isinstance(expression, ast.Constant) and type(expression.value) is int:
        return ast.Constant(expression.value + delta)
    if isinstance(expression, ast.BinOp) and isinstance(expression.right, ast.Constant):
        if type(expression.right.value) is int and isinstance(expression.op, (ast.Add, ast.Sub)):
            value = expression.right.value + (delta if isinstance(expression.op, ast.Add) else -delta)
            return expression.left if value == 0 else ast.BinOp(expression.left, expression.op, ast.Constant(value))
    return ast.BinOp(expression, ast.Add() if delta > 0 else ast.Sub(), ast.Constant(abs(delta)))


def _with(node: ast.AST, **changes: object) -> ast.AST:
    """A deep copy of ``node`` with some fields replaced (the replacements are not copied)."""
    new = copy.deepcopy(node)
    for name, value in changes.items():
        setattr(new, name, value)
    return new


def _int_constant(node: ast.AST, variables: list[str]) -> list[Replacement]:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return [ast.Constant(node.value + 1), ast.Constant(node.value - 1)]
    return []


def _range_bound(node: ast.AST, variables: list[str]) -> list[Replacement]:
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "range"):
        return []
    if any(isinstance(argument, ast.Starred) for argument in node.args):
        return []
    out: list[Replacement] = []
    for position in range(min(len(node.args), 2)):
        for delta in (1, -1):
            arguments = [copy.deepcopy(argument) for argument in node.args]
            arguments[position] = _shift(arguments[position], delta)
            out.append(_with(node, args=arguments))
    return out


def _index(node: ast.AST, variables: list[str]) -> list[Replacement]:
    if not isinstance(node, ast.Subscript):
        return []
    if isinstance(node.slice, ast.Slice):
        out: list[Replacement] = []
        for bound in ("lower", "upper"):
            if getattr(node.slice, bound) is not None:
                for delta in (1, -1):
                    out.append(_with(node, slice=_with(node.slice, **{bound: _shift(getattr(node.slice, bound), delta)})))
        return out
    return [_with(node, slice=_shift(node.slice, delta)) for delta in (1, -1)]


_NEGATED = {ast.Lt: ast.GtE, ast.GtE: ast.Lt, ast.Gt: ast.LtE, ast.LtE: ast.Gt, ast.Eq: ast.NotEq,
            ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is}
_RELAXED = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt}
_REVERSED = {ast.Lt: ast.Gt, ast.Gt: ast.Lt, ast.LtE: ast.GtE, ast.GtE: ast.LtE}
_MIRRORED = {ast.Lt: ast.Gt, ast.Gt: ast.Lt, ast.LtE: ast.GtE, ast.GtE: ast.LtE, ast.Eq: ast.Eq, ast.NotEq: ast.NotEq}


def _comparison(table: dict[type, type]) -> Callable[[ast.AST, list[str]], list[Replacement]]:
    """Alternatives that replace one operator of a comparison by ``table[operator]``."""

    def alternatives(node: ast.AST, variables: list[str]) -> list[Replacement]:
        if not isinstance(node, ast.Compare):
            return []
        out: list[Replacement] = []
        for position, operator in enumerate(node.ops):
            if type(operator) in table:
                operators = list(node.ops)
                operators[position] = table[type(operator)]()
                out.append(_with(node, ops=operators))
        return out

    return alternatives


def _is_jump(statement: ast.stmt) -> bool:
    return isinstance(statement, (ast.Return, ast.Raise, ast.Break, ast.Continue))


def _blocks(node: ast.AST) -> list[str]:
    """The names of ``node``'s statement-list fields."""
    return [name for name in ("body", "orelse", "finalbody") if isinstance(getattr(node, name, None), list)
            and all(isinstance(item, ast.stmt) for item in getattr(node, name))]


def _spliced(node: ast.AST, block: str, position: int, statements: list[ast.stmt]) -> ast.AST:
    """A copy of ``node`` whose ``block`` has statement ``position`` replaced by ``statements`` (``pass`` if empty)."""
    items = [copy.deepcopy(item) for item in getattr(node, block)]
    items[position : position + 1] = [copy.deepcopy(item) for item in statements]
    if not items and block == "body":
        items = [ast.Pass()]
    return _with(node, **{block: items})


def _branch(node: ast.AST, variables: list[str]) -> list[Replacement]:
    if isinstance(node, ast.IfExp):
        return [copy.deepcopy(node.body), copy.deepcopy(node.orelse)]
    out: list[Replacement] = []
    for block in _blocks(node):
        for position, statement in enumerate(getattr(node, block)):
            if not isinstance(statement, ast.If):
                continue
            if statement.orelse:
                out.append(_spliced(node, block, position, statement.orelse))
            elif statement.body and _is_jump(statement.body[-1]):
                out.append(_spliced(node, block, position, []))
    return out


def _condition_operand(node: ast.AST, variables: list[str]) -> list[Replacement]:
    if not isinstance(node, ast.BoolOp):
        return []
    out: list[Replacement] = []
    for position in range(len(node.values)):
        rest = [copy.deepcopy(value) for index, value in enumerate(node.values) if index != position]
        out.append(rest[0] if len(rest) == 1 else _with(node, values=rest))
    return out


def _and_or(node: ast.AST, variables: list[str]) -> list[Replacement]:
    if not isinstance(node, ast.BoolOp):
        return []
    return [_with(node, op=ast.Or() if isinstance(node.op, ast.And) else ast.And())]


def _negated_test(test: ast.expr) -> ast.expr | None:
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return copy.deepcopy(test.operand)
    if isinstance(test, ast.Compare):
        return None
    return ast.UnaryOp(ast.Not(), copy.deepcopy(test))


def _negate(node: ast.AST, variables: list[str]) -> list[Replacement]:
    if isinstance(node, (ast.If, ast.While, ast.IfExp)):
        negated = _negated_test(node.test)
        return [] if negated is None else [_with(node, test=negated)]
    if isinstance(node, ast.comprehension):
        out: list[Replacement] = []
        for position, test in enumerate(node.ifs):
            negated = _negated_test(test)
            if negated is not None:
                tests = [copy.deepcopy(item) for item in node.ifs]
                tests[position] = negated
                out.append(_with(node, ifs=tests))
        return out
    return []


def _swapped(items: list, position: int) -> list:
    items = [copy.deepcopy(item) for item in items]
    items[position], items[position + 1] = items[position + 1], items[position]
    return items


def _arguments(node: ast.AST, variables: list[str]) -> list[Replacement]:
    if isinstance(node, ast.Call) and not any(isinstance(argument, ast.Starred) for argument in node.args):
        return [
            _with(node, args=_swapped(node.args, position))
            for position in range(len(node.args) - 1)
            if ast.dump(node.args[position]) != ast.dump(node.args[position + 1])
        ]
    if isinstance(node, ast.FunctionDef):
        parameters = node.args.args
        return [
            _with(node, args=_with(node.args, args=_swapped(parameters, position)))
            for position in range(len(parameters) - 1)
        ]
    return []


_ORDER_MATTERS = (ast.Sub, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow)


def _operands(node: ast.AST, variables: list[str]) -> list[Replacement]:
    if not isinstance(node, ast.BinOp) or ast.dump(node.left) == ast.dump(node.right):
        return []
    literal = isinstance(node.left, ast.Constant) or isinstance(node.right, ast.Constant)
    if isinstance(node.op, _ORDER_MATTERS) or (isinstance(node.op, ast.Add) and not literal):
        return [_with(node, left=copy.deepcopy(node.right), right=copy.deepcopy(node.left))]
    return []


_WRONG_OPERATORS: dict[type, tuple[type, ...]] = {
    ast.Add: (ast.Sub,), ast.Sub: (ast.Add,), ast.Mult: (ast.Add, ast.FloorDiv), ast.FloorDiv: (ast.Mod, ast.Div),
    ast.Mod: (ast.FloorDiv,), ast.Div: (ast.FloorDiv,), ast.Pow: (ast.Mult,),
}


def _operator(node: ast.AST, variables: list[str]) -> list[Replacement]:
    if not isinstance(node, (ast.BinOp, ast.AugAssign)):
        return []
    return [_with(node, op=replacement()) for replacement in _WRONG_OPERATORS.get(type(node.op), ())]


def _returned(node: ast.AST, variables: list[str]) -> list[Replacement]:
    if not isinstance(node, ast.Return) or node.value is None:
        return []
    value = node.value
    values: list[ast.expr] = []
    if isinstance(value, ast.Constant) and isinstance(value.value, bool):
        values = [ast.Constant(not value.value)]
    elif isinstance(value, ast.Constant) and isinstance(value.value, str) and value.value:
        values = [ast.Constant("")]
    elif isinstance(value, ast.Name):
        values = [ast.Name(name, ast.Load()) for name in variables if name != value.id]
    elif isinstance(value, ast.BinOp):
        values = [copy.deepcopy(value.left), copy.deepcopy(value.right)]
    return [ast.Return(replacement) for replacement in values]


def _statement(node: ast.AST, variables: list[str]) -> list[Replacement]:
    out: list[Replacement] = []
    for block in _blocks(node):
        statements = getattr(node, block)
        if len(statements) < 2:
            continue
        for position, statement in enumerate(statements):
            droppable = isinstance(statement, (ast.AugAssign, ast.Assign)) or (
                isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call)
            )
            if droppable:
                out.append(_spliced(node, block, position, []))
    return out


#: Every mutation, in the order of the module's table.
MUTATIONS: tuple[Mutation, ...] = (
    Mutation("off_by_one_constant", "an integer literal c becomes c + 1 or c - 1", _int_constant),
    Mutation("off_by_one_range", "a range() start or stop moves by one", _range_bound),
    Mutation("off_by_one_index", "an index or a slice bound moves by one", _index),
    Mutation("flip_comparison", "a comparison is negated (< and >=, == and !=, in and not in, ...)", _comparison(_NEGATED)),
    Mutation("relax_comparison", "a strict comparison becomes non-strict or back (< and <=, > and >=)",
             _comparison(_RELAXED)),
    Mutation("reverse_comparison", "a comparison points the other way (< and >, <= and >=)", _comparison(_REVERSED)),
    Mutation("drop_branch", "a guard clause is removed, an if is replaced by its else, or a conditional "
             "expression by one of its values", _branch),
    Mutation("drop_condition", "one operand of an and / or is dropped", _condition_operand),
    Mutation("swap_and_or", "and becomes or, or back", _and_or),
    Mutation("negate_condition", "an if / while / conditional test that is not a comparison is negated", _negate),
    Mutation("swap_arguments", "two adjacent arguments of a call or parameters of the function change places", _arguments),
    Mutation("swap_operands", "the operands of a non-commutative operator change places", _operands),
    Mutation("wrong_operator", "an arithmetic operator is replaced by a related one", _operator),
    Mutation("wrong_return", "a returned value is replaced by another variable, the other bool, '' or an operand",
             _returned),
    Mutation("drop_statement", "a call, assignment or augmented assignment is removed from a block", _statement),
)

_BY_NAME = {mutation.name: mutation for mutation in MUTATIONS}


def variables_of(tree: ast.AST) -> list[str]:
    """The parameter and variable names of the program, in order of first appearance."""
    names: list[str] = []
    for node in ast.walk(tree):
        name = node.arg if isinstance(node, ast.arg) else node.id if isinstance(node, ast.Name) else None
        stored = isinstance(node, ast.arg) or (isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store))
        if stored and name not in names:
            names.append(name)
    return names


def mutation_sites(tree: ast.Module) -> list[Site]:
    """Every place of ``tree`` where a mutation of :data:`MUTATIONS` applies, with each of its alternatives."""
    variables = variables_of(tree)
    sites = []
    for index, node in enumerate(ast.walk(tree)):
        for mutation in MUTATIONS:
            for alternative in range(len(mutation.alternatives(node, variables))):
                sites.append(Site(mutation.name, index, alternative))
    return sites


def _replace(tree: ast.AST, old: ast.AST, new: Replacement) -> None:
    """Put ``new`` where ``old`` is in ``tree`` (a list of statements is spliced into the block)."""
    for parent in ast.walk(tree):
        for name, value in ast.iter_fields(parent):
            if value is old:
                setattr(parent, name, new)
                return
            if isinstance(value, list):
                for position, item in enumerate(value):
                    if item is old:
                        value[position : position + 1] = new if isinstance(new, list) else [new]
                        return
    raise ValueError("the node to replace is not in the tree")


def apply_site(tree: ast.Module, site: Site) -> ast.Module:
    """Return a mutated copy of ``tree`` (``tree`` itself is unchanged)."""
    mutant = copy.deepcopy(tree)
    node = list(ast.walk(mutant))[site.node]
    replacement = _BY_NAME[site.mutation].alternatives(node, variables_of(mutant))[site.alternative]
    if node is mutant:  # a block of the module itself
        assert isinstance(replacement, ast.Module)
        return ast.fix_missing_locations(replacement)
    _replace(mutant, node, replacement)
    return ast.fix_missing_locations(mutant)


def normalise_source(source: str) -> str:
    """Return ``source`` as :func:`ast.unparse` prints it (the layout every program of the dataset has)."""
    return ast.unparse(ast.parse(source)) + "\n"


def draw_mutants(source: str, rng: np.random.Generator, count: int) -> list[tuple[str, str]]:
    """Draw up to ``count`` different mutants of ``source``, each by one mutation.

    The mutation is drawn uniformly among those that apply somewhere, then
    its place uniformly among its sites, so frequent constructs do not crowd
    out the rest; a mutant equal to ``source`` or to an earlier one, or that
    does not compile, is skipped. Fewer than ``count`` come back when the
    program has fewer different mutants.

    Returns
    -------
    list of (str, str)
        ``(mutation name, mutant source)`` pairs, sources in
        :func:`normalise_source` layout.
    """
    tree = ast.parse(source)
    by_mutation: dict[str, list[Site]] = {}
    for site in mutation_sites(tree):
        by_mutation.setdefault(site.mutation, []).append(site)
    seen = {normalise_source(source)}
    mutants: list[tuple[str, str]] = []
    while len(mutants) < count and by_mutation:
        names = sorted(by_mutation)
        name = names[int(rng.integers(len(names)))]
        sites = by_mutation[name]
        site = sites.pop(int(rng.integers(len(sites))))
        if not sites:
            del by_mutation[name]
        try:
            text = ast.unparse(apply_site(tree, site)) + "\n"
            compile(text, "<mutant>", "exec")
        except (SyntaxError, ValueError):
            continue
        if text not in seen:
            seen.add(text)
            mutants.append((name, text))
    return mutants


#: Names that :func:`rewrite` gives local variables.
NAME_POOL = (
    "acc", "answer", "buf", "cur", "elem", "idx", "item", "k2", "left", "n_seen", "out2", "part", "pos", "prev",
    "res", "right", "step", "tally", "tmp", "token", "u", "v", "val", "w2",
)


class _Renamer(ast.NodeTransformer):
    """Rename the variables of a mapping wherever they are read or written."""

    def __init__(self, mapping: dict[str, str]) -> None:
        self.mapping = mapping

    def visit_Name(self, node: ast.Name) -> ast.Name:
        return ast.Name(self.mapping.get(node.id, node.id), node.ctx)


def rewrite(source: str, rng: np.random.Generator) -> str:
    """Return ``source`` with a random surface that keeps its meaning, in :func:`normalise_source` layout.

    Each local variable (not a parameter) is renamed with probability 1/2
    to an unused name of :data:`NAME_POOL`; each single comparison ``a < b``
    (``>``, ``<=``, ``>=``, ``==``, ``!=``) is written ``b > a`` with
    probability 1/2; each ``x op= y`` of a plain name is written
    ``x = x op y`` with probability 1/2. (A mirrored comparison evaluates
    its operands in the other order, which matters only for operands with
    side effects; labels come from the tests anyway.)
    """
    tree = ast.parse(source)
    parameters = {node.arg for node in ast.walk(tree) if isinstance(node, ast.arg)}
    functions = {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)} | parameters | functions
    free = [name for name in NAME_POOL if name not in used]
    mapping: dict[str, str] = {}
    for name in variables_of(tree):
        if name in parameters or name in functions or name == "_" or not free or rng.random() >= 0.5:
            continue
        mapping[name] = free.pop(int(rng.integers(len(free))))
    tree = _Renamer(mapping).visit(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _MIRRORED:
            if rng.random() < 0.5:
                node.left, node.comparators = node.comparators[0], [node.left]
                node.ops = [_MIRRORED[type(node.ops[0])]()]
    for node in ast.walk(tree):
        for block in _blocks(node):
            statements = getattr(node, block)
            for position, statement in enumerate(statements):
                if isinstance(statement, ast.AugAssign) and isinstance(statement.target, ast.Name):
                    if rng.random() < 0.5:
                        target = statement.target.id
                        value = ast.BinOp(ast.Name(target, ast.Load()), statement.op, statement.value)
                        statements[position] = ast.Assign([ast.Name(target, ast.Store())], value)
    return ast.unparse(ast.fix_missing_locations(tree)) + "\n"
