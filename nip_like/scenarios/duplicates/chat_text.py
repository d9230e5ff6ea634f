"""What an agent of the chat view reads and writes: the text rules and each agent's prompt rendering.

The rules (shared by the chat view of language-model agents,
:mod:`nip_like.scenarios.duplicates.chat_view`, and the text agents,
:mod:`nip_like.scenarios.duplicates.chat`): the ``list:`` line
(:func:`list_line`, :func:`read_list_line`), the system prompts by role
(:data:`SYSTEM_PROMPTS`), and the one rule that turns a reply into a move
(:func:`parse_reply`). :class:`ChatSpeaker` renders an agent's chat with its
own tokenizer's chat template, splicing quoted replies in as tokens.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from transformers import PreTrainedTokenizerBase

from nip_like.errors import ConfigError
from nip_like.scenarios.duplicates.environment import ACCEPT, REJECT

#: What a hidden cell shows in the ``list:`` line.
HIDDEN_TEXT = "?"
#: System prompts by role: the verifier, a prover arguing that a pair exists, one arguing that none does.
SYSTEM_PROMPTS = {
    "verifier": "Does the list hold two equal values? Answer accept or reject.",
    "accept": "Name two cells of the list that hold equal values: i j",
    "reject": "Name two cells of the list: i j",
}

#: A quoted reply's place in the rendered chat text, replaced by its tokens (a private-use character
#: around its index, which no tokenizer merges with the text beside it).
_QUOTE = "\ue000{}\ue000"
_QUOTE_PATTERN = re.compile("\ue000(\\d+)\ue000")
#: Texts whose token ids a :class:`ChatSpeaker` keeps.
ENCODED_CACHE = 200_000
#: Where the ``list:`` line goes in a chat rendered once per layout (another private-use character).
_LIST_PLACEHOLDER = "\ue001"


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



@dataclass
class ChatSpeaker:
    """How one agent reads and writes in the chat view.

    Attributes
    ----------
    name : str
        The agent's name, which labels its quoted replies.
    tokenizer : PreTrainedTokenizerBase
        Its model's tokenizer, with a chat template.
    system_prompt : str
        The system message of its role.
    """

    name: str
    tokenizer: PreTrainedTokenizerBase
    system_prompt: str

    def __post_init__(self) -> None:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError(f"agent {self.name}: its tokenizer has no chat_template, which the chat view needs")
        if self.tokenizer.eos_token_id is None:
            raise ConfigError(f"agent {self.name}: its tokenizer has no eos token to end a reply")
        self.eos_id = int(self.tokenizer.eos_token_id)
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else self.eos_id
        self._encoded: dict[str, list[int]] = {}  # ids of recent texts (see encode)
        self._same_vocabulary: dict[str, bool] = {}  # by sender name (see reads_as_own)
        self._layouts: dict[tuple[str, ...], Optional[str]] = {}  # chat text around the list line per layout, None: render directly

    def render(self, list_text: str, quotes: Sequence[tuple[str, Sequence[int]]]) -> list[int]:
        """The prompt's token ids: the chat template over the system and user messages.

        Parameters
        ----------
        list_text : str
            The ``list:`` line.
        quotes : sequence of (str, sequence of int)
            Each readable reply's sender and its tokens, in the order sent.
        """
        return self.render_many([list_text], [quotes])[0]

    def render_many(
        self, list_texts: Sequence[str], quotes: Sequence[Sequence[tuple[str, Sequence[int]]]]
    ) -> list[list[int]]:
        """:meth:`render` for many prompts at once: the same ids, with one tokenizer call for all.

        The chat template is applied once per layout (the senders of the
        quoted replies) around a placeholder for the ``list:`` line, which is
        then substituted; the first prompt of each layout is checked against
        the template applied to it directly, and a template for which the two
        differ (one that rewrites message contents) is applied to every
        prompt.
        """
        texts = []
        for list_text, quoted in zip(list_texts, quotes):
            layout = tuple(sender for sender, _ in quoted)
            if layout not in self._layouts:
                around = self._template_text(_LIST_PLACEHOLDER, layout)
                direct = self._template_text(list_text, layout)
                self._layouts[layout] = around if around.replace(_LIST_PLACEHOLDER, list_text) == direct else None
            text = self._layouts[layout]
            texts.append(self._template_text(list_text, layout) if text is None else text.replace(_LIST_PLACEHOLDER, list_text))
        pieces = [_QUOTE_PATTERN.split(text) for text in texts]  # text, index, text, index, ..., text
        encoded = self.encode(part for split in pieces for part in split[0::2])
        prompts = []
        for split, quoted in zip(pieces, quotes):
            ids = list(encoded[split[0]])
            for position, index in enumerate(split[1::2]):
                ids += list(quoted[int(index)][1]) + encoded[split[2 * position + 2]]
            prompts.append(ids)
        return prompts

    def encode(self, texts: Iterable[str]) -> dict[str, list[int]]:
        """Each text's token ids without special tokens, by text.

        Texts not seen lately go to the tokenizer in one batch (a fast
        tokenizer's Rust backend); the ids of up to :data:`ENCODED_CACHE`
        texts are kept, since the same list lines and replies come back turn
        after turn.
        """
        texts = list(dict.fromkeys(texts))
        new = [text for text in texts if text not in self._encoded]
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if not new:
            fresh = {}
        elif backend is not None:
            fresh = {text: encoding.ids for text, encoding in zip(new, backend.encode_batch(new, add_special_tokens=False))}
        else:
            fresh = dict(zip(new, self.tokenizer(new, add_special_tokens=False)["input_ids"]))
        encoded = {text: fresh[text] if text in fresh else self._encoded[text] for text in texts}
        if len(self._encoded) + len(fresh) > ENCODED_CACHE:
            self._encoded.clear()
        if len(fresh) <= ENCODED_CACHE:
            self._encoded.update(fresh)
        return encoded

    def reads_as_own(self, sender: "ChatSpeaker") -> bool:
        """Whether ``sender``'s token ids mean the same to this speaker (one vocabulary): then quotes are spliced as they are."""
        if sender.name not in self._same_vocabulary:
            self._same_vocabulary[sender.name] = sender.tokenizer is self.tokenizer or (
                sender.tokenizer.get_vocab() == self.tokenizer.get_vocab()
            )
        return self._same_vocabulary[sender.name]

    def quote(self, sender: "ChatSpeaker", replies: Sequence[Sequence[int]], limit: int) -> list[list[int]]:
        """``sender``'s replies as this speaker reads them, each at most ``limit`` tokens.

        In one vocabulary the sampled tokens are spliced as they are (their
        first ``limit``); otherwise each reply's text (decoded by the
        sender's tokenizer, without special tokens) is encoded by this
        speaker's tokenizer and cut to ``limit`` tokens, so the prompt width
        bound holds either way.
        """
        if self.reads_as_own(sender):
            return [list(reply[:limit]) for reply in replies]
        texts = sender.tokenizer.batch_decode([list(reply[:limit]) for reply in replies], skip_special_tokens=True)
        encoded = self.encode(texts)
        return [encoded[text][:limit] for text in texts]

    def _template_text(self, list_text: str, senders: Sequence[str]) -> str:
        lines = [list_text, *(f"{sender}: {_QUOTE.format(index)}" for index, sender in enumerate(senders))]
        chat = [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": "\n".join(lines)}]
        return self.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
