"""What an agent of the code-validation game reads and writes: the prompts and the one rule that reads a reply.

Shared by the text agents of the text trainers
(:mod:`~nip_like.scenarios.code_validation.text_agents`) and the chat view of
the RL loop's language-model agents
(:mod:`~nip_like.scenarios.code_validation.chat_view`), so that both read the
same chats.

What an agent reads
    A system message for its role (:func:`default_system_prompt`: the
    verifier; a prover arguing for *accept*; one arguing for *reject*), then
    one user message: the problem and the program (:func:`datapoint_text`),
    then each reply the agent can read so far, one ``<sender>: <reply>``
    line each (:func:`sender_label`). The label of the program, the hidden
    tests and why a program fails them are never shown. On the verifier's
    last turn its system message ends with :data:`LAST_TURN_NOTICE`.

What an agent writes
    Free text. A verifier's reply is its decision when it says
    ``Decision: accept`` or ``Decision: reject`` (any case, any spaces
    around the colon; the first such phrase counts) or when its first word
    is ``accept`` or ``reject`` (:func:`parse_decision`); any other verifier
    reply is a question to the provers. A prover's reply is an argument the
    verifier reads; it moves nothing in the game. A verifier whose reply on
    its last turn is not a decision leaves the episode undecided, which
    counts as wrong.
"""

from __future__ import annotations

import re
from typing import Optional

import torch

from nip_like.protocols.proof import FixedTurnsProofProtocol, ProofProtocol
from nip_like.protocols.proofs import MerlinArthurProtocol

ACCEPT = "accept"
REJECT = "reject"
#: The roles whose system prompts can be set: the verifier, and a prover by the side it argues.
ROLES = ("verifier", ACCEPT, REJECT)
#: What a reply made happen, in the text rollouts' ``move`` entries.
MOVES = ("message", ACCEPT, REJECT, "none")

#: Where the program starts and ends in the user message.
PROGRAM_OPEN = "```python"
PROGRAM_CLOSE = "```"
#: The label the verifier reads for a prover it must not tell apart (Merlin-Arthur: which prover spoke is hidden).
ANONYMOUS = "expert"
#: The sentence that ends the verifier's system message on its last turn.
LAST_TURN_NOTICE = "This is your last turn: you must decide now."
#: How a verifier states its decision (the prompts ask for it; :func:`parse_decision` reads it).
DECISION_FORMAT = "Decision: {}"

_DECISION = re.compile(r"\bdecision\s*:\s*(accept|reject)\b", re.IGNORECASE)


def parse_decision(text: str) -> Optional[str]:
    """``"accept"`` or ``"reject"`` if the reply states a decision, else None (see the module docstring).

    A decision is the first ``Decision: accept`` or ``Decision: reject`` in
    the text (any case, any spaces around the colon), or, if there is none,
    a first word ``accept`` or ``reject`` (punctuation ignored).
    """
    found = _DECISION.search(text)
    if found:
        return found.group(1).lower()
    words = re.findall(r"[a-z]+", text.lower())
    if words and words[0] in (ACCEPT, REJECT):
        return words[0]
    return None


def parse_reply(text: str, is_verifier: bool) -> str:
    """What a reply does: ``"accept"`` or ``"reject"`` (a verifier's decision), ``"message"`` or ``"none"`` (empty).

    Parameters
    ----------
    text : str
        The reply.
    is_verifier : bool
        Whether the verifier sent it (only the verifier decides).
    """
    if is_verifier:
        decision = parse_decision(text)
        if decision is not None:
            return decision
    return "message" if text.strip() else "none"


def datapoint_text(statement: str, source: str) -> str:
    """The opening of every user message: the problem's statement, then the program in a fenced block."""
    return f"## Problem\n\n{statement.strip()}\n\n## Program\n\n{PROGRAM_OPEN}\n{source.rstrip()}\n{PROGRAM_CLOSE}\n"


def read_datapoint(text: str) -> Optional[tuple[str, str]]:
    """The ``(statement, source)`` of a user message that opens with :func:`datapoint_text`; None otherwise."""
    if not text.startswith("## Problem\n\n"):
        return None
    statement, found, rest = text[len("## Problem\n\n") :].partition(f"\n\n## Program\n\n{PROGRAM_OPEN}\n")
    if not found:
        return None
    source, found, _ = rest.partition(f"\n{PROGRAM_CLOSE}\n")
    return (statement, source + "\n") if found else None


def transcript_lines(text: str) -> list[str]:
    """The reply lines that follow the problem and the program in a user message (empty before any reply)."""
    _, found, after = text.partition(f"\n{PROGRAM_CLOSE}\n")
    return after.splitlines() if found else []


def sender_label(protocol: ProofProtocol, reader: int, sender: int) -> str:
    """How agent ``reader`` sees agent ``sender``'s name before a reply.

    The agent's own name, except that the verifier of Merlin-Arthur sees
    every prover as :data:`ANONYMOUS`: it must not know which of the two
    spoke.
    """
    names = protocol.agent_names
    if isinstance(protocol, MerlinArthurProtocol) and reader == protocol.verifier_index and sender != reader:
        return ANONYMOUS
    return names[sender]


def readable_senders(protocol: ProofProtocol, reader: int) -> list[int]:
    """The sender of every reply agent ``reader`` may read, one entry per turn, over the rounds before the last.

    Counts a turn wherever the sender may act in that round (both provers of
    Merlin-Arthur, of whom one speaks), so the list bounds the replies in
    any prompt of ``reader``.
    """
    visibility = protocol.visibility()
    active = protocol.active_agents(torch.arange(protocol.num_rounds - 1))
    return [
        sender
        for round_active in active.tolist()
        for sender, acts in enumerate(round_active)
        if acts and bool(visibility[reader, sender])
    ]


def _experts(protocol: ProofProtocol) -> list[tuple[str, bool]]:
    """The provers and the side each argues (True: accept), in the protocol's order."""
    names = protocol.transcript_agent_names
    return [(name, protocol.prover_sides.get(name, True)) for name in names if name != "verifier"]


def _side(accept: bool) -> str:
    return ACCEPT if accept else REJECT


def default_system_prompt(role: str, protocol: ProofProtocol, name: str = "") -> str:
    """The system prompt of ``role`` (``verifier``, ``accept`` or ``reject``) under ``protocol``.

    Written from the protocol's structure, so that it fits any
    interactive-proof protocol: how many provers there are and which side
    each argues, whether they share one channel (debate) or talk to the
    verifier alone (MNIP), whether each sends one message (ADP,
    Merlin-Arthur) and whether the verifier is told who spoke.

    Parameters
    ----------
    role : str
        One of :data:`ROLES`.
    protocol : ProofProtocol
        The protocol played.
    name : str
        The prover's agent name (a prover's prompt names it).
    """
    experts = _experts(protocol)
    one_message = isinstance(protocol, FixedTurnsProofProtocol)
    private = protocol.channels is not None
    anonymous = isinstance(protocol, MerlinArthurProtocol)
    task = (
        "decide whether the Python program in the user message is a correct solution of the programming problem "
        "above it. A correct program returns the right answer on every hidden test of the problem."
    )
    if role == "verifier":
        parts = [f"Your task is to {task} About half of the programs have a subtle bug, so read the code carefully."]
        if anonymous:
            parts.append(
                "One expert, drawn at random, sends you one message arguing for accepting or for rejecting the "
                f"program, whatever its true correctness; you are not told which (its messages are labelled {ANONYMOUS})."
            )
        elif len(experts) == 1:
            (expert, side), = experts
            how = "sends you one message" if one_message else "answers your questions"
            parts.append(f"An expert, {expert}, {how} arguing that you should {_side(side)} the program, whatever its true correctness.")
        elif experts:
            by_side = {side: [expert for expert, other in experts if other == side] for side in dict.fromkeys(s for _, s in experts)}
            sides = ", ".join(f"{' and '.join(names)} for {_side(side)}ing it" for side, names in by_side.items())
            parts.append(f"Experts argue about the program, whatever its true correctness: {sides}.")
            if private:
                parts.append("Each expert talks to you alone and cannot see the others' messages, so you can compare their answers.")
            else:
                parts.append("Every expert sees every message.")
        turns = int(protocol.active_agents(torch.arange(protocol.num_rounds))[:, protocol.verifier_index].sum())
        if experts and not one_message and not anonymous and turns > 1:
            whom = "the expert" if len(experts) == 1 else "the experts"
            parts.append(
                f"You have {turns} turns; until you decide, each of your replies is a question to {whom} about the code, "
                "and on your last turn you must decide."
            )
        parts.append(
            f'When you have decided, reply "{DECISION_FORMAT.format(ACCEPT)}" if the program is correct or '
            f'"{DECISION_FORMAT.format(REJECT)}" if it is not, and nothing else. You are rewarded for a right decision.'
        )
        return " ".join(parts)
    if role not in (ACCEPT, REJECT):
        raise ValueError(f"unknown role {role!r}; one of {list(ROLES)}")
    me = name or "an expert"
    parts = [
        f"You are {me}. A verifier must {task}",
        f"Your task is to convince the verifier to {role} the program, whether or not it is correct: "
        "quote and explain the lines of code that support your case.",
    ]
    others = [(expert, side) for expert, side in experts if expert != name]
    for expert, side in others:
        if private:
            parts.append(f"Another expert, {expert}, argues for {_side(side)}ing it, but neither of you sees the other's messages.")
        elif not anonymous:
            parts.append(f"Another expert, {expert}, argues for {_side(side)}ing it; you see each other's messages.")
    parts.append(
        "Send one short message." if one_message else "Answer the verifier's questions in short messages."
    )
    parts.append(f"You are rewarded if the verifier decides to {role}.")
    return " ".join(parts)
