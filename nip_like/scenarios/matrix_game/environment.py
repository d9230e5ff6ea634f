"""The matrix-game environment: one round in which both players act at once.

Each episode is one simultaneous move. The row player chooses a row of the
payoff table, the column player a column, and each gets its own entry of the
chosen cell. Nothing is hidden and nothing is observed: each player's
observation is a single constant feature, so a policy is a distribution over
its actions (a mixed strategy).
"""

from __future__ import annotations

import torch
from tensordict import TensorDict, TensorDictBase

from nip_like.protocols.base import Protocol
from nip_like.scenarios.environment import InteractionEnv


class MatrixGameEnv(InteractionEnv):
    """Vectorised one-shot matrix game (see the module docstring).

    Parameters
    ----------
    protocol : Protocol
        Two agents acting in one round (:class:`~nip_like.protocols.matrix_game.MatrixGameProtocol`).
    num_envs : int
        Number of parallel episodes.
    payoffs : torch.Tensor
        ``(row actions, column actions, 2)``: the row and column players'
        payoffs of each cell.
    device : torch.device or str
        Where the tensors live.
    seed : int
        Seed of the environment's generator (the game draws nothing).
    group_size : int
        Consecutive environments grouped as one datapoint (every episode is the same game).
    """

    def __init__(
        self,
        protocol: Protocol,
        num_envs: int,
        payoffs: torch.Tensor,
        device: torch.device | str = "cpu",
        seed: int = 0,
        group_size: int = 1,
    ) -> None:
        self.payoffs = payoffs.to(device=device, dtype=torch.float32)
        self.num_player_actions = tuple(self.payoffs.shape[:2])
        super().__init__(
            protocol,
            num_envs=num_envs,
            num_actions=max(self.num_player_actions),
            observation_size=1,
            device=device,
            seed=seed,
            group_size=group_size,
        )
        self._action_mask = torch.stack(
            [torch.arange(self.num_actions, device=self.device) < count for count in self.num_player_actions]
        )

    def _state_spec(self) -> dict[str, object]:
        return {}

    def _new_state(self, num_episodes: int) -> TensorDict:
        return TensorDict({}, batch_size=[num_episodes])

    def _observe(self, state: TensorDictBase) -> tuple[torch.Tensor, torch.Tensor]:
        batch = state.batch_size[0]
        observation = torch.ones(batch, self.num_agents, 1, device=self.device)
        return observation, self._action_mask.unsqueeze(0).expand(batch, -1, -1).clone()

    def _advance(
        self, state: TensorDictBase, action: torch.Tensor, active: torch.Tensor
    ) -> tuple[TensorDictBase, torch.Tensor, torch.Tensor]:
        # Illegal actions (only a policy that ignores the mask takes them) fold back into range.
        row = action[:, 0] % self.num_player_actions[0]
        column = action[:, 1] % self.num_player_actions[1]
        reward = self.payoffs[row, column]
        return state, reward, torch.zeros(action.shape[0], dtype=torch.bool, device=self.device)
