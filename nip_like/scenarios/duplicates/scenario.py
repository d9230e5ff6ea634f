"""The duplicates scenario: language-model agents argue whether a list holds two equal values.

The game without its agents (data, roles, the token environment) is
:mod:`~nip_like.scenarios.duplicates.game`, the agents' configs and models
:mod:`~nip_like.scenarios.duplicates.lm_agents`, and the warm start's honest
play :mod:`~nip_like.scenarios.duplicates.demonstrations`; this module holds the
scenario's config and registers the ``duplicates`` scenario. The names of these
modules that it held before stay importable from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDictBase

from nip_like import keys
from nip_like.allowed import checked
from nip_like.lm.models import LMAgentConfig
from nip_like.registry import register_scenario
from nip_like.scenarios.base import Demonstrating, TensorGame
from nip_like.scenarios.messaging import MessageFeatures, Messaging
from nip_like.scenarios.decisions import decision_metrics
from nip_like.scenarios.duplicates.chat_view import DuplicatesChatViewEnv
from nip_like.scenarios.duplicates.data import DuplicateLists
from nip_like.scenarios.duplicates.demonstrations import (
    DecoyWeights,
    check_decoy_weights,
    decoy_messages,
    equal_pair_seen,
    play_demonstrations,
)
from nip_like.scenarios.duplicates.environment import DuplicatesEnv
from nip_like.scenarios.duplicates.game import SPLITS, DuplicatesDataConfig, DuplicatesGame
from nip_like.scenarios.duplicates.lm_agents import DuplicatesLMAgents

__all__ = [
    "SPLITS",
    "VIEWS",
    "DecoyWeights",
    "DuplicatesConfig",
    "DuplicatesDataConfig",
    "DuplicatesGame",
    "DuplicatesScenario",
    "check_decoy_weights",
    "decoy_messages",
    "equal_pair_seen",
]

#: How language-model agents play: over the game's own symbols, or in chat through their tokenizer's template.
VIEWS = ("token", "chat")


@dataclass
class DuplicatesConfig(DuplicatesDataConfig):
    """The duplicates scenario (see :mod:`nip_like.scenarios.duplicates.environment`)."""

    agents: dict[str, Any] = field(default_factory=dict)  # per-agent LMAgentConfig entries; others use default_agent
    default_agent: LMAgentConfig = field(default_factory=LMAgentConfig)  # the language model of agents not in agents
    view: str = checked("token", choices=VIEWS)  # token (the game's symbols, tiny models) | chat (any chat model folder: its template, free-text replies)
    quote_tokens: int = checked(32, ge=1)  # chat: tokens of a reply shown to the agents that read it
    max_prompt_tokens: int = checked(0, ge=0)  # chat: prompt width; 0 = the longest prompt the game can produce
    decoys: DecoyWeights = field(default_factory=DecoyWeights)  # the verifier's demonstrations: mix of decoy kinds
    shared_base: bool = False  # every agent of the game (but frozen co-players and agents with their own share_base_with or share_policy_with) shares the frozen base of the protocol's first agent, each with its own LoRA adapters (share_base_with)


@register_scenario("duplicates", DuplicatesConfig)
class DuplicatesScenario(DuplicatesLMAgents, TensorGame, Demonstrating, Messaging):
    """Decide whether a list holds a duplicate pair, seeing only the cells that messages name.

    The agents are causal language models (one per agent, built from
    ``scenario.default_agent`` or ``scenario.agents.<name>``) sharing a
    word-level tokenizer of the game's symbols (``scenario.view=token``), or
    playing in chat through their own tokenizers (``scenario.view=chat``).
    """

    #: Version of :meth:`demonstrations` (part of the warm-start cache key): 3 = sound verifier, decoys
    #: named in a certificate's order.
    pretrain_data_version = 3

    def game_env(self, lists: DuplicateLists, game_ids: dict[str, int], common: dict[str, Any]) -> DuplicatesEnv:
        """The token game, or in the chat view the game rendered through each agent's chat template."""
        if not self.chat_view:
            return super().game_env(lists, game_ids, common)
        return DuplicatesChatViewEnv(
            self.protocol,
            lists,
            game_ids,
            self.chat_speakers,
            num_values=self.symbols.num_values,
            reply_tokens=self.message_tokens,
            quote_tokens=int(self.config.quote_tokens),
            prompt_tokens=int(self.config.max_prompt_tokens),
            list_format=self.config.list_format,
            **common,
        )

    def preflight(self) -> None:
        """Check the decoy weights, each agent's model folder (and, in the chat view, its chat template) and its sizes, without weights."""
        decoys = self.config.decoys
        check_decoy_weights((float(decoys.pair), float(decoys.alone), float(decoys.twice)))
        super().preflight()

    # ----------------------------------------------------------------- metrics
    def policy_metrics(self, batch: TensorDictBase) -> dict[str, float]:
        """Each agent's mean message length (tokens, ``<eos>`` included) and share of messages cut at the limit."""
        active = batch.get(keys.ACTIVE_KEY)
        mask = batch.get(keys.TOKEN_MASK_KEY)
        action = batch.get(keys.ACTION_KEY)
        # A message ended (was not cut) if it holds its agent's eos token or stops before the limit.
        eos = torch.tensor(self.end_token_ids(), device=action.device).view(-1, 1)
        finished = ((action == eos) & mask).any(-1) | ~mask.all(-1)
        metrics = {}
        for index, name in enumerate(self.agent_names):
            acted = active[..., index]
            if bool(acted.any()):
                metrics[f"agents/{name}/policy/message_tokens"] = mask[..., index, :][acted].sum(-1).float().mean().item()
                metrics[f"agents/{name}/policy/cut_messages"] = (~finished[..., index][acted]).float().mean().item()
        return metrics

    def episode_metrics(self, episodes: TensorDictBase) -> dict[str, float]:
        """Verifier accuracy, decision rate, precision, recall, length, and each prover's certificate rate.

        ``decided``: share of episodes that ended with a decision (the rest
        ran out of turns: wrong). ``agents/<prover>/certificates``: share of
        the positive lists on which the prover named the duplicate pair.
        """
        metrics = super().episode_metrics(episodes)
        state = episodes.get("state")
        metrics.update(decision_metrics(state["decision"], state["label"], state["list_index"]))
        metrics["decided"] = (state["decision"] >= 0).float().mean().item()
        metrics["episode_length"] = state["round"].float().mean().item()
        positive = state["label"]
        if bool(positive.any()):
            certificate = state["certificate"][positive].clamp(min=0)  # (E+, 2)
            revealed = state["revealed"][positive]  # (E+, N, L)
            index = certificate.unsqueeze(1).expand(-1, revealed.shape[1], 2)
            named = revealed.gather(-1, index).all(-1)  # (E+, N)
            for agent, name in enumerate(self.agent_names):
                if agent != self.protocol.verifier_index:
                    metrics[f"agents/{name}/certificates"] = named[:, agent].float().mean().item()
        return metrics

    def transcripts(self, episodes: TensorDictBase, limit: int) -> list[dict]:
        """The dialogues of up to ``limit`` episodes, as text (see :meth:`Scenario.transcripts`).

        Each record: ``list_index``, ``values``, ``label``, ``certificate``,
        ``turns`` (each message with its round, speaker, text and the cells it
        revealed with their values), ``decision`` (``accept``, ``reject`` or
        ``none``), ``correct`` and each agent's ``rewards`` (episode return).
        """
        state = episodes.get("state")[:limit].cpu()
        returns = episodes.get(keys.EPISODE_RETURN_KEY)[:limit].squeeze(-1).cpu()
        pad = self.tokenizer.pad_token_id
        names, first, second = (part.cpu() for part in self.parse_messages(state["messages"]))
        records = []
        for episode in range(state.batch_size[0]):
            values = state["values"][episode]
            turns = []
            for round_index in range(state["messages"].shape[1]):
                for agent, name in enumerate(self.agent_names):
                    message = state["messages"][episode, round_index, agent]
                    if self.chat_view:
                        length = int(state["reply_length"][episode, round_index, agent])
                        if length < 0:
                            continue
                        reply = state["replies"][episode, round_index, agent, :length].tolist()
                        text = self.chat_speakers[agent].tokenizer.decode(reply, skip_special_tokens=True)
                    elif bool((message == pad).all()):
                        continue
                    else:
                        text = " ".join(self.tokenizer.convert_ids_to_tokens(message[message != pad].tolist()))
                    revealed = []
                    if bool(names[episode, round_index, agent]):
                        cells = (int(first[episode, round_index, agent]), int(second[episode, round_index, agent]))
                        revealed = [[cell, int(values[cell])] for cell in cells]
                    turns.append({"round": round_index, "agent": name, "message": text, "revealed": revealed})
            decision = int(state["decision"][episode])
            label = bool(state["label"][episode])
            records.append(
                {
                    "list_index": int(state["list_index"][episode]),
                    "values": values.tolist(),
                    "label": label,
                    "certificate": state["certificate"][episode].tolist(),
                    "turns": turns,
                    "decision": {1: "accept", 0: "reject"}.get(decision, "none"),
                    "correct": decision >= 0 and bool(decision) == label,
                    "rewards": {name: float(returns[episode, agent]) for agent, name in enumerate(self.agent_names)},
                }
            )
        return records

    # ---------------------------------------------------------------- messages
    def message_features(self, episodes: TensorDictBase, policy: Any) -> list[MessageFeatures]:
        """Each prover's messages of every round as the tokens it sampled, with its model's input embedding.

        The token view's messages are in the game's vocabulary; the chat
        view's replies in the prover's own (``E, R * T`` tokens, a mask of
        the real ones).
        """
        state = episodes.get("state")
        features = []
        for agent, name in enumerate(self.agent_names):
            if agent == self.protocol.verifier_index:
                continue
            if self.chat_view:
                tokens = state["replies"][:, :, agent]
                width = torch.arange(tokens.shape[-1], device=tokens.device)
                mask = width < state["reply_length"][:, :, agent].unsqueeze(-1)
            else:
                tokens = state["messages"][:, :, agent]
                mask = tokens != self.tokenizer.pad_token_id
            embedding = policy.policy(name).model.get_input_embeddings()
            features.append(MessageFeatures(name, "tokens", tokens.flatten(1), mask.flatten(1), embedding))
        return features

    # ------------------------------------------------------ demonstrations
    def verifier_accepts(self, values: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        """The sound decision rule the verifier's demonstrations follow in the ``cells`` view: ``(B,)`` bool.

        The contract: accept only when the ``seen`` cells ``(B, L)`` of the
        lists ``values`` ``(B, L)`` prove the claim (sound: no decoy can make
        it accept a negative list), and whenever they hold the cells of the
        honest certificate (:meth:`certificate_cells`; complete). By default:
        two distinct seen cells hold equal values
        (:func:`~nip_like.scenarios.duplicates.demonstrations.equal_pair_seen`).
        In the ``full`` view the verifier reads the whole list and is shown the label.
        """
        return equal_pair_seen(values, seen)

    def decoys(self, count: int, length: int, generator: torch.Generator) -> torch.Tensor:
        """``(count, 2)`` cells of the messages a prover sends when it has no certificate to give.

        The contract: cells in ``0 .. length-1``, a second entry of ``-1``
        for a message that names one cell alone; draw only from
        ``generator``. Good decoys look like certificates in every way but
        the values (the verifier's demonstrations teach it to reject them),
        so that it learns to check the values, not a shortcut. By default
        :func:`~nip_like.scenarios.duplicates.demonstrations.decoy_messages`
        with the weights of ``scenario.decoys``.
        """
        weights = self.config.decoys
        return decoy_messages(count, length, generator, (weights.pair, weights.alone, weights.twice))

    def certificate_cells(self, certificate: torch.Tensor) -> torch.Tensor:
        """``(B, 2)`` cells an honest prover names, in order, for the datasets' ``certificate`` ``(B, 2)`` of positive lists.

        By default the later cell first (``c<j> c<i>`` for ``i < j``: a causal
        model reading cell ``j`` has already seen cell ``i``).
        """
        return certificate.clamp(min=0).flip(-1)

    def demonstration_agents(self) -> list[str]:
        """The agents :meth:`demonstrations` gives messages for: the verifier and the accept-side provers."""
        return [
            name
            for index, name in enumerate(self.agent_names)
            if index == self.protocol.verifier_index or self.protocol.prover_sides.get(name, True)
        ]

    def demonstrations(self, split: str, seed: int = 0) -> dict[str, TensorDictBase]:
        """Honest play on every list of ``split``, as (prompt, message) pairs per agent, for a warm start.

        The scripted play: a prover arguing for *accept* names the cells of
        :meth:`certificate_cells` of a positive list (the duplicate pair, the
        later cell first: ``c<j> c<i> <eos>``); on a negative list, and
        always for a prover arguing for *reject*, it sends one of
        :meth:`decoys` (by default a random pair, the later cell first, as in
        a certificate, so that the order of the names tells the verifier
        nothing, one cell alone, or one cell twice, drawn with the weights of
        ``scenario.decoys``). The verifier passes (the empty message
        ``<eos>``) before its last turn and then decides as a sound verifier
        does: in the ``cells`` view it says ``accept <eos>`` exactly when
        :meth:`verifier_accepts` the cells it has seen (by default: two of
        them hold equal values), so decoys and lone cells are rejected
        whatever the label; in the ``full`` view it decides by the label (it
        reads the whole list). Every list is played once
        (:func:`~nip_like.scenarios.duplicates.demonstrations.play_demonstrations`),
        through the environment's own prompts and rules (its public ``new_state``,
        ``policy_inputs``, ``scripted_replies`` and ``advance``), so a subclass
        that overrides these hooks never copies this method.

        Returns
        -------
        dict of str to TensorDict
            For each agent with demonstrations (the verifier on every list, an
            accept-side prover on the positive lists, a reject-side prover on
            none: it has no certificate to give):
            batch ``(E,)`` with ``"prompt_ids"``/``"prompt_mask"`` ``(E, P)``
            and ``"tokens"``/``"token_mask"`` ``(E, T)``.
        """
        env = self.make_env(1, split, 0, "cpu")
        return play_demonstrations(
            env,
            self.protocol,
            self.split(split),
            torch.Generator().manual_seed(seed),
            self.tokenizer.eos_token_id,
            verifier_accepts=self.verifier_accepts,
            certificate_cells=self.certificate_cells,
            decoys=self.decoys,
        )
