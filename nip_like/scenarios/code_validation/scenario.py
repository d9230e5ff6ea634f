"""The code-validation scenario: is a Python program a correct solution of its problem? Agents argue in chat.

The verifier reads a problem and a program and must accept the program if it
passes every hidden test of the problem, reject it otherwise; provers argue
for one side. One scenario, ``scenario=code_validation``, for both kinds of
agents:

* text agents (the text trainers, ``trainer=expert_iteration`` and
  ``trainer=malt``): text models in this process or behind an
  OpenAI-compatible server, grouped by ``scenario.agent_groups``, set by
  ``scenario.default_model`` and ``scenario.models.<group>``
  (:mod:`~nip_like.scenarios.code_validation.text_agents`);
* language-model agents in the RL loop's chat view (every RL trainer): one
  causal LM per agent from a local model folder, LoRA or full fine-tuning,
  set by ``scenario.default_agent`` and ``scenario.agents.<name>``
  (:class:`~nip_like.scenarios.lm_agents.LMAgents`,
  :mod:`~nip_like.scenarios.code_validation.chat_view`), warm-started on the
  scripted players' play (:mod:`~nip_like.scenarios.code_validation.demonstrations`).

Both read the same chats and are parsed by the same rule
(:mod:`~nip_like.scenarios.code_validation.chat_text`); the data, splits,
protocols and rewards are the game's
(:mod:`~nip_like.scenarios.code_validation.game`). ``docs/code_validation.rst``
is the guide.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
from tensordict import TensorDictBase

from nip_like import keys
from nip_like.allowed import checked
from nip_like.lm.models import LMAgentConfig
from nip_like.registry import register_scenario
from nip_like.scenarios.base import Demonstrating, TensorGame
from nip_like.scenarios.chat_prompts import ChatSpeaker
from nip_like.scenarios.code_validation.chat_view import CodeValidationChatViewEnv
from nip_like.scenarios.code_validation.demonstrations import play_demonstrations
from nip_like.scenarios.code_validation.game import CodeValidationDataConfig
from nip_like.scenarios.code_validation.text_agents import CodeValidationTextAgents
from nip_like.scenarios.decisions import decision_metrics
from nip_like.scenarios.lm_agents import LMAgents
from nip_like.text.interface import TextModelConfig

__all__ = ["CodeValidationConfig", "CodeValidationScenario"]


@dataclass
class CodeValidationConfig(CodeValidationDataConfig):
    """The code-validation scenario (see :mod:`nip_like.scenarios.code_validation.scenario`)."""

    default_model: TextModelConfig = field(default_factory=lambda: TextModelConfig(max_new_tokens=64))  # text trainers: the text model of groups not in models
    models: dict[str, Any] = field(default_factory=dict)  # text trainers: per-group TextModelConfig entries: {verifier: {path: /models/qwen}}
    agent_groups: dict[str, str] = field(default_factory=dict)  # text trainers: agent -> model group; agents not named form a group of their own
    scripted_provers: bool = False  # text trainers: every prover is the honest scripted player (backend scripted), whatever the protocol
    default_agent: LMAgentConfig = field(default_factory=lambda: LMAgentConfig(max_new_tokens=64))  # RL trainers: the language model of agents not in agents (chat view)
    agents: dict[str, Any] = field(default_factory=dict)  # RL trainers: per-agent LMAgentConfig entries; others use default_agent
    quote_tokens: int = checked(64, ge=1)  # RL trainers: tokens of a reply shown to the agents that read it
    max_prompt_tokens: int = checked(0, ge=0)  # RL trainers: prompt width; 0 = the longest prompt the game can produce on its data
    shared_base: bool = False  # RL trainers: every agent shares the frozen base of the protocol's first agent, each with its own LoRA adapters (share_base_with)


@register_scenario("code_validation", CodeValidationConfig)
class CodeValidationScenario(CodeValidationTextAgents, LMAgents, TensorGame, Demonstrating):
    """Decide whether a program solves its problem, hearing provers argue (see the module docstring).

    Text agents play the move game
    (:meth:`~nip_like.scenarios.code_validation.game.CodeValidationGame.make_text_env`);
    language-model agents play the chat view (:meth:`make_env`), warm-started
    on the scripted players' replies (:meth:`demonstrations`, ``trainer.pretrain``).
    """

    #: Version of :meth:`demonstrations` (part of the warm-start cache key): 1 = the scripted players' replies.
    pretrain_data_version = 1

    @property
    def chat_view(self) -> bool:
        """Always: the language-model agents of this game play in chat (it has no token view)."""
        return True

    def preflight(self) -> None:
        """Check the data file, each language-model agent's folder and chat template, and each local text model's."""
        super().preflight()
        self.text_preflight()

    @cached_property
    def last_turn_speaker(self) -> ChatSpeaker:
        """The verifier on its last turn in the chat view: its tokenizer, its system prompt with the notice to decide."""
        verifier = self.chat_speakers[self.protocol.verifier_index]
        return ChatSpeaker(verifier.name, verifier.tokenizer, self.last_turn_prompt())

    def make_env(
        self, num_envs: int, split: str, seed: int, device: torch.device | str, group_size: int = 1
    ) -> CodeValidationChatViewEnv:
        """The chat view of ``split`` for language-model agents (prompts through each agent's chat template)."""
        data = self.split(split)
        env = CodeValidationChatViewEnv(
            self.protocol,
            data.label,
            self.datapoint_texts(split),
            self.move_ids(),
            self.chat_speakers,
            self.last_turn_speaker,
            reply_tokens=self.message_tokens,
            quote_tokens=int(self.config.quote_tokens),
            prompt_tokens=int(self.config.max_prompt_tokens),
            width_texts=self.all_datapoint_texts(),
            num_envs=num_envs,
            device=device,
            seed=seed,
            group_size=group_size,
        )
        self.check_lengths(env.prompt_length)
        return env

    # ------------------------------------------------------ demonstrations
    def demonstration_agents(self) -> list[str]:
        """The agents :meth:`demonstrations` gives replies for: every agent of the protocol."""
        return list(self.agent_names)

    def demonstrations(self, split: str, seed: int = 0) -> dict[str, TensorDictBase]:
        """The scripted players' play on every program of ``split``, as (prompt, reply) pairs per agent, for a warm start.

        Every program is played once through the chat view (:meth:`make_env`)
        by the honest scripted players (:meth:`scripted_player`): the verifier
        asks one question while it may (before it has read a reply, and not
        on its last turn), then writes ``Decision: accept`` or ``Decision: reject``
        by the program's label; a prover says its side's sentence. Each
        agent's prompt at each of its turns is the one the environment gives
        the policy (its chat through its own template); its reply is the
        scripted reply's text in its own tokens followed by its eos token,
        cut to its ``max_new_tokens``, and the environment plays these very
        tokens (:func:`~nip_like.scenarios.code_validation.demonstrations.play_demonstrations`).
        ``seed`` draws the protocol's own state (Merlin-Arthur's speaking prover).

        Returns
        -------
        dict of str to TensorDict
            For each agent with a turn: batch ``(E,)`` with ``"prompt_ids"``/``"prompt_mask"``
            ``(E, P)`` and ``"tokens"``/``"token_mask"`` ``(E, T)``.

        Raises
        ------
        ConfigError
            If a scripted reply has more tokens than its agent's ``max_new_tokens``.
        """
        configs = self.agent_configs()
        return play_demonstrations(
            self.make_env(1, split, 0, "cpu"),
            self.protocol,
            {name: self.scripted_player(name) for name in self.agent_names},
            self.render_chat,
            {name: (int(configs[name].max_new_tokens), self.agent_config_path(name)) for name in self.agent_names},
            torch.Generator().manual_seed(seed),
        )

    # ----------------------------------------------------------------- metrics
    def policy_metrics(self, batch: TensorDictBase) -> dict[str, float]:
        """Each agent's mean reply length (tokens, the end token included) and share of replies cut at the limit."""
        return self.message_metrics(batch)

    def episode_metrics(self, episodes: TensorDictBase) -> dict[str, float]:
        """Verifier accuracy, precision, recall, decision rate and episode length (an undecided episode is wrong).

        ``decided``: share of episodes that ended with a decision (the rest ran
        out of turns).
        """
        metrics = super().episode_metrics(episodes)
        state = episodes.get("state")
        metrics.update(decision_metrics(state["decision"], state["label"], state["list_index"]))
        metrics["decided"] = (state["decision"] >= 0).float().mean().item()
        metrics["episode_length"] = state["round"].float().mean().item()
        return metrics

    def transcripts(self, episodes: TensorDictBase, limit: int) -> list[dict]:
        """The dialogues of up to ``limit`` episodes, as text (see :meth:`Scenario.transcripts <nip_like.scenarios.base.Scenario.transcripts>`).

        Each record: ``list_index`` (the program's index in the split played),
        ``label``, ``turns`` (each reply with its round, speaker, text and what
        it did), ``decision`` (``accept``, ``reject`` or ``none``), ``correct``
        and each agent's ``rewards`` (episode return).
        """
        state = episodes.get("state")[:limit].cpu()
        returns = episodes.get(keys.EPISODE_RETURN_KEY)[:limit].squeeze(-1).cpu()
        words = {index: symbol for symbol, index in self.move_ids().items() if symbol != "pad"}
        records = []
        for episode in range(state.batch_size[0]):
            turns = []
            for round_index in range(state["moves"].shape[1]):
                for agent, name in enumerate(self.agent_names):
                    length = int(state["reply_length"][episode, round_index, agent])
                    if length < 0:
                        continue
                    reply = state["replies"][episode, round_index, agent, :length].tolist()
                    text = self.chat_speakers[agent].tokenizer.decode(reply, skip_special_tokens=True)
                    move = words.get(int(state["moves"][episode, round_index, agent]), "none")
                    turns.append({"round": round_index, "agent": name, "message": text, "move": move})
            index, decision, label = int(state["list_index"][episode]), int(state["decision"][episode]), bool(state["label"][episode])
            records.append(
                {
                    "list_index": index,
                    "label": label,
                    "turns": turns,
                    "decision": {1: "accept", 0: "reject"}.get(decision, "none"),
                    "correct": decision >= 0 and bool(decision) == label,
                    "rewards": {name: float(returns[episode, agent]) for agent, name in enumerate(self.agent_names)},
                }
            )
        return records
