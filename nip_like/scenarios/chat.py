"""The chat-game capability: what the text trainers need of a scenario.

A :class:`ChatGame` is played by text agents (:mod:`nip_like.text`): each agent
belongs to a model group (agents of one group share a text model and its
fine-tune jobs), reads the game as a chat and answers in free text, which the
scenario parses into a move of its environment. The text rollouts
(:func:`~nip_like.text.rollouts.play_episodes`) play it through the
scenario's own environment (:meth:`~nip_like.scenarios.base.Scenario.make_env`),
so rules, rewards and data are those of the environment.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import ClassVar

import torch

from nip_like.scenarios.base import Scenario
from nip_like.text.interface import Chat, TextModel, TextModelConfig


class ChatGame(Scenario):
    """Capability: text agents play the game in chat (the text trainers' scenarios).

    A subclass gives the model groups and their models, the scripted players,
    the chat each agent reads, how a reply becomes a move, and the words of the
    verifier's decisions.
    """

    provides: ClassVar[str] = "text agents in chat"

    #: The verifier's reply that accepts (what a label of True teaches it to say).
    accept_word: ClassVar[str] = "accept"
    #: The verifier's reply that rejects.
    reject_word: ClassVar[str] = "reject"

    # ------------------------------------------------------------ groups
    @abstractmethod
    def groups(self) -> dict[str, str]:
        """Each agent's model group, by agent name."""

    def group_names(self) -> list[str]:
        """The model groups, in the order of their first agent."""
        return list(dict.fromkeys(self.groups().values()))

    @abstractmethod
    def model_config(self, group: str) -> TextModelConfig:
        """The text model of ``group``: where it runs, what it starts from, how it samples."""

    @abstractmethod
    def scripted_player(self, agent: str) -> TextModel:
        """The honest scripted player of ``agent`` (a warm start's teacher)."""

    @abstractmethod
    def scripted_model(self, group: str) -> TextModel:
        """The scripted player of ``group`` (its model config's ``backend: scripted``)."""

    # -------------------------------------------------------------- chat
    def make_text_env(self, num_envs: int, split: str, seed: int, device: torch.device | str, group_size: int = 1):
        """The environment text agents play through (:func:`~nip_like.text.rollouts.play_episodes`).

        By default the scenario's own :meth:`~nip_like.scenarios.base.Scenario.make_env`;
        a scenario whose ``make_env`` is its language-model agents' view
        (prompts in their tokens) returns the game that takes the moves of
        :meth:`encode_actions` instead.
        """
        return self.make_env(num_envs, split, seed, device, group_size=group_size)

    @property
    @abstractmethod
    def tokenizer(self):
        """The tokenizer of the environment's moves (its pad token fills an agent's unused move)."""

    @abstractmethod
    def render_chat(
        self, env, state, visible_cells: torch.Tensor, episode: int, agent: int, replies: list[list[str | None]]
    ) -> Chat:
        """The chat that agent ``agent`` reads in ``episode`` of the environment's ``state``.

        Parameters
        ----------
        env
            The environment being played.
        state : TensorDict
            The environment's ``"state"``.
        visible_cells : torch.Tensor
            ``env.visible_cells(state)``: what each agent sees of each episode's datapoint.
        episode, agent : int
            Which episode and agent.
        replies : list of list of str or None
            The episode's replies so far, ``[round][agent]`` (``None``: no turn).
        """

    @abstractmethod
    def reply_action(self, reply: str, agent: int) -> tuple[list[str], str]:
        """The move a reply of agent ``agent`` makes, as tokens of :attr:`tokenizer`, and what it is in words."""

    @abstractmethod
    def encode_actions(self, moves: list[list[str]]) -> torch.Tensor:
        """The moves of :meth:`reply_action` as the environment's action ids, one row each."""
