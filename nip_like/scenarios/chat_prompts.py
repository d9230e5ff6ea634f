"""Chat prompts of language-model agents: an agent's chat rendered through its own template, and packed.

:class:`ChatSpeaker` is how one agent reads and writes in a chat view: its
tokenizer's ``apply_chat_template`` over a system message for its role and one
user message (an opening text, then each reply it can read as a
``sender: reply`` line), the quoted replies spliced in as tokens. The
helpers pack token rows into padded tensors (:func:`packed_rows`), read
tensors as Python lists fast (:func:`as_lists`) and pause the cyclic garbage
collector while many small lists are built (:func:`cyclic_gc_paused`). The
chat views of the duplicates game
(:mod:`~nip_like.scenarios.duplicates.chat_view`) and of the code-validation
task (:mod:`~nip_like.scenarios.code_validation.chat_view`) use them. This
module registers nothing.
"""

from __future__ import annotations

import gc
import itertools
import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Iterator, Optional, Sequence

import numpy as np
import torch

from nip_like.errors import ConfigError

if TYPE_CHECKING:  # transformers loads on first use: runs without language models never import it
    from transformers import PreTrainedTokenizerBase

#: A quoted reply's place in the rendered chat text, replaced by its tokens (a private-use character
#: around its index, which no tokenizer merges with the text beside it).
_QUOTE = "\ue000{}\ue000"
_QUOTE_PATTERN = re.compile("\ue000(\\d+)\ue000")
#: Texts whose token ids a :class:`ChatSpeaker` keeps.
ENCODED_CACHE = 200_000
#: Where the ``list:`` line goes in a chat rendered once per layout (another private-use character).
_LIST_PLACEHOLDER = "\ue001"


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
            The text that opens the user message (the duplicates game's ``list:`` line, the
            code-validation task's problem and program).
        quotes : sequence of (str, sequence of int)
            Each readable reply's sender and its tokens, in the order sent.
        """
        return self.render_many([list_text], [quotes])[0]

    def render_many(
        self, list_texts: Sequence[str], quotes: Sequence[Sequence[tuple[str, Sequence[int]]]]
    ) -> list[list[int]]:
        """:meth:`render` for many prompts at once: the same ids, with one tokenizer call for all.

        The chat template is applied once per layout (the senders of the
        quoted replies) around a placeholder for the opening text (the
        ``list:`` line), which is then substituted; the first prompt of each layout is checked against
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

    def reply_rows(self, texts: Sequence[str], limit: int) -> list[list[int]]:
        """Each text as this speaker writes it as a reply: its tokens, then the eos token, cut to ``limit`` tokens.

        What a scripted player's replies become in the chat view (the
        tokens a warm start's demonstrations teach and the environment plays).
        """
        encoded = self.encode(texts)
        return [[*encoded[text], self.eos_id][:limit] for text in texts]

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


def scripted_reply_tensors(
    speakers: Sequence["ChatSpeaker"], texts: Sequence[Sequence[str | None]], limits: Sequence[int], width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, N, width)`` ids and mask of scripted replies, as the agents would send them.

    ``texts[agent][episode]`` is written by ``speakers[agent]``
    (:meth:`ChatSpeaker.reply_rows`: its tokens, then eos, cut to
    ``limits[agent]``) and right-padded with its pad token; ``None`` is no
    reply (pad only). The chat views' ``scripted_replies`` both build on it.
    """
    replies, masks = [], []
    with cyclic_gc_paused():
        for speaker, column, limit in zip(speakers, texts, limits):
            given = [row for row, text in enumerate(column) if text is not None]
            rows: list[list[int]] = [[] for _ in column]
            for row, ids in zip(given, speaker.reply_rows([column[row] for row in given], int(limit))):
                rows[row] = ids
            ids, mask = packed_rows(rows, width, speaker.pad_id, left=False)
            replies.append(ids)
            masks.append(mask)
    return torch.stack(replies, 1), torch.stack(masks, 1)


def packed_rows(rows: Sequence[Sequence[int]], width: int, pad: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(len(rows), width)`` ids and mask of token rows padded with ``pad`` on the left or the right (one copy, no loop).

    A row longer than ``width`` raises ``ValueError``.
    """
    lengths = np.fromiter((len(row) for row in rows), dtype=np.int64, count=len(rows))
    if lengths.size and int(lengths.max()) > width:
        raise ValueError(f"a row of {int(lengths.max())} tokens does not fit in {width}")
    ids = np.full((len(rows), width), pad, dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=bool)
    flat = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=int(lengths.sum()))
    row_index = np.repeat(np.arange(len(rows)), lengths)
    position = np.arange(flat.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    column = position + np.repeat(width - lengths, lengths) if left else position
    ids[row_index, column], mask[row_index, column] = flat, True
    return torch.from_numpy(ids), torch.from_numpy(mask)


@contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while many small lists are built (they make no cycles).

    With the large heap of a process that holds torch and transformers, every
    collection the allocations trigger walks that heap: building the prompts
    of a few thousand episodes spent most of its time there.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def as_lists(tensor: torch.Tensor) -> list:
    """``tensor.tolist()`` by way of numpy: the same nested lists, many times faster for a large int tensor."""
    return tensor.detach().cpu().numpy().tolist()


def reply_lengths(action: torch.Tensor, speakers: Sequence[ChatSpeaker]) -> torch.Tensor:
    """``(B, N)``: tokens of each agent's reply ``(B, N, T)`` before its first eos or pad token (of its sender's tokenizer)."""
    lengths = []
    for agent, speaker in enumerate(speakers):
        tokens = action[:, agent]
        ends = (tokens == speaker.eos_id) | (tokens == speaker.pad_id)
        first_end = torch.where(ends.any(-1), ends.long().argmax(-1), torch.full_like(ends[:, 0], tokens.shape[-1], dtype=torch.long))
        lengths.append(first_end)
    return torch.stack(lengths, dim=-1)


def reply_texts(action: torch.Tensor, active: torch.Tensor, speakers: Sequence[ChatSpeaker]) -> dict[tuple[int, int], str]:
    """The text of each reply of ``action`` ``(B, N, T)`` where ``active`` ``(B, N)``, by ``(episode, agent)``.

    A reply's text is its tokens before the first eos or pad token
    (:func:`reply_lengths`), decoded by its sender's tokenizer without
    special tokens.
    """
    lengths, tokens = as_lists(reply_lengths(action, speakers)), as_lists(action)
    texts = {}
    for agent, speaker in enumerate(speakers):
        rows = active[:, agent].nonzero().squeeze(-1).tolist()
        if not rows:
            continue
        replies = [tokens[row][agent][: lengths[row][agent]] for row in rows]
        for row, text in zip(rows, speaker.tokenizer.batch_decode(replies, skip_special_tokens=True)):
            texts[(row, agent)] = text
    return texts
