"""Scripted play of the code-validation task in the chat view, recorded as demonstrations for a warm start.

:func:`play_demonstrations` plays every program of a split once through the
chat view (:class:`~nip_like.scenarios.code_validation.chat_view.CodeValidationChatViewEnv`)
with the scenario's scripted players
(:class:`~nip_like.scenarios.code_validation.text_agents.ScriptedCodeValidationModel`).
Each player reads the chat its agent reads
(:meth:`~nip_like.scenarios.code_validation.text_agents.CodeValidationTextAgents.render_chat`,
the text agents' chat, with the replies as the environment reads them), and
its reply is written in the agent's own tokens
(:meth:`~nip_like.scenarios.code_validation.chat_view.CodeValidationChatViewEnv.scripted_replies`)
and played by the environment, so that later prompts quote exactly the
demonstrated tokens (:func:`~nip_like.scenarios.scripted_play.record_scripted_play`).
:meth:`~nip_like.scenarios.code_validation.scenario.CodeValidationScenario.demonstrations`
calls it. This module registers nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from tensordict import TensorDictBase

from nip_like.errors import ConfigError
from nip_like.protocols.proof import ProofProtocol
from nip_like.scenarios.chat_prompts import ChatSpeaker
from nip_like.scenarios.code_validation.chat_view import CodeValidationChatViewEnv
from nip_like.scenarios.scripted_play import record_scripted_play, start_episodes
from nip_like.text.interface import Chat, Sampling, TextModel

__all__ = ["ReplyLimit", "check_reply_fits", "play_demonstrations"]

#: An agent's ``max_new_tokens`` and the config path that sets it (``scenario.agents.<name>`` or ``scenario.default_agent``).
ReplyLimit = tuple[int, str]


def check_reply_fits(speaker: ChatSpeaker, replies: Sequence[str], limit: ReplyLimit) -> None:
    """Refuse, in one line, scripted ``replies`` of which one has more tokens (in ``speaker``'s tokenizer) than the limit.

    Raises
    ------
    ConfigError
        Naming the agent, the longest reply's token count and the key to raise.
    """
    encoded = speaker.encode(replies)
    longest = max((len(encoded[reply]) for reply in replies), default=0)
    tokens, where = limit
    if longest > tokens:
        raise ConfigError(
            f"agent {speaker.name}'s scripted reply has {longest} tokens, more than its max_new_tokens ({tokens}): "
            f"raise {where}.max_new_tokens to at least {longest} for its demonstrations (trainer.pretrain)"
        )


def play_demonstrations(
    env: CodeValidationChatViewEnv,
    protocol: ProofProtocol,
    players: Mapping[str, TextModel],
    render_chat: Callable[..., Chat],
    limits: Mapping[str, ReplyLimit],
    generator: torch.Generator,
) -> dict[str, TensorDictBase]:
    """Scripted play on every program of ``env``'s split, as (prompt, reply) pairs per agent, for a warm start.

    Parameters
    ----------
    env : CodeValidationChatViewEnv
        The chat view of the split (one episode wide: its programs are played all at once, each once).
    protocol : ProofProtocol
        The game's protocol.
    players : mapping of str to TextModel
        Each agent's scripted player, by agent name.
    render_chat : callable
        ``render_chat(env, state, visible_cells, episode, agent, replies)``: the chat an agent reads
        (:meth:`~nip_like.scenarios.code_validation.text_agents.CodeValidationTextAgents.render_chat`).
    limits : mapping of str to ReplyLimit
        Each agent's ``max_new_tokens`` and the key that sets it.
    generator : torch.Generator
        Draws the protocol's own state (Merlin-Arthur's speaking prover).

    Returns
    -------
    dict of str to TensorDict
        For each agent with a turn: batch ``(E,)`` with ``"prompt_ids"``/``"prompt_mask"``
        ``(E, P)`` (the prompt the environment gives the policy) and ``"tokens"``/``"token_mask"``
        ``(E, T)`` (the reply's tokens, then the eos token, cut to the agent's ``max_new_tokens``).

    Raises
    ------
    ConfigError
        If a scripted reply has more tokens than its agent's ``max_new_tokens`` (:func:`check_reply_fits`).
    """
    names, count = protocol.agent_names, env.num_programs
    state = start_episodes(env.new_state(torch.arange(count)), protocol, generator)
    # Each episode's replies as text, [round][agent] (None: no turn): what the scripted players read.
    said: list[list[list[str | None]]] = [[[None] * len(names) for _ in range(protocol.num_rounds)] for _ in range(count)]
    max_tokens = [int(limits[name][0]) for name in names]

    def scripted(state: TensorDictBase, active: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        round_index = int(state["round"].max())
        visible = env.visible_cells(state)
        texts: dict[tuple[int, int], str] = {}
        for agent, name in enumerate(names):
            rows = active[:, agent].nonzero().flatten().tolist()
            if not rows:
                continue
            chats = [render_chat(env, state, visible, row, agent, said[row][:round_index]) for row in rows]
            replies = players[name].reply(chats, Sampling(max_tokens[agent]), seed=0)
            check_reply_fits(env.chat_speakers[agent], replies, limits[name])
            texts.update(zip([(row, agent) for row in rows], replies))
        tokens, token_mask = env.scripted_replies(texts, count, max_tokens)
        # Later turns read each reply as the environment reads its tokens.
        for (row, agent), text in env.reply_texts(tokens, active).items():
            said[row][round_index][agent] = text
        return tokens, token_mask, active

    return record_scripted_play(env, protocol, state, scripted)
