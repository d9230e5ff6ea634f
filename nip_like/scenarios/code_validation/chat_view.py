"""The code-validation game in natural-language turns: the chat view of the RL loop's language-model agents.

Programs, splits, protocols, rules and rewards are those of
:class:`~nip_like.scenarios.code_validation.environment.CodeValidationEnv`;
:class:`CodeValidationChatViewEnv` only changes what an agent reads and
writes, as the duplicates game's chat view does
(:mod:`~nip_like.scenarios.duplicates.chat_view`).

What an agent reads
    Its tokenizer's own ``apply_chat_template`` (with the generation prompt)
    over a system message for its role and one user message: the problem and
    the program, then each reply it can read so far as a ``<sender>: <reply>``
    line (:mod:`~nip_like.scenarios.code_validation.chat_text`; the same chat
    the text agents read). On its last turn the verifier's system message
    ends with :data:`~nip_like.scenarios.code_validation.chat_text.LAST_TURN_NOTICE`.
    A quoted reply is spliced in as the tokens its sender sampled (its first
    ``quote_tokens``), not decoded and re-encoded; a reader of another
    vocabulary gets its text encoded by its own tokenizer, cut the same way.

What an agent writes
    Free text of up to ``max_new_tokens`` tokens, ended by its tokenizer's eos
    token or a stop string. The reply's text (its tokens before the first eos
    or pad token, decoded without special tokens) becomes a move by
    :func:`~nip_like.scenarios.code_validation.chat_text.parse_reply`.

Keys (besides the move game's; ``T`` is the longest ``max_new_tokens``, ``P``
the prompt width, ``V`` the largest vocabulary of the agents):

========================================  ===============  ==============================================
key                                       shape            meaning
========================================  ===============  ==============================================
``("state", "replies")``                  ``B, R, N, T``   every reply's sampled tokens (sender's pad after)
``("state", "reply_length")``             ``B, R, N``      tokens of each reply before its end, ``-1`` unsent
``("agents", "prompt_ids")``              ``B, N, P``      the rendered chat, left-padded (each agent's vocabulary)
``("agents", "prompt_mask")``             ``B, N, P``      its real tokens
``("agents", "action")``                  ``B, N, T``      each agent's reply tokens, ``< V``
========================================  ===============  ==============================================
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
from tensordict import TensorDictBase
from torchrl.data import Binary, Bounded, Unbounded

from nip_like.errors import ConfigError
from nip_like.protocols.proof import ProofProtocol
from nip_like.scenarios.chat_prompts import (
    ChatSpeaker,
    as_lists,
    cyclic_gc_paused,
    packed_rows,
    reply_lengths,
    reply_texts,
    scripted_reply_tensors,
)
from nip_like.scenarios.code_validation.chat_text import parse_reply, readable_senders, sender_label
from nip_like.scenarios.code_validation.environment import CodeValidationEnv

#: Tokens added to the longest prompt found, for text that merges differently beside other text.
PROMPT_MARGIN = 8


class CodeValidationChatViewEnv(CodeValidationEnv):
    """The code-validation game with chat prompts and free-text replies (see the module docstring).

    Parameters
    ----------
    protocol : ProofProtocol
        Turns, channels and rewards.
    labels : torch.Tensor
        ``(M,)`` bool: the split's programs' labels.
    datapoints : sequence of str
        ``M`` texts: each program's problem and program
        (:func:`~nip_like.scenarios.code_validation.chat_text.datapoint_text`).
    move_ids : dict of str to int
        As for :class:`~nip_like.scenarios.code_validation.environment.CodeValidationEnv`.
    speakers : sequence of ChatSpeaker
        One per agent, in the order of the agent dimension.
    last_turn_speaker : ChatSpeaker
        The verifier on its last turn (its system prompt ends with the notice to decide).
    reply_tokens : int
        ``T``, the longest reply (the agents' largest ``max_new_tokens``).
    quote_tokens : int
        Tokens of a reply shown to the agents who read it.
    prompt_tokens : int
        ``P``; 0 sizes it to the longest prompt of ``width_texts``.
    width_texts : sequence of str, optional
        The datapoint texts the width is measured on (those of every split, so
        that every split's environment has one width); ``datapoints`` if omitted.
    num_envs, device, seed, group_size
        As for :class:`~nip_like.scenarios.environment.InteractionEnv`.
    """

    def __init__(
        self,
        protocol: ProofProtocol,
        labels: torch.Tensor,
        datapoints: Sequence[str],
        move_ids: dict[str, int],
        speakers: Sequence[ChatSpeaker],
        last_turn_speaker: ChatSpeaker,
        reply_tokens: int,
        quote_tokens: int = 64,
        prompt_tokens: int = 0,
        width_texts: Sequence[str] | None = None,
        num_envs: int = 1,
        device: torch.device | str = "cpu",
        seed: int = 0,
        group_size: int = 1,
    ) -> None:
        if reply_tokens < 1:
            raise ConfigError(f"a reply needs at least one token, got max_new_tokens={reply_tokens}")
        self.chat_speakers = list(speakers)
        self.last_turn_speaker = last_turn_speaker
        self.reply_tokens = int(reply_tokens)
        self.quote_tokens = int(quote_tokens)
        self.reply_vocab = max(len(speaker.tokenizer) for speaker in self.chat_speakers)
        self._prompt_tokens = int(prompt_tokens)
        self._width_texts = list(width_texts) if width_texts is not None else list(datapoints)
        self.sender_labels = [
            [sender_label(protocol, reader, sender) for sender in range(protocol.num_agents)]
            for reader in range(protocol.num_agents)
        ]
        super().__init__(protocol, labels, datapoints, move_ids, vocab_size=self.reply_vocab, num_envs=num_envs,
                         device=device, seed=seed, group_size=group_size)

    # ---------------------------------------------------------------- sizes
    @property
    def prompt_length(self) -> int:
        """``P``: the configured width, or the longest prompt any agent can be shown."""
        if self._prompt_tokens:
            return self._prompt_tokens
        if not hasattr(self, "_longest_prompt"):
            speakers = [*enumerate(self.chat_speakers), (self.verifier_index, self.last_turn_speaker)]
            self._longest_prompt = max(self._longest_prompt_of(agent, speaker) for agent, speaker in speakers)
        return self._longest_prompt

    def _longest_prompt_of(self, agent: int, speaker: ChatSpeaker) -> int:
        # The datapoint with the most tokens, then a reply at the quoted length in every turn the agent can read.
        encoded = speaker.encode(self._width_texts)
        widest = max(self._width_texts, key=lambda text: len(encoded[text]))
        longest_label = max((label for labels in self.sender_labels for label in labels), key=len)
        quotes = [(longest_label, [0] * self.quote_tokens)] * len(readable_senders(self.protocol, agent))
        return len(speaker.render(widest, quotes)) + PROMPT_MARGIN

    # ----------------------------------------------------------------- specs
    def _state_spec(self) -> dict[str, object]:
        b, device = self.batch_size, self.device
        rounds, agents = self.protocol.num_rounds, self.num_agents
        return {
            **super()._state_spec(),
            "replies": Unbounded(shape=(*b, rounds, agents, self.reply_tokens), dtype=torch.int64, device=device),
            "reply_length": Unbounded(shape=(*b, rounds, agents), dtype=torch.int64, device=device),
        }

    def _policy_input_spec(self) -> dict[str, object]:
        agents = (*self.batch_size, self.num_agents)
        return {
            "prompt_ids": Bounded(
                low=0, high=self.vocab_size - 1, shape=(*agents, self.prompt_length), dtype=torch.int64, device=self.device
            ),
            "prompt_mask": Binary(shape=(*agents, self.prompt_length), dtype=torch.bool, device=self.device),
        }

    @property
    def action_tokens(self) -> int:
        """``T``: an agent's reply, in its own tokens."""
        return self.reply_tokens

    # ------------------------------------------------------------ the game
    def new_state(self, index: torch.Tensor) -> TensorDictBase:
        """Fresh episodes on the programs ``index`` ``(E,)``, with no reply sent yet (see the move game's)."""
        state = super().new_state(index)
        shape = (state.batch_size[0], self.protocol.num_rounds, self.num_agents)
        state["replies"] = torch.zeros(*shape, self.reply_tokens, dtype=torch.int64, device=self.device)
        state["reply_length"] = torch.full(shape, -1, dtype=torch.int64, device=self.device)
        return state

    def reply_lengths(self, action: torch.Tensor) -> torch.Tensor:
        """``(B, N)``: tokens of each reply before its first eos or pad token (of its sender's tokenizer)."""
        return reply_lengths(action, self.chat_speakers)

    def reply_texts(self, action: torch.Tensor, active: torch.Tensor) -> dict[tuple[int, int], str]:
        """The text of each active reply, by ``(episode, agent)``."""
        return reply_texts(action, active, self.chat_speakers)

    def scripted_replies(
        self, texts: Mapping[tuple[int, int], str], batch: int, limits: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Replies that say given texts, as the agents would send them (a scripted player's, in the warm start).

        Parameters
        ----------
        texts : mapping
            The text of each reply, by ``(episode, agent)``.
        batch : int
            ``B``, the episodes.
        limits : sequence of int
            Each agent's ``max_new_tokens``, at most ``T``.

        Returns
        -------
        replies, reply_mask : torch.Tensor
            ``(B, N, T)``: each text tokenized by its sender's tokenizer, then
            its eos token, cut to the sender's limit and padded with its pad
            token (nothing but pad where no text is given), and the mask of
            these tokens.
        """
        columns = [[texts.get((row, agent)) for row in range(batch)] for agent in range(self.num_agents)]
        replies, masks = scripted_reply_tensors(self.chat_speakers, columns, limits, self.reply_tokens)
        return replies.to(self.device), masks.to(self.device)

    def moves(self, texts: dict[tuple[int, int], str], batch: int) -> torch.Tensor:
        """``(batch, N)`` moves of the parsed replies (``<pad>`` where an agent had no turn or said nothing)."""
        move = torch.full((batch, self.num_agents), self.move_ids["pad"], dtype=torch.int64)
        for (row, agent), text in texts.items():
            meaning = parse_reply(text, agent == self.verifier_index)
            if meaning != "none":
                move[row, agent] = self.move_ids[meaning]
        return move.to(self.device)

    def _advance(self, state: TensorDictBase, action: torch.Tensor, active: torch.Tensor):
        round_index = state["round"].clamp(max=self.protocol.num_rounds - 1)
        texts = self.reply_texts(action, active)
        state, reward, ended = self.play_moves(state, self.moves(texts, action.shape[0]), active)
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
        programs = as_lists(state["list_index"])
        last_turn = as_lists(self.protocol.decision_round(state["round"]))
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
                quotes[episode].append((self.sender_labels[agent][sender], read[episode, round_, sender]))
            texts = [self.datapoints[program] for program in programs]
            # The verifier on its last turn reads the notice to decide (the same tokenizer, another system prompt).
            deciding = [agent == self.verifier_index and bool(last) for last in last_turn]
            prompts: list[list[int]] = [[] for _ in range(batch)]
            for renderer, rows in ((speaker, [e for e in range(batch) if not deciding[e]]),
                                   (self.last_turn_speaker, [e for e in range(batch) if deciding[e]])):
                if rows:
                    for row, prompt in zip(rows, renderer.render_many([texts[e] for e in rows], [quotes[e] for e in rows])):
                        prompts[row] = prompt
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
