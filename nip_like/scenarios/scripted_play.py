"""Scripted play recorded as token demonstrations: what a language-model agent's warm start fits.

:func:`start_episodes` opens one episode per datapoint and
:func:`record_scripted_play` plays them to their end through an
environment's public :meth:`~nip_like.scenarios.environment.InteractionEnv.policy_inputs`
and :meth:`~nip_like.scenarios.environment.InteractionEnv.advance`, with the
replies a scripted player gives, keeping each agent's prompt and reply at each
of its turns. The duplicates game
(:func:`~nip_like.scenarios.duplicates.demonstrations.play_demonstrations`)
and the code-validation task
(:func:`~nip_like.scenarios.code_validation.demonstrations.play_demonstrations`)
play their demonstrations with them. A stop request that has waited its grace
ends the play between two of its steps (:func:`~nip_like.interrupts.stop_point`):
nothing is returned, nothing cached. This module registers nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from tensordict import TensorDict, TensorDictBase

from nip_like.interrupts import stop_point
from nip_like.protocols.proof import ProofProtocol
from nip_like.scenarios.environment import InteractionEnv

__all__ = ["ScriptedReplies", "record_scripted_play", "start_episodes"]

#: Recording scripted play, as a stop request in the middle of it is reported.
PLAY_PHASE = "the scripted play of the demonstrations"

#: ``replies(state, active)`` -> ``(tokens, token_mask, shown)``: the ``(B, N, T)`` replies the ``active``
#: ``(B, N)`` agents send in ``state``, as the environment takes them, their ``(B, N, T)`` masks (the
#: tokens a demonstration teaches), and ``(B, N)`` which of them are demonstrations (within ``active``).
ScriptedReplies = Callable[[TensorDictBase, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def start_episodes(state: TensorDictBase, protocol: ProofProtocol, generator: torch.Generator) -> TensorDictBase:
    """``state`` (a game's fresh episodes, one per datapoint) opened as a step would: the protocol's own
    state drawn from ``generator``, round 0, and each episode its own group id (its position)."""
    count = state.batch_size[0]
    state.update(protocol.initial_state(count, generator))
    state["round"] = torch.zeros(count, dtype=torch.int64, device=state.device)
    state["group_id"] = torch.arange(count, device=state.device)
    return state


def record_scripted_play(
    env: InteractionEnv, protocol: ProofProtocol, state: TensorDictBase, replies: ScriptedReplies
) -> dict[str, TensorDictBase]:
    """Play the episodes of ``state`` (from :func:`start_episodes`) to their end; each agent's demonstrations.

    Each round, every agent still playing that acts is asked for its reply
    (``replies``), the prompts the environment gives the policy in that state
    (``env.policy_inputs``) are kept beside the replies shown, and the
    environment plays the replies (``env.advance``), so that later prompts
    quote exactly these tokens.

    Parameters
    ----------
    env : InteractionEnv
        The game, whose policy inputs are ``prompt_ids`` and ``prompt_mask`` ``(B, N, P)``.
    protocol : ProofProtocol
        Its protocol (who acts in which round).
    state : TensorDict
        The episodes, batch ``(B,)``; played in place.
    replies : ScriptedReplies
        The scripted players' replies in a state.

    Returns
    -------
    dict of str to TensorDict
        For each agent with at least one demonstration: batch ``(E,)`` with
        ``"prompt_ids"``/``"prompt_mask"`` ``(E, P)`` and ``"tokens"``/``"token_mask"``
        ``(E, T)``, in the order of the rounds, then of the episodes.
    """
    count = state.batch_size[0]
    collected: dict[str, list[dict[str, torch.Tensor]]] = {name: [] for name in protocol.agent_names}
    playing = torch.ones(count, dtype=torch.bool, device=state.device)
    for _ in range(protocol.num_rounds):
        stop_point(PLAY_PHASE)
        active = protocol.active_agents_in(state) & playing.unsqueeze(-1)
        inputs = env.policy_inputs(state)
        tokens, token_mask, shown = replies(state, active)
        for index, name in enumerate(protocol.agent_names):
            rows = shown[:, index]
            if bool(rows.any()):
                collected[name].append(
                    {
                        "prompt_ids": inputs["prompt_ids"][rows, index],
                        "prompt_mask": inputs["prompt_mask"][rows, index],
                        "tokens": tokens[rows, index],
                        "token_mask": token_mask[rows, index],
                    }
                )
        stop_point(PLAY_PHASE)  # the replies and the environment's step are the play's long parts
        state, _, ended = env.advance(state, tokens, active)
        state["round"] = state["round"] + 1
        playing = playing & ~ended
        if not bool(playing.any()):
            break
    return {
        name: TensorDict(
            {key: torch.cat([part[key] for part in parts]) for key in parts[0]},
            batch_size=[sum(part["tokens"].shape[0] for part in parts)],
        )
        for name, parts in collected.items()
        if parts
    }
