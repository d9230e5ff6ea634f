"""REINFORCE: returns-to-go in closed form, layout and baseline."""

import pytest
import torch

from nip_like.objectives.reinforce import MultiAgentReinforceLoss, returns_to_go
from tests.test_grpo import rollout


def test_returns_to_go_closed_form():
    reward = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    done = torch.tensor([[False, True, False, False]])
    returns = returns_to_go(reward, done, gamma=0.5)
    assert returns.tolist() == [[1.0 + 0.5 * 2.0, 2.0, 3.0 + 0.5 * 4.0, 4.0]]


@pytest.mark.parametrize("baseline", [True, False])
def test_loss_terms_and_layout(baseline):
    agents, batch = rollout(num_envs=4, steps=7, group_size=1)
    loss = MultiAgentReinforceLoss(
        agents.policy, agents.value if baseline else None, agents.agent_names, gamma=1.0, normalize_advantage=False
    )
    steps = loss.layout_rollouts(batch)
    assert steps.batch_size == (4 * 6,)
    # With gamma 1 and a single final reward, every step's return is the episode's return.
    ends = steps["next", "done"].squeeze(-1)
    torch.testing.assert_close(
        steps["agents", "return"].view(8, 3, 2, 1)[:, 0], steps["next", "agents", "episode_return"][ends]
    )
    out = loss(steps)
    assert ("loss_critic" in out.keys()) == baseline
    if not baseline:
        dist = agents.policy.get_dist(steps.clone())
        log_prob = dist.log_prob(steps["agents", "action"])
        active = steps["agents", "active"]
        returns = steps["agents", "return"].squeeze(-1)
        expected = sum(-(log_prob * returns)[:, a][active[:, a]].mean() for a in range(2))
        torch.testing.assert_close(out["loss_objective"], expected)
