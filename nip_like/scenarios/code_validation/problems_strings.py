"""The string templates of the code-validation problem family: tasks on text.

:data:`STRING_TEMPLATES`: letters, digits, words, palindromes, brackets, a
cipher, run lengths. The family's order, which the seeded draws depend on, is
that of :data:`~nip_like.scenarios.code_validation.problems.TEMPLATES`. This
module registers nothing.
"""

from __future__ import annotations

import numpy as np

from nip_like.scenarios.code_validation.templates import Arguments, Params, ProblemTemplate, random_text, random_words


def _palindrome_case(rng: np.random.Generator, params: Params) -> Arguments:
    """A string that is a palindrome (under the variant's rule) about half of the time."""
    half = random_text(rng, "abcAB ", 0, 5)
    middle = random_text(rng, "abc", 0, 1)
    text = half + middle + half[::-1] if rng.random() < 0.5 else random_text(rng, "abcAB ", 0, 8)
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
    return [random_text(rng, opening + closing + "x", 0, 8)]


STRING_TEMPLATES: tuple[ProblemTemplate, ...] = (
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
        draw_arguments=lambda rng, p: [random_text(rng, "abcdeistuxyz ", 0, 12)],
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
        draw_arguments=lambda rng, p: [random_words(rng)],
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
        draw_arguments=lambda rng, p: [random_text(rng, "abcxyzAZ !{`", 0, 10)],
        edge_cases=lambda p: [[""], ["z"], ["a"], ["{`"]],
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
        draw_arguments=lambda rng, p: [random_words(rng, p["sep"], 5, 5)],
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
        draw_arguments=lambda rng, p: [random_text(rng, "aab", 0, 10)],
        edge_cases=lambda p: [[""], ["a"], ["aaab"], ["abb"]],
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
        draw_arguments=lambda rng, p: [random_words(rng, p["sep"])],
        edge_cases=lambda p: [[""], ["one"], ["a" + p["sep"] + "b"]],
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
        draw_arguments=lambda rng, p: [random_text(rng, "0123456789ab ", 0, 10)],
        edge_cases=lambda p: [[""], ["0"], ["9"], ["a1b2"]],
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
        draw_arguments=lambda rng, p: [random_words(rng, " ", 6, 4)],
        edge_cases=lambda p: [[""], ["ab cd"], ["a bb c"]],
    ),
)
