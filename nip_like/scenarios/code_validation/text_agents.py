"""The code-validation game for text agents (the text trainers): chats, replies, model groups, scripted players.

The game is played through the move game
(:class:`~nip_like.scenarios.code_validation.environment.CodeValidationEnv`),
translating each way:

* what an agent reads becomes a chat
  (:mod:`~nip_like.scenarios.code_validation.chat_text`): a system prompt for
  its role, then one user message with the problem, the program and the
  replies it can read so far::

      ## Problem

      Write a Python function `def count_above(xs: list[int]) -> int:` that ...

      ## Program

      ```python
      def count_above(xs):
          ...
      ```
      prover: The loop visits every element and the comparison is strict ...

* what it answers is parsed into a move by one rule
  (:func:`~nip_like.scenarios.code_validation.chat_text.parse_reply`): a
  verifier's ``Decision: accept`` / ``Decision: reject`` (or a first word
  ``accept`` / ``reject``) is its decision; any other text is a message.

The agents are text models grouped as
:class:`~nip_like.scenarios.text_groups.TextModelGroups` says.
:class:`ScriptedCodeValidationModel` plays honestly, knowing each program's
label (an all-powerful prover, a verifier that decides right): the warm
start's teacher, and a fixed partner with ``scenario.scripted_provers``.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from nip_like.errors import ConfigError
from nip_like.lm.models import agent_option, architecture_context, load_tokenizer, model_context
from nip_like.scenarios.code_validation.chat_text import (
    ACCEPT,
    DECISION_FORMAT,
    LAST_TURN_NOTICE,
    REJECT,
    ROLES,
    parse_reply,
    read_datapoint,
    readable_senders,
    sender_label,
    transcript_lines,
)
from nip_like.scenarios.code_validation.dataset import CodeProgram
from nip_like.scenarios.code_validation.environment import CodeValidationEnv
from nip_like.scenarios.code_validation.game import CodeValidationGame
from nip_like.scenarios.text_groups import TextModelGroups
from nip_like.text.interface import Chat, Sampling, TextModel
from nip_like.text.tokenizer import build_chat_tokenizer

__all__ = ["CodeValidationTextAgents", "ScriptedCodeValidationModel"]

#: What the scripted verifier asks before it decides (when it may still ask).
SCRIPTED_QUESTION = "Question: does the program give the right answer on every input the problem allows, edge cases included?"


class CodeValidationTextAgents(CodeValidationGame, TextModelGroups):
    """The code-validation game played by text agents (see the module docstring)."""

    #: The verifier's reply that accepts (what a label of True teaches it to say).
    accept_word = DECISION_FORMAT.format(ACCEPT)
    #: The verifier's reply that rejects.
    reject_word = DECISION_FORMAT.format(REJECT)

    def __init__(self, config, protocol) -> None:
        super().__init__(config, protocol)
        self.check_groups()
        self._contexts_checked_for = None  # the splits whose prompts check_contexts measured

    # ------------------------------------------------------------------ agents
    @property
    def tokenizer(self):
        """The tokenizer of the moves (:attr:`~nip_like.scenarios.code_validation.game.CodeValidationGame.move_tokenizer`)."""
        return self.move_tokenizer

    def text_preflight(self) -> None:
        """Check each local text model's folder and its chat template, without loading weights."""
        for group in self.group_names():
            model = self.model_config(group)
            if model.backend == "local" and model.path is not None:
                where = self.model_config_path(group)
                tokenizer = load_tokenizer(model.path, f"{where}.path", agent_option(model, "chat_template"))
                if not getattr(tokenizer, "chat_template", None):
                    raise ConfigError(f"{where}.path: the tokenizer in {model.path} has no chat_template, which text models need")

    def check_contexts(self) -> None:
        """Refuse, in one line, a local text model whose longest prompt and reply exceed its context (once per data)."""
        if self._contexts_checked_for is self.splits():
            return
        for group in self.group_names():
            model = self.model_config(group)
            if model.backend != "local":
                continue
            where = self.model_config_path(group)
            if model.path is not None:
                tokenizer, context = load_tokenizer(model.path, f"{where}.path", agent_option(model, "chat_template")), model_context(model.path)
                source = f"the model in {model.path}"
            else:
                tokenizer = build_chat_tokenizer()
                context = architecture_context(str(model.architecture), f"{where}.architecture")
                source = f"a from-config {model.architecture}"
            if context is None:
                continue
            agents = [index for index, name in enumerate(self.agent_names) if self.groups()[name] == group]
            prompt = max(self.longest_prompt(tokenizer, agent, int(model.max_new_tokens)) for agent in agents)
            if prompt + int(model.max_new_tokens) > context:
                raise ConfigError(
                    f"{where}.max_new_tokens ({model.max_new_tokens}) plus the longest prompt of model group {group} "
                    f"(up to {prompt} tokens) exceeds the context of {source} ({context} tokens): shorten the prompts "
                    f"(scenario.system_prompts) or the replies, or use a model with a longer context"
                )
        self._contexts_checked_for = self.splits()

    def longest_prompt(self, tokenizer, agent: int, max_new_tokens: int) -> int:
        """An upper bound of the tokens of agent ``agent``'s prompts: its chat on the program with the most tokens,
        after a reply of ``max_new_tokens`` tokens in every turn it can read (:func:`readable_senders`)."""
        texts = self.all_datapoint_texts()
        lengths = tokenizer(texts, add_special_tokens=False)["input_ids"]
        widest = texts[max(range(len(texts)), key=lambda index: len(lengths[index]))]
        lines = [f"{sender_label(self.protocol, agent, sender)}: " for sender in readable_senders(self.protocol, agent)]
        system = self.last_turn_prompt() if agent == self.protocol.verifier_index else self.system_prompt(self.agent_names[agent])
        chat = [{"role": "system", "content": system}, {"role": "user", "content": "\n".join([widest, *lines])}]
        text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        return len(tokenizer(text, add_special_tokens=False)["input_ids"]) + len(lines) * max_new_tokens

    def scripted_player(self, agent: str) -> "ScriptedCodeValidationModel":
        """The honest scripted player of ``agent``'s role, which knows every program's label."""
        return ScriptedCodeValidationModel(self.role(agent), self.program_lookup())

    def program_lookup(self) -> dict[tuple[str, str], CodeProgram]:
        """Every program of every split by its ``(statement, source)`` as the chat shows them (what scripted players read).

        Made again when the splits change (a dataset file played instead of a split).
        """
        if getattr(self, "_lookup_for", None) is not self.splits():
            lookup: dict[tuple[str, str], CodeProgram] = {}
            for split in self.split_names:
                data = self.split(split)
                for program in data.programs:
                    key = (data.problems[program.problem_id].statement.strip(), program.source.rstrip())
                    lookup.setdefault(key, program)
            self._program_lookup, self._lookup_for = lookup, self.splits()
        return self._program_lookup

    # -------------------------------------------------------------------- chat
    def make_text_env(
        self, num_envs: int, split: str, seed: int, device: torch.device | str, group_size: int = 1
    ) -> CodeValidationEnv:
        """The move game on ``split``, after checking once that the local text models' contexts hold its prompts."""
        self.check_contexts()
        return super().make_text_env(num_envs, split, seed, device, group_size=group_size)

    def render_chat(
        self, env: CodeValidationEnv, state, visible_cells: torch.Tensor, episode: int, agent: int, replies: list[list[str | None]]
    ) -> Chat:
        """The chat agent ``agent`` reads in ``episode`` of ``state`` (see the module docstring).

        Parameters
        ----------
        env : CodeValidationEnv
            The move game being played (its split's programs, its visibility of channels).
        state : TensorDict
            The environment's ``"state"``.
        visible_cells : torch.Tensor
            Unused: every agent reads the whole problem and program.
        episode, agent : int
            Which episode and agent.
        replies : list of list of str or None
            The episode's replies so far, ``[round][agent]`` (``None``: no turn).
        """
        name = self.agent_names[agent]
        lines = [env.datapoints[int(state["list_index"][episode])]]
        for round_replies in replies:
            for sender, reply in enumerate(round_replies):
                if reply is not None and bool(env.visibility[agent, sender]):
                    lines.append(f"{sender_label(self.protocol, agent, sender)}: {reply}")
        last_turn = agent == self.protocol.verifier_index and bool(self.protocol.decision_round(state["round"][episode]))
        system = self.last_turn_prompt() if last_turn else self.system_prompt(name)
        return [{"role": "system", "content": system}, {"role": "user", "content": "\n".join(lines)}]

    def reply_action(self, reply: str, agent: int) -> tuple[list[str], str]:
        """The move a reply makes, as a move symbol (``[]`` for an empty reply), and what it is in words.

        Returns
        -------
        tokens : list of str
            ``["accept"]``, ``["reject"]``, ``["message"]`` or ``[]``.
        meaning : str
            ``"accept"``, ``"reject"``, ``"message"`` or ``"none"``.
        """
        meaning = parse_reply(reply, agent == self.protocol.verifier_index)
        return ([] if meaning == "none" else [meaning]), meaning

    def encode_actions(self, moves: list[list[str]]) -> torch.Tensor:
        """``(len(moves), 1)`` move ids, ``<pad>`` for an empty move."""
        ids = self.move_ids()
        return torch.tensor([[ids[move[0]] if move else ids["pad"]] for move in moves], dtype=torch.long).reshape(-1, 1)


class ScriptedCodeValidationModel(TextModel):
    """Honest play by a player that knows each program's label (read from the chat: the problem and the program).

    The verifier asks one question while it may (before any reply has been
    read, and not on its last turn), then decides right:
    ``Decision: accept`` exactly when the program passes its hidden tests. A
    prover says one sentence for its side, the same whatever the label (so
    that the sentence tells the verifier nothing), except that a prover
    arguing *reject* against a program that fails names how it fails (a
    wrong answer, the exception raised, a time limit) without the test.

    Parameters
    ----------
    role : str
        ``"verifier"``, ``"accept"`` or ``"reject"``.
    programs : mapping
        Every program by ``(statement, source)``, stripped as the chat shows
        them (:meth:`CodeValidationTextAgents.program_lookup`).
    """

    def __init__(self, role: str, programs: Mapping[tuple[str, str], CodeProgram]) -> None:
        if role not in ROLES:
            raise ConfigError(f"unknown role {role!r}; allowed: {', '.join(ROLES)}")
        self.role = role
        self.programs = programs

    def reply(self, chats: Sequence[Chat], sampling: Sampling, seed: int) -> list[str]:
        return [self._reply(chat) for chat in chats]

    def program(self, chat: Chat) -> CodeProgram:
        """The program a chat shows (its user message opens with the problem and the program)."""
        datapoint = read_datapoint(chat[-1]["content"])
        program = None if datapoint is None else self.programs.get((datapoint[0].strip(), datapoint[1].rstrip()))
        if program is None:
            raise ValueError("the scripted code-validation player was shown a chat without a program of its dataset")
        return program

    def _reply(self, chat: Chat) -> str:
        program = self.program(chat)
        if self.role == "verifier":
            last_turn = LAST_TURN_NOTICE in chat[0]["content"]
            if not last_turn and not transcript_lines(chat[-1]["content"]):
                return SCRIPTED_QUESTION
            return DECISION_FORMAT.format(ACCEPT if program.label else REJECT)
        if self.role == ACCEPT:
            return "The program is correct: it handles every case the problem describes."
        return f"The program is wrong: {failure(program)} on one of the problem's tests."


def failure(program: CodeProgram) -> str:
    """How a failing program fails, in words, without the test (what the scripted reject-side prover says).

    A program that passes gets the most common failure, a wrong answer (the
    scripted prover argues its side whatever the label).
    """
    reason = program.reason.partition(": ")[2] if program.reason.startswith("test ") else program.reason
    if program.label or not reason or reason.startswith("wrong answer"):
        return "it returns a wrong answer"
    if reason.startswith("error: "):
        return f"it raises {reason[len('error: '):]}"
    if reason.startswith("time limit"):
        return "it runs past the time limit"
    return "it fails"
