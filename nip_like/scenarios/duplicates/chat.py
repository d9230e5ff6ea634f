"""The duplicates game rendered as chat, for text agents (:mod:`nip_like.text`).

The lists, splits, protocols and rules are those of the token game
(:mod:`nip_like.scenarios.duplicates.environment`); the text game plays
through that very environment and only translates:

* what an agent sees becomes a chat: a system prompt for its role, then one
  user message with the list as the agent sees it and the messages it can
  read so far, e.g.::

      list: ? ? 7 ? 7 ? ? ?
      prover: 4 2

* what it answers is parsed into the game's move with one rule: the first two
  whole numbers of a reply that are different cells (``0 .. L-1``) name those
  cells (``"4 2"``, ``"cells 4 and 2"``); a verifier's reply whose first word
  is ``accept`` or ``reject`` (any case, punctuation ignored) is its decision;
  anything else is a message with no effect. A verifier whose reply on its last
  turn is not a decision ends the episode undecided, which counts as wrong.

:class:`ScriptedDuplicatesModel` plays honestly from the chat text alone (the
warm start's demonstrations and a reference in tests).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from nip_like.errors import ConfigError
from nip_like.lm.models import agent_option, architecture_context, load_tokenizer, model_context
from nip_like.registry import register_scenario
from nip_like.scenarios.duplicates.chat_text import SYSTEM_PROMPTS, list_line, parse_reply, read_list_line
from nip_like.scenarios.duplicates.environment import ACCEPT, REJECT, DuplicatesEnv
from nip_like.scenarios.duplicates.game import DuplicatesDataConfig, DuplicatesGame
from nip_like.scenarios.text_groups import TextModelGroups
from nip_like.text.interface import Chat, Sampling, TextModel, TextModelConfig
from nip_like.text.tokenizer import build_chat_tokenizer

#: Width of the token action the chat replies are translated into: two cells and ``<eos>``.
ACTION_TOKENS = 3


@dataclass
class DuplicatesChatConfig(DuplicatesDataConfig):
    """The duplicates game as chat between text models (see :mod:`nip_like.scenarios.duplicates.chat`)."""

    name: str = "duplicates_chat"  # scenario name
    default_model: TextModelConfig = field(default_factory=TextModelConfig)  # the text model of groups not in models
    models: dict[str, Any] = field(default_factory=dict)  # per-group TextModelConfig entries: {verifier: {hidden_size: 96}}
    agent_groups: dict[str, str] = field(default_factory=dict)  # agent -> model group; agents not named form a group of their own
    scripted_provers: bool = False  # every prover is the honest scripted player (backend scripted), whatever the protocol


@register_scenario("duplicates_chat", DuplicatesChatConfig)
class DuplicatesChatScenario(DuplicatesGame, TextModelGroups):
    """The duplicates game for text agents: same data, protocols and rules as ``duplicates``, as chat.

    The agents are text models (:class:`~nip_like.text.interface.TextModelConfig`),
    grouped by ``scenario.agent_groups`` (agents in one group share a model
    and its fine-tune jobs). It is played by the text trainers
    (``trainer=expert_iteration``, ``trainer=malt``); the tensor trainers use
    ``scenario=duplicates``, on the same lists when ``num_lists``,
    ``dataset_seed`` and the split fractions agree.
    """

    accept_word = ACCEPT
    reject_word = REJECT

    def __init__(self, config, protocol) -> None:
        super().__init__(config, protocol)
        self.check_groups()

    # ------------------------------------------------------------------ agents
    @property
    def message_tokens(self) -> int:
        return ACTION_TOKENS

    def preflight(self) -> None:
        """Check each local text model's folder and its chat template, and that its longest prompt and reply fit
        its context, without loading weights."""
        for group in self.group_names():
            model = self.model_config(group)
            if model.backend != "local":
                continue
            where = self.model_config_path(group)
            if model.path is not None:
                tokenizer = load_tokenizer(model.path, f"{where}.path", agent_option(model, "chat_template"))
                if not getattr(tokenizer, "chat_template", None):
                    raise ConfigError(f"{where}.path: the tokenizer in {model.path} has no chat_template, which text models need")
                context, source = model_context(model.path), f"the model in {model.path}"
            else:
                tokenizer = build_chat_tokenizer()
                context, source = architecture_context(str(model.architecture), f"{where}.architecture"), f"a from-config {model.architecture}"
            if context is None:
                continue
            agents = [index for index, name in enumerate(self.agent_names) if self.groups()[name] == group]
            prompt = max(self.longest_prompt(tokenizer, agent, int(model.max_new_tokens)) for agent in agents)
            if prompt + int(model.max_new_tokens) > context:
                raise ConfigError(
                    f"{where}.max_new_tokens ({model.max_new_tokens}) plus the longest prompt of model group {group} "
                    f"(up to {prompt} tokens) exceeds the context of {source} ({context} tokens): "
                    f"at most {max(context - prompt, 0)} with these prompts"
                )

    def longest_prompt(self, tokenizer, agent: int, max_new_tokens: int) -> int:
        """An upper bound of the tokens of agent ``agent``'s prompts: the rendered chat of a list of the largest
        values, every cell shown, after a reply of ``max_new_tokens`` tokens from every agent in every round."""
        values = [int(self.config.num_values) - 1] * int(self.config.length)
        lines = [list_line(values, [True] * len(values), self.config.list_format)]
        replies = [f"{sender}: " for _ in range(self.protocol.num_rounds) for sender in self.agent_names]
        chat = [
            {"role": "system", "content": self.system_prompt(self.agent_names[agent])},
            {"role": "user", "content": "\n".join(lines + replies)},
        ]
        text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        return len(tokenizer(text, add_special_tokens=False)["input_ids"]) + len(replies) * max_new_tokens

    def scripted_player(self, agent: str) -> "ScriptedDuplicatesModel":
        """The honest scripted player of ``agent``'s role (the warm start's teacher)."""
        return ScriptedDuplicatesModel(self.role(agent))

    # -------------------------------------------------------------------- chat
    def render_chat(
        self, env: DuplicatesEnv, state, visible_cells: torch.Tensor, episode: int, agent: int, replies: list[list[str | None]]
    ) -> Chat:
        """The chat agent ``agent`` reads in ``episode`` of ``state``.

        Parameters
        ----------
        env : DuplicatesEnv
            The environment being played (its visibility of channels).
        state : TensorDict
            The environment's ``"state"``.
        visible_cells : torch.Tensor
            ``env.visible_cells(state)``, ``(B, N, L)``.
        episode, agent : int
            Which episode and agent.
        replies : list of list of str or None
            The episode's replies so far, ``[round][agent]`` (``None``: no turn).
        """
        name = self.agent_names[agent]
        lines = [list_line(state["values"][episode].tolist(), visible_cells[episode, agent].tolist(), self.config.list_format)]
        for round_replies in replies:
            for sender, reply in enumerate(round_replies):
                if reply is not None and bool(env.visibility[agent, sender]):
                    lines.append(f"{self.agent_names[sender]}: {reply}")
        return [{"role": "system", "content": self.system_prompt(name)}, {"role": "user", "content": "\n".join(lines)}]

    def reply_action(self, reply: str, agent: int) -> tuple[list[str], str]:
        """The token move a reply makes (see the module docstring) and what it is, in words.

        Returns
        -------
        tokens : list of str
            At most :data:`ACTION_TOKENS` symbols of the token game, ``<eos>`` last;
            ``[]`` for a message with no effect.
        meaning : str
            ``"cells i j"``, ``"accept"``, ``"reject"`` or ``"none"``.
        """
        symbols, meaning = parse_reply(reply, agent == self.protocol.verifier_index, self.symbols.length)
        return ([*symbols, self.tokenizer.eos_token] if symbols else []), meaning

    def encode_actions(self, moves: list[list[str]]) -> torch.Tensor:
        """``(len(moves), ACTION_TOKENS)`` token ids of the moves, ``<pad>`` after each."""
        pad = self.tokenizer.pad_token_id
        ids = torch.full((len(moves), ACTION_TOKENS), pad, dtype=torch.long)
        for row, move in enumerate(moves):
            if move:
                ids[row, : len(move)] = torch.tensor(self.tokenizer.convert_tokens_to_ids(move))
        return ids


class ScriptedDuplicatesModel(TextModel):
    """Honest play read from the chat text alone: a reference player and the warm start's teacher.

    A prover arguing for *accept* names the duplicate pair of the list it
    sees (the later cell first); otherwise, and for a prover arguing for
    *reject*, it names a random pair (later cell first), one cell, or one
    cell twice (as the token game's demonstrations do). The verifier accepts
    exactly when two cells it sees hold equal values, at its first turn.

    Parameters
    ----------
    role : str
        ``"verifier"``, ``"accept"`` or ``"reject"``.
    """

    def __init__(self, role: str) -> None:
        if role not in SYSTEM_PROMPTS:
            raise ConfigError(f"unknown role {role!r}; allowed: {', '.join(SYSTEM_PROMPTS)}")
        self.role = role

    def reply(self, chats: Sequence[Chat], sampling: Sampling, seed: int) -> list[str]:
        rng = random.Random(seed)
        return [self._reply(chat[-1]["content"], rng) for chat in chats]

    def _reply(self, text: str, rng: random.Random) -> str:
        cells = read_list_line(text)
        seen: dict[int, int] = {}
        pair = None
        for index, value in enumerate(cells):
            if value is None:
                continue
            if value in seen and pair is None:
                pair = (index, seen[value])
            seen.setdefault(value, index)
        if self.role == "verifier":
            return ACCEPT if pair is not None else REJECT
        if self.role == ACCEPT and pair is not None:
            return f"{pair[0]} {pair[1]}"
        first, second = sorted(rng.sample(range(len(cells)), 2), reverse=True)
        kind = rng.randrange(3)
        return f"{first} {second}" if kind == 0 else f"{first}" if kind == 1 else f"{first} {first}"
