"""What an agent of the chat view reads and writes: the text rules and each agent's prompt rendering.

The rules (shared by the chat view of language-model agents,
:mod:`nip_like.scenarios.duplicates.chat_view`, and the text agents,
:mod:`nip_like.scenarios.duplicates.chat`): the ``list:`` line
(:func:`list_line`, :func:`read_list_line`), the system prompts by role
(:data:`SYSTEM_PROMPTS`), and the one rule that turns a reply into a move
(:func:`parse_reply`). :class:`~nip_like.scenarios.chat_prompts.ChatSpeaker`
(shared by every chat view, importable from here too) renders an agent's chat
with its own tokenizer's chat template, splicing quoted replies in as tokens.
"""

from __future__ import annotations

import re
from typing import Optional, Sequence

from nip_like.scenarios.duplicates.environment import ACCEPT, REJECT

#: What a hidden cell shows in the ``list:`` line.
HIDDEN_TEXT = "?"
#: System prompts by role: the verifier, a prover arguing that a pair exists, one arguing that none does.
SYSTEM_PROMPTS = {
    "verifier": "Does the list hold two equal values? Answer accept or reject.",
    "accept": "Name two cells of the list that hold equal values: i j",
    "reject": "Name two cells of the list: i j",
}


def parse_cells(text: str, length: int) -> Optional[tuple[int, int]]:
    """The first two whole numbers of ``text`` if they are different cells in ``0 .. length-1``."""
    numbers = [int(number) for number in re.findall(r"\d+", text)[:2]]
    if len(numbers) == 2 and numbers[0] != numbers[1] and all(number < length for number in numbers):
        return numbers[0], numbers[1]
    return None


def parse_decision(text: str) -> Optional[str]:
    """``"accept"`` or ``"reject"`` if that is the reply's first word (any case, punctuation ignored)."""
    words = re.findall(r"[a-z]+", text.lower())
    if words and words[0] in (ACCEPT, REJECT):
        return words[0]
    return None


def parse_reply(text: str, is_verifier: bool, length: int) -> tuple[list[str], str]:
    """The game move a reply makes, in game symbols, and what it is in words.

    Parameters
    ----------
    text : str
        The reply.
    is_verifier : bool
        Whether the verifier sent it (only the verifier decides).
    length : int
        ``L``, cells in the list.

    Returns
    -------
    symbols : list of str
        ``["accept"]``, ``["reject"]``, ``["c<i>", "c<j>"]`` or ``[]`` (no effect).
    meaning : str
        ``"accept"``, ``"reject"``, ``"cells i j"`` or ``"none"``.
    """
    if is_verifier:
        decision = parse_decision(text)
        if decision is not None:
            return [decision], decision
    cells = parse_cells(text, length)
    if cells is not None:
        return [f"c{cells[0]}", f"c{cells[1]}"], f"cells {cells[0]} {cells[1]}"
    return [], "none"


#: How the ``list:`` line writes the list: every cell's value (``?`` where hidden), the same with
#: each cell's index (``2=7``), or only the cells the reader has seen, with their indices.
LIST_FORMATS = ("plain", "indexed", "seen")


def list_line(values: Sequence[int], visible: Sequence[bool], list_format: str = "plain") -> str:
    """The ``list:`` line of a prompt in ``list_format`` (one of :data:`LIST_FORMATS`).

    ``plain``: ``"list: 3 ? 7 5"``; ``indexed``: ``"list: 0=3 1=? 2=7 3=5"``;
    ``seen``: ``"list: 0=3 2=7 3=5"`` (a reader who has seen every cell gets
    the ``indexed`` line). In ``seen`` the values to compare stand side by
    side, which small models learn to read far sooner than the ``?`` of the
    other formats (docs: own_language_model).
    """
    if list_format == "seen":
        return "list: " + " ".join(f"{index}={value}" for index, (value, seen) in enumerate(zip(values, visible)) if seen)
    cells = (str(value) if seen else HIDDEN_TEXT for value, seen in zip(values, visible))
    if list_format == "indexed":
        cells = (f"{index}={cell}" for index, cell in enumerate(cells))
    return "list: " + " ".join(cells)


def read_list_line(text: str) -> list[Optional[int]]:
    """The cells of the ``list:`` line of a chat message (``None`` where hidden; any format); empty if there is none.

    In the ``seen`` format the list ends at its last seen cell.
    """
    for line in text.splitlines():
        if line.startswith("list:"):
            cells = line[len("list:") :].split()
            if cells and all("=" in cell for cell in cells):
                placed: dict[int, Optional[int]] = {}
                for cell in cells:
                    index, _, value = cell.partition("=")
                    placed[int(index)] = None if value == HIDDEN_TEXT else int(value)
                return [placed.get(index) for index in range(max(placed) + 1)]
            return [None if cell == HIDDEN_TEXT else int(cell) for cell in cells]
    return []
