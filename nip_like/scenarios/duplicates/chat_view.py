"""The duplicates game in natural-language turns: the chat view of language-model agents.

The token view (:mod:`nip_like.scenarios.duplicates.environment`) gives tiny
models a prompt over the game's own symbols. The chat view is for the models
users bring: any local chat model folder with its own tokenizer and chat
template. Lists, splits, protocols, rules and rewards are the token game's;
:class:`DuplicatesChatViewEnv` only changes what an agent reads and writes.

What an agent reads
    Its tokenizer's own ``apply_chat_template`` (with the generation prompt)
    applied to two messages: a system message for its role
    (:data:`~nip_like.scenarios.duplicates.chat_text.SYSTEM_PROMPTS`, overridable per role) and a user message with the
    list as the agent sees it and the replies it can read so far::

        list: ? ? 7 ? 7 ? ? ?
        prover: 4 2

    A quoted reply is spliced in as the tokens its sender sampled (its first
    ``quote_tokens`` of them, without the end token), not decoded and
    re-encoded, so a prompt's length is bounded before the game starts. A
    reader whose vocabulary differs from the sender's gets the reply's text
    encoded by its own tokenizer instead, cut to ``quote_tokens`` tokens.

What an agent writes
    Free text of up to ``max_new_tokens`` tokens, ended by its tokenizer's eos
    token or a configured stop string. The reply's text (the tokens before the
    first eos or pad token, decoded without special tokens) becomes the game's
    move by one rule, :func:`~nip_like.scenarios.duplicates.chat_text.parse_reply`: a verifier's reply whose first word
    is ``accept`` or ``reject`` (any case, punctuation ignored) is its
    decision; otherwise, the first two whole numbers of a reply that are
    different cells (``0 .. L-1``) name those cells (``"4 2"``, ``"cells 4 and
    2"``); anything else is a message with no effect. A verifier whose reply
    on its last turn is not a decision ends the episode undecided, which
    counts as wrong.

The same rule parses the text agents' replies
(:mod:`nip_like.scenarios.duplicates.chat`).

Keys (besides the token game's; ``T`` is the longest ``max_new_tokens``,
``P`` the prompt width, ``V`` the largest vocabulary of the agents):

========================================  ===============  ==============================================
key                                       shape            meaning
========================================  ===============  ==============================================
``("state", "replies")``                  ``B, R, N, T``   every reply's sampled tokens (sender's pad after)
``("state", "reply_length")``             ``B, R, N``      tokens of each reply before its end, ``-1`` unsent
``("state", "messages")``                 ``B, R, N, 3``   the moves the replies made, in game symbols
``("agents", "prompt_ids")``              ``B, N, P``      the rendered chat, left-padded (each agent's vocabulary)
``("agents", "prompt_mask")``             ``B, N, P``      its real tokens
``("agents", "action")``                  ``B, N, T``      each agent's reply tokens, ``< V``
========================================  ===============  ==============================================
"""

from __future__ import annotations

from typing import Sequence

import torch
from tensordict import TensorDictBase
from torchrl.data import Unbounded

from nip_like.errors import ConfigError
from nip_like.protocols.proof import ProofProtocol
from nip_like.scenarios.chat_prompts import (
    as_lists,
    cyclic_gc_paused,
    packed_rows,
    reply_lengths,
    reply_texts,
    scripted_reply_tensors,
)
from nip_like.scenarios.duplicates.data import DuplicateLists
from nip_like.scenarios.duplicates.chat_text import HIDDEN_TEXT, list_line, parse_reply
from nip_like.scenarios.chat_prompts import ChatSpeaker
from nip_like.scenarios.duplicates.environment import ACCEPT, REJECT, DuplicatesEnv

#: Width of a move in game symbols: two cells and an end symbol.
MOVE_TOKENS = 3


class DuplicatesChatViewEnv(DuplicatesEnv):
    """The duplicates game with chat prompts and free-text replies (see the module docstring).

    Parameters
    ----------
    protocol : ProofProtocol
        Turns, channels and rewards.
    lists : DuplicateLists
        The split's lists.
    game_ids : dict
        :meth:`~nip_like.scenarios.duplicates.environment.DuplicateSymbols.ids`
        of the game's symbol table, in which moves are stored.
    speakers : sequence of ChatSpeaker
        One per agent, in the order of the agent dimension.
    num_values : int
        ``V``: the list's values are ``0 .. V-1``.
    reply_tokens : int
        ``T``, the longest reply (the agents' largest ``max_new_tokens``).
    quote_tokens : int
        Tokens of a reply shown to the agents who read it.
    prompt_tokens : int
        ``P``; 0 sizes it to the longest prompt the game can produce.
    list_format : str
        How the ``list:`` line is written (:data:`LIST_FORMATS`).
    verifier_view, num_envs, device, seed, group_size
        As for :class:`~nip_like.scenarios.duplicates.environment.DuplicatesEnv`.
    """

    def __init__(
        self,
        protocol: ProofProtocol,
        lists: DuplicateLists,
        game_ids: dict[str, int],
        speakers: Sequence[ChatSpeaker],
        num_values: int,
        reply_tokens: int,
        quote_tokens: int = 32,
        prompt_tokens: int = 0,
        list_format: str = "plain",
        verifier_view: str = "cells",
        num_envs: int = 1,
        device: torch.device | str = "cpu",
        seed: int = 0,
        group_size: int = 1,
    ) -> None:
        if reply_tokens < 1:
            raise ConfigError(f"a reply needs at least one token, got max_new_tokens={reply_tokens}")
        self.chat_speakers = list(speakers)
        self.reply_tokens = int(reply_tokens)
        self.quote_tokens = int(quote_tokens)
        self.reply_vocab = max(len(speaker.tokenizer) for speaker in self.chat_speakers)
        self._num_values = int(num_values)
        self._prompt_tokens = int(prompt_tokens)
        self.list_format = str(list_format)
        # Moves are stored in game symbols (message_tokens); prompts and replies are in the agents' vocabularies.
        super().__init__(
            protocol, lists, game_ids, vocab_size=self.reply_vocab, message_tokens=MOVE_TOKENS,
            verifier_view=verifier_view, num_envs=num_envs, device=device, seed=seed, group_size=group_size,
        )

    # ---------------------------------------------------------------- sizes
    @property
    def prompt_length(self) -> int:
        """``P``: the configured width, or the longest prompt any agent can be shown."""
        if self._prompt_tokens:
            return self._prompt_tokens
        if not hasattr(self, "_longest_prompt"):
            self._longest_prompt = max(self._longest_prompt_of(agent) for agent in range(len(self.chat_speakers)))
        return self._longest_prompt

    def _longest_prompt_of(self, agent: int) -> int:
        speaker = self.chat_speakers[agent]
        # The list line at its longest: every cell shows the value (or ?) that takes the most tokens.
        cells = [HIDDEN_TEXT, *(str(value) for value in range(self._num_values))]
        widest = max(cells, key=lambda cell: len(speaker.tokenizer(" " + cell, add_special_tokens=False)["input_ids"]))
        # Every readable sender's reply in every round it can be read, each at the quoted length.
        readable = int(self.visibility[agent].sum())
        longest_name = max((other.name for other in self.chat_speakers), key=len)
        quotes = [(longest_name, [0] * self.quote_tokens)] * (readable * self.seen_rounds)
        # A margin for text that merges differently beside other values.
        longest_list = list_line([widest] * self.length, [True] * self.length, self.list_format)
        return len(speaker.render(longest_list, quotes)) + 8

    # ----------------------------------------------------------------- specs
    def _state_spec(self) -> dict[str, object]:
        b, device = self.batch_size, self.device
        rounds, agents = self.protocol.num_rounds, self.num_agents
        return {
            **super()._state_spec(),
            "replies": Unbounded(shape=(*b, rounds, agents, self.reply_tokens), dtype=torch.int64, device=device),
            "reply_length": Unbounded(shape=(*b, rounds, agents), dtype=torch.int64, device=device),
        }

    @property
    def action_tokens(self) -> int:
        """``T``: an agent's reply, in its own tokens."""
        return self.reply_tokens

    # ------------------------------------------------------------ the game
    def _new_state(self, num_episodes: int):
        state = super()._new_state(num_episodes)
        shape = (num_episodes, self.protocol.num_rounds, self.num_agents)
        state["replies"] = torch.zeros(*shape, self.reply_tokens, dtype=torch.int64, device=self.device)
        state["reply_length"] = torch.full(shape, -1, dtype=torch.int64, device=self.device)
        return state

    def reply_lengths(self, action: torch.Tensor) -> torch.Tensor:
        """``(B, N)``: tokens of each reply before its first eos or pad token (of its sender's tokenizer)."""
        return reply_lengths(action, self.chat_speakers)

    def reply_texts(self, action: torch.Tensor, active: torch.Tensor) -> dict[tuple[int, int], str]:
        """The text of each active reply, by ``(episode, agent)``."""
        return reply_texts(action, active, self.chat_speakers)

    def moves(self, texts: dict[tuple[int, int], str], batch: int) -> torch.Tensor:
        """``(batch, N, 3)`` game-symbol moves of the parsed replies (pad where a reply has no effect)."""
        move = torch.full((batch, self.num_agents, MOVE_TOKENS), self.ids["pad"], dtype=torch.int64)
        for (row, agent), text in texts.items():
            symbols, _ = parse_reply(text, agent == self.verifier_index, self.length)
            for position, symbol in enumerate(symbols):
                move[row, agent, position] = self._symbol_id(symbol)
        return move.to(self.device)

    def scripted_replies(self, moves: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Replies that make given moves: the text of each move, tokenized by its sender, then eos.

        Parameters
        ----------
        moves : torch.Tensor
            ``(B, N, M)`` moves in game symbols (cells, ``accept``, ``reject``,
            then end or pad symbols), as the token game's scripted players send them.

        Returns
        -------
        replies, reply_mask : torch.Tensor
            ``(B, N, T)`` each sender's tokens (``"4 2"``, ``"4"``, ``"4 4"``,
            ``"accept"``, or nothing before the eos token) and their mask.
        """
        words = {self.ids["accept"]: ACCEPT, self.ids["reject"]: REJECT}
        words.update({self.ids["cell0"] + cell: str(cell) for cell in range(self.length)})
        texts = [
            [" ".join(words[symbol] for symbol in row if symbol in words) for row in as_lists(moves[:, agent])]
            for agent in range(self.num_agents)
        ]
        limits = [self.reply_tokens] * self.num_agents
        replies, masks = scripted_reply_tensors(self.chat_speakers, texts, limits, self.reply_tokens)
        return replies.to(self.device), masks.to(self.device)

    def _symbol_id(self, symbol: str) -> int:
        if symbol in (ACCEPT, REJECT):
            return self.ids[symbol]
        return self.ids["cell0"] + int(symbol[1:])

    def _advance(self, state: TensorDictBase, action: torch.Tensor, active: torch.Tensor):
        round_index = state["round"].clamp(max=self.protocol.num_rounds - 1)
        texts = self.reply_texts(action, active)
        state, reward, ended = super()._advance(state, self.moves(texts, action.shape[0]), active)
        lengths = torch.where(active, self.reply_lengths(action), -1)
        rows = torch.arange(action.shape[0], device=self.device)
        replies = state["replies"].clone()
        replies[rows, round_index] = torch.where(active.unsqueeze(-1), action, replies[rows, round_index])
        reply_length = state["reply_length"].clone()
        reply_length[rows, round_index] = torch.where(active, lengths, reply_length[rows, round_index])
        state["replies"], state["reply_length"] = replies, reply_length
        return state, reward, ended

    def _policy_inputs(self, state: TensorDictBase) -> dict[str, torch.Tensor]:
        with cyclic_gc_paused():
            return self._rendered_inputs(state)

    def _rendered_inputs(self, state: TensorDictBase) -> dict[str, torch.Tensor]:
        batch, width = state.batch_size[0], self.prompt_length
        visible = as_lists(self.visible_cells(state))
        values = as_lists(state["values"])
        replies = as_lists(state["replies"][:, : self.seen_rounds])
        lengths = as_lists(state["reply_length"][:, : self.seen_rounds])
        ids, mask = [], []
        for agent, speaker in enumerate(self.chat_speakers):
            readable = self.visibility[agent].tolist()
            sent = [
                (episode, round_, sender, replies[episode][round_][sender][: min(length, self.quote_tokens)])
                for episode in range(batch)
                for round_ in range(self.seen_rounds)
                for sender, length in enumerate(lengths[episode][round_])
                if length >= 0 and readable[sender]
            ]
            read = {}  # each sent reply in this agent's tokens
            for sender, sender_speaker in enumerate(self.chat_speakers):
                keys = [item[:3] for item in sent if item[2] == sender]
                quoted = speaker.quote(sender_speaker, [item[3] for item in sent if item[2] == sender], self.quote_tokens)
                read.update(zip(keys, quoted))
            quotes = [[] for _ in range(batch)]
            for episode, round_, sender, _ in sent:
                quotes[episode].append((self.chat_speakers[sender].name, read[episode, round_, sender]))
            list_texts = [list_line(values[episode], visible[episode][agent], self.list_format) for episode in range(batch)]
            prompts = speaker.render_many(list_texts, quotes)
            longest = max((len(prompt) for prompt in prompts), default=0)
            if longest > width:
                raise RuntimeError(
                    f"agent {speaker.name}'s prompt has {longest} tokens, more than the prompt width {width}: "
                    f"raise scenario.max_prompt_tokens"
                )
            agent_ids, agent_mask = packed_rows(prompts, width, speaker.pad_id, left=True)
            ids.append(agent_ids)
            mask.append(agent_mask)
        return {"prompt_ids": torch.stack(ids, 1).to(self.device), "prompt_mask": torch.stack(mask, 1).to(self.device)}
