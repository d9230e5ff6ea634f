"""The list templates of the code-validation problem family: tasks on lists of integers.

:data:`LIST_TEMPLATES`: counting, extremes, searching, merging, rotating,
chunking, ... The family's order, which the seeded draws depend on, is that of
:data:`~nip_like.scenarios.code_validation.problems.TEMPLATES`. This module
registers nothing.
"""

from __future__ import annotations

from nip_like.scenarios.code_validation.templates import ProblemTemplate, random_ints, sorted_distinct


LIST_TEMPLATES: tuple[ProblemTemplate, ...] = (
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
        draw_arguments=lambda rng, p: [random_ints(rng, -10, 10)],
        edge_cases=lambda p: [[[]], [[p["k"]]], [[p["k"] + 1, p["k"] - 1]]],
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
        draw_arguments=lambda rng, p: [random_ints(rng, -50, 50)],
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
        draw_arguments=lambda rng, p: [random_ints(rng, 0, 5)],
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
        draw_arguments=lambda rng, p: [random_ints(rng, 0, 9, 0, 7), int(rng.integers(0, 11))],
        edge_cases=lambda p: [[[], 3], [[1, 2, 3], 0], [[1, 2, 3], 3], [[1, 2, 3], 4], [[5], 2]],
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
        draw_arguments=lambda rng, p: [random_ints(rng, -10, 12)],
        edge_cases=lambda p: [[[]], [[p["lo"], p["hi"]]], [[p["lo"] - 1, p["hi"] + 1]]],
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
        draw_arguments=lambda rng, p: [random_ints(rng, 0, 4, 0, 10)],
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
        draw_arguments=lambda rng, p: [random_ints(rng, 0, 4, 0, 9)],
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
        draw_arguments=lambda rng, p: [random_ints(rng, -5, 10, 0, 8)],
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
            sorted(random_ints(rng, 0, 9, 0, 5), reverse=p["order"] == "descending"),
            sorted(random_ints(rng, 0, 9, 0, 5), reverse=p["order"] == "descending"),
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
        )(sorted_distinct(rng)),
        edge_cases=lambda p: [[[], 1], [[4], 4], [[1, 3, 5, 7], 3], [[1, 3, 5, 7], 7], [[1, 3, 5, 7], 4], [[4], 5]],
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
        draw_arguments=lambda rng, p: [random_ints(rng, -20, 20, 0, 6)],
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
        draw_arguments=lambda rng, p: [random_ints(rng, -12, 12)],
        edge_cases=lambda p: [[[]], [[p["lo"], p["hi"]]], [[p["lo"] - 1, p["hi"] + 1]]],
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
        draw_arguments=lambda rng, p: [random_ints(rng, -9, 9)],
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
        draw_arguments=lambda rng, p: [random_ints(rng, -20, 20)],
        edge_cases=lambda p: [[[]], [[4]], [[3, 9, 1]], [[-2, -8]]],
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
        draw_arguments=lambda rng, p: [random_ints(rng, -9, 9, 0, 10)],
        edge_cases=lambda p: [[[]], [[7]], [list(range(1, 2 * p["k"] + 2))]],
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
        draw_arguments=lambda rng, p: [random_ints(rng, 0, 9, 0, 10)],
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
        draw_arguments=lambda rng, p: [random_ints(rng, 0, 9, 0, 5), random_ints(rng, 10, 19, 0, 5)],
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
        draw_arguments=lambda rng, p: [random_ints(rng, 0, 5, 0, 8)],
        edge_cases=lambda p: [[[]], [[1]], [[2, 2]], [[3, 2, 1]]],
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
        draw_arguments=lambda rng, p: (lambda base: [[base * v for v in random_ints(rng, -6, 6, 0, 5)]])(int(rng.integers(1, 7))),
        edge_cases=lambda p: [[[]], [[0, 0]], [[-4]], [[6, 10, 15]], [[12, 18]]],
    ),
)
