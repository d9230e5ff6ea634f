"""The matrix-game scenario: a payoff table, and policies whose parameters are the logits.

The small games on which learning-aware trainers have known behaviour
(matching pennies, Stackelberg games) played through the normal loop. Each
player's policy is a table of logits, so its parameters are its mixed
strategy: with ``policy: sigmoid`` a two-action player has one parameter
``theta`` and plays its first action with probability ``sigmoid(theta)``, the
parametrisation of Letcher et al. (2019) and Foerster et al. (2018); with
``policy: softmax`` it has one logit per action. The value network of each
player is one learned number (there is one state).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from omegaconf import OmegaConf
from tensordict import TensorDictBase
from torch import nn

from nip_like.agent_modules import AgentModules, PerAgent, actor_critic_from_networks
from nip_like.allowed import checked
from nip_like.errors import ConfigError
from nip_like.keys import ACTION_MASK_KEY, LOGITS_KEY, OBSERVATION_KEY
from nip_like.protocols.matrix_game import PLAYERS
from nip_like.registry import register_scenario
from nip_like.scenarios.base import ScenarioConfig, TensorGame
from nip_like.scenarios.matrix_game.environment import MatrixGameEnv

#: Matching pennies: the row player wins when the coins match, the column player when they differ.
MATCHING_PENNIES = [[[1.0, -1.0], [-1.0, 1.0]], [[-1.0, 1.0], [1.0, -1.0]]]
#: Parametrisations of a player's policy.
POLICIES = ("sigmoid", "softmax")


@dataclass
class MatrixGameConfig(ScenarioConfig):
    """A one-shot two-player game given by its payoff table (see :mod:`nip_like.scenarios.matrix_game`)."""

    name: str = "matrix_game"  # scenario name
    payoffs: list[Any] = field(default_factory=lambda: MATCHING_PENNIES)  # payoffs[row action][column action] = [row payoff, column payoff]; default matching pennies
    policy: str = checked("sigmoid", choices=POLICIES)  # sigmoid (two actions, one parameter each) | softmax (one logit per action)
    initial_logits: dict[str, list[float]] = field(default_factory=lambda: {"row": [], "column": []})  # per player, its parameters at the start (sigmoid: [theta]); [] = zeros


class LogitTable(nn.Module):
    """A policy with no input: its parameters are its logits.

    Parameters
    ----------
    num_actions : int
        The player's actions.
    width : int
        The width of the shared action space (logits beyond ``num_actions``
        are 0 and masked out by the environment).
    sigmoid : bool
        One parameter ``theta`` for two actions, logits ``(theta, 0)``, so that
        the first action has probability ``sigmoid(theta)``.
    initial : list of float, optional
        The parameters at the start (zeros by default).
    """

    def __init__(self, num_actions: int, width: int, sigmoid: bool, initial: list[float] | None = None) -> None:
        super().__init__()
        size = 1 if sigmoid else num_actions
        start = torch.zeros(size) if initial is None else torch.tensor(initial, dtype=torch.float32)
        self.theta = nn.Parameter(start)
        self.sigmoid = sigmoid
        self.width = width

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        logits = torch.cat([self.theta, self.theta.new_zeros(self.width - self.theta.numel())])
        return logits.expand(*observation.shape[:-1], self.width)


class ConstantValue(nn.Module):
    """A value network for a game with one state: one learned number."""

    def __init__(self) -> None:
        super().__init__()
        self.value = nn.Parameter(torch.zeros(1))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.value.expand(*observation.shape[:-1], 1)


@register_scenario("matrix_game", MatrixGameConfig)
class MatrixGameScenario(TensorGame):
    """A one-shot two-player game from a payoff table; the policies' parameters are their logits.

    Needs the ``matrix_game`` protocol (two players acting at once, once).
    """

    def __init__(self, config, protocol) -> None:
        super().__init__(config, protocol)
        if tuple(protocol.agent_names) != PLAYERS or protocol.num_rounds != 1:
            raise ConfigError(
                f"scenario matrix_game needs protocol matrix_game (players {list(PLAYERS)}, one round), "
                f"got {protocol.name!r}"
            )
        payoffs = OmegaConf.to_container(config.payoffs) if not isinstance(config.payoffs, list) else config.payoffs
        try:
            self.payoffs = torch.tensor(payoffs, dtype=torch.float32)
        except (TypeError, ValueError) as error:
            raise ConfigError(f"scenario.payoffs must be a table [row action][column action][player]: {error}") from error
        if self.payoffs.ndim != 3 or self.payoffs.shape[-1] != 2 or min(self.payoffs.shape[:2]) < 2:
            raise ConfigError(
                "scenario.payoffs must have shape (row actions >= 2, column actions >= 2, 2 players), "
                f"got {tuple(self.payoffs.shape)}"
            )
        if not torch.isfinite(self.payoffs).all():
            raise ConfigError("scenario.payoffs must be finite numbers")
        if config.policy == "sigmoid" and tuple(self.payoffs.shape[:2]) != (2, 2):
            raise ConfigError(
                f"scenario.policy=sigmoid needs two actions per player, got a {tuple(self.payoffs.shape[:2])} table; "
                "use scenario.policy=softmax"
            )
        unknown = sorted(set(config.initial_logits) - set(PLAYERS))
        if unknown:
            raise ConfigError(f"scenario.initial_logits names {unknown}; the players are {list(PLAYERS)}")
        for index, name in enumerate(PLAYERS):
            given = config.initial_logits.get(name)
            size = 1 if config.policy == "sigmoid" else int(self.payoffs.shape[index])
            if given and len(given) != size:
                raise ConfigError(
                    f"scenario.initial_logits.{name} needs {size} number(s) for policy {config.policy}, got {len(given)}"
                )

    def make_env(
        self, num_envs: int, split: str, seed: int, device: torch.device | str, group_size: int = 1
    ) -> MatrixGameEnv:
        return MatrixGameEnv(self.protocol, num_envs, self.payoffs, device=device, seed=seed, group_size=group_size)

    def make_agents(self) -> AgentModules:
        width = int(max(self.payoffs.shape[:2]))
        sigmoid = self.config.policy == "sigmoid"
        policies, values = {}, {}
        for index, name in enumerate(PLAYERS):
            initial = self.config.initial_logits.get(name)
            initial = [float(value) for value in initial] if initial else None
            policies[name] = LogitTable(int(self.payoffs.shape[index]), width, sigmoid, initial)
            values[name] = ConstantValue()
        return actor_critic_from_networks(PLAYERS, PerAgent(policies), PerAgent(values), [OBSERVATION_KEY])

    def expected_payoffs(self, strategies: dict[str, torch.Tensor]) -> torch.Tensor:
        """Each player's expected payoff ``(2,)`` when they play the mixed ``strategies`` (by player name)."""
        row, column = strategies["row"], strategies["column"]
        return torch.einsum("i,j,ijk->k", row, column, self.payoffs.to(row))

    @staticmethod
    def strategies(batch: TensorDictBase) -> dict[str, torch.Tensor]:
        """Each player's mixed strategy, from the policy's logits in ``batch`` (its first row)."""
        logits, mask = batch.get(LOGITS_KEY), batch.get(ACTION_MASK_KEY)
        logits, mask = logits.reshape(-1, *logits.shape[-2:])[0], mask.reshape(-1, *mask.shape[-2:])[0]
        probabilities = torch.where(mask, logits, -torch.inf).softmax(-1)
        return {name: probabilities[index][mask[index]] for index, name in enumerate(PLAYERS)}

    def policy_metrics(self, batch: TensorDictBase) -> dict[str, float]:
        """Each player's probability of each action, ``agents/<player>/policy/prob_<action>``."""
        metrics = {}
        for name, strategy in self.strategies(batch).items():
            for action, probability in enumerate(strategy.tolist()):
                metrics[f"agents/{name}/policy/prob_{action}"] = probability
        return metrics
