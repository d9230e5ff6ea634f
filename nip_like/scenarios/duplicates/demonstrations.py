"""Honest play of the duplicates game, recorded as demonstrations for a warm start.

The verifier's sound decision rule (:func:`equal_pair_seen`), the decoys a
prover sends when it has no certificate to give (:func:`decoy_messages`, mixed
by :class:`DecoyWeights`), and :func:`play_demonstrations`, which plays every
list of a split through the environment's own rules with these moves. By
default the scenario's hooks
:meth:`~nip_like.scenarios.duplicates.scenario.DuplicatesScenario.verifier_accepts`
and :meth:`~nip_like.scenarios.duplicates.scenario.DuplicatesScenario.decoys`
call the first two; its
:meth:`~nip_like.scenarios.duplicates.scenario.DuplicatesScenario.demonstrations`
calls :func:`play_demonstrations` with its hooks. This module registers nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from tensordict import TensorDictBase

from nip_like.allowed import checked
from nip_like.errors import ConfigError
from nip_like.protocols.proof import ProofProtocol
from nip_like.scenarios.duplicates.data import DuplicateLists, equal_pairs
from nip_like.scenarios.duplicates.environment import DuplicatesEnv
from nip_like.scenarios.scripted_play import record_scripted_play, start_episodes

__all__ = ["DecoyWeights", "check_decoy_weights", "decoy_messages", "equal_pair_seen", "play_demonstrations"]


@dataclass
class DecoyWeights:
    """How often the verifier's demonstrations show each kind of decoy (relative weights).

    A decoy is what a prover sends on a negative list in honest play (see
    :meth:`~nip_like.scenarios.duplicates.scenario.DuplicatesScenario.demonstrations`).
    The kinds differ in how many cells they reveal, so their mix decides what
    the verifier can learn: with few ``pair`` decoys, "two distinct cells were
    named" predicts *accept* almost as well as comparing the two values does,
    and a verifier that learns that shortcut accepts every list of a game
    whose prover always names two cells.
    """

    pair: float = checked(1.0, ge=0)  # two distinct cells (the later first, like a certificate)
    alone: float = checked(1.0, ge=0)  # one cell alone
    twice: float = checked(1.0, ge=0)  # one cell named twice


def equal_pair_seen(values: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """``(B,)``: whether two distinct cells among the ``seen`` ones ``(B, L)`` hold equal ``values`` ``(B, L)``."""
    # Unseen cells get distinct values that no cell holds, so that only seen cells can make a pair.
    unseen = -1 - torch.arange(values.shape[-1], device=values.device)
    return equal_pairs(torch.where(seen, values, unseen)) > 0


def check_decoy_weights(weights: tuple[float, float, float]) -> None:
    """Refuse decoy weights (pair, alone, twice) that draw nothing, in one line."""
    if min(weights) < 0 or sum(weights) <= 0:
        raise ConfigError(f"scenario.decoys: the weights (pair, alone, twice) must be >= 0 with one > 0, got {tuple(weights)}")


def decoy_messages(
    count: int, length: int, generator: torch.Generator, weights: tuple[float, float, float] = (1.0, 1.0, 1.0)
) -> torch.Tensor:
    """``(count, 2)`` cells of messages that prove nothing unless by chance.

    Each is a random pair (the later cell first, like a certificate), one
    cell alone (second entry -1: the message is ``c<i> <eos>``) or one cell
    twice, drawn with the relative ``weights`` of these three kinds (equal
    weights: evenly, as the demonstrations of version 3 drew them).

    Raises
    ------
    ConfigError
        If no weight is positive.
    """
    check_decoy_weights(weights)
    # The later cell first, as in a certificate, so that the order of the names tells nothing.
    pair = torch.rand(count, length, generator=generator).argsort(-1)[:, :2].sort(-1, descending=True).values
    if len(set(weights)) == 1:
        kind = torch.randint(3, (count,), generator=generator)
    else:
        kind = torch.multinomial(torch.tensor(weights, dtype=torch.float64), count, replacement=True, generator=generator)
    pair[kind == 1, 1] = -1
    pair[kind == 2, 1] = pair[kind == 2, 0]
    return pair


def play_demonstrations(
    env: DuplicatesEnv,
    protocol: ProofProtocol,
    lists: DuplicateLists,
    generator: torch.Generator,
    eos: int,
    verifier_accepts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    certificate_cells: Callable[[torch.Tensor], torch.Tensor],
    decoys: Callable[[int, int, torch.Generator], torch.Tensor],
) -> dict[str, TensorDictBase]:
    """Honest play on every list of ``lists``, as (prompt, message) pairs per agent, for a warm start.

    The scripted play that
    :meth:`~nip_like.scenarios.duplicates.scenario.DuplicatesScenario.demonstrations`
    describes, through the environment's public ``new_state``,
    ``policy_inputs``, ``scripted_replies`` and ``advance``
    (:func:`~nip_like.scenarios.scripted_play.record_scripted_play`).

    Parameters
    ----------
    env : DuplicatesEnv
        An environment of the game on ``lists`` (one episode wide: the lists are played all at once).
    protocol : ProofProtocol
        The game's protocol.
    lists : DuplicateLists
        The lists to play, each once.
    generator : torch.Generator
        Where every random draw comes from (the decoys, a lone verifier's opening).
    eos : int
        The game's ``<eos>`` token.
    verifier_accepts, certificate_cells, decoys : callable
        The scenario's hooks of these names: the verifier's decision in the
        ``cells`` view, the cells of an honest certificate and a prover's decoys.

    Returns
    -------
    dict of str to TensorDict
        For each agent with demonstrations: batch ``(E,)`` with
        ``"prompt_ids"``/``"prompt_mask"`` ``(E, P)`` and ``"tokens"``/``"token_mask"`` ``(E, T)``.

    Raises
    ------
    ConfigError
        If the environment's messages are shorter than 3 tokens (two cells and ``<eos>``).
    """
    if env.message_tokens < 3:
        raise ConfigError(
            f"demonstrations need messages of at least 3 tokens (two cells and <eos>); "
            f"scenario.default_agent.max_new_tokens is {env.message_tokens}"
        )
    count, ids = len(lists), env.ids
    state = env.new_state(count)
    state["list_index"] = torch.arange(count)
    state["values"], state["label"], state["certificate"] = lists.values, lists.label, lists.certificate
    state = start_episodes(state, protocol, generator)
    pad, tokens = ids["pad"], env.message_tokens
    alone = len(protocol.agent_names) == 1

    def scripted(state: TensorDictBase, active: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        action = torch.full((count, protocol.num_agents, tokens), pad, dtype=torch.int64)
        shown = torch.zeros_like(active)
        for index, name in enumerate(protocol.agent_names):
            if index == protocol.verifier_index:
                deciding = protocol.decision_round(state["round"])
                if env.verifier_view == "full":
                    proven = state["label"]
                else:
                    proven = verifier_accepts(state["values"], env.visible_cells(state)[:, index])
                decision = torch.where(proven, ids["accept"], ids["reject"])
                action[:, index, 0] = torch.where(deciding, decision, eos)
                action[:, index, 1] = torch.where(deciding, eos, pad)
                if alone:
                    # Without a prover (solo_opening), the verifier opens a random pair itself before deciding.
                    pair = torch.rand(count, env.length, generator=generator).argsort(-1)[:, :2]
                    opening = torch.cat([ids["cell0"] + pair, torch.full_like(pair[:, :1], eos)], -1)
                    action[:, index, :3] = torch.where(deciding.unsqueeze(-1), action[:, index, :3], opening)
                shown[:, index] = active[:, index]
            else:
                proves = protocol.prover_sides.get(name, True) & state["label"]
                certificate = certificate_cells(state["certificate"])
                message = decoys(count, env.length, generator)
                message[proves, 0] = certificate[proves, 0]
                message[proves, 1] = certificate[proves, 1]
                action[:, index, :2] = torch.where(message >= 0, ids["cell0"] + message, eos)
                action[:, index, 2] = torch.where(message[:, 1] >= 0, eos, pad)
                shown[:, index] = active[:, index] & proves
        # The moves as the agents would send them (in the chat view: text in their own tokens).
        replies, reply_mask = env.scripted_replies(torch.where(active.unsqueeze(-1), action, pad))
        return replies, reply_mask, shown

    return record_scripted_play(env, protocol, state, scripted)
