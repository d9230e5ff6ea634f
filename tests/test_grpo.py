"""GRPO: group-relative advantages on hand-built tensors, the layout, the loss."""

import pytest
import torch
from torchrl.envs.utils import ExplorationType, set_exploration_type

from nip_like.errors import ConfigError
from nip_like.experiment import build_trainer
from nip_like.objectives.episodes import episode_ids, group_relative
from nip_like.objectives.grpo import GRPOLoss
from nip_like.objectives.reference import ReferencePolicy
from tests.conftest import smoke_config
from tests.test_environment import make_scenario


def test_group_relative_closed_form_and_edge_cases():
    returns = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 0.0], [5.0, 2.0], [3.0, 2.0]])
    groups = torch.tensor([7, 7, 7, 9, 4])
    out = group_relative(returns, groups)
    # Group 7, agent 0: mean 2/3, sample std sqrt(1/3).
    std = (1 / 3) ** 0.5
    assert out[:3, 0].tolist() == pytest.approx([(1 - 2 / 3) / std, (0 - 2 / 3) / std, (1 - 2 / 3) / std])
    assert out[:3, 1].tolist() == [0.0, 0.0, 0.0]  # no spread
    assert out[3:].tolist() == [[0.0, 0.0], [0.0, 0.0]]  # groups of one
    assert torch.isfinite(out).all()
    pair = group_relative(torch.tensor([[2.0], [0.0]]), torch.tensor([1, 1]))
    assert pair.squeeze(-1).tolist() == pytest.approx([2**-0.5, -(2**-0.5)])


def rollout(num_envs=8, steps=7, group_size=4, seed=0):
    torch.manual_seed(seed)
    scenario = make_scenario()
    agents = scenario.make_agents()
    env = scenario.make_env(num_envs, "train", seed, "cpu", group_size=group_size)
    # Sampled actions, as the collector takes them: episodes of a group then differ.
    with torch.no_grad(), set_exploration_type(ExplorationType.RANDOM):
        return agents, env.rollout(steps, agents.policy, break_when_any_done=False)


def test_episode_ids_mark_complete_episodes():
    _, batch = rollout(num_envs=2, steps=7, group_size=2)
    ids, complete = episode_ids(batch)
    # Episodes last 3 steps: steps 0-2 and 3-5 are complete, step 6 starts an unfinished one.
    assert complete[0].tolist() == [True] * 6 + [False]
    assert ids[0, 0] == ids[0, 2] != ids[0, 3] and ids[0, 3] == ids[0, 5] != ids[0, 6]
    assert set(ids[0].tolist()).isdisjoint(ids[1].tolist())


def test_layout_gives_each_step_its_episodes_group_advantage():
    agents, batch = rollout()
    loss = GRPOLoss(agents.policy, agents.agent_names, ReferencePolicy(agents.policy), kl_coeff=0.1)
    steps = loss.layout_rollouts(batch)
    assert steps.batch_size == (8 * 6,)
    ends = steps["next", "done"].squeeze(-1)
    returns = steps["next", "agents", "episode_return"][ends].squeeze(-1)
    expected = group_relative(returns, steps["state", "group_id"][ends])
    torch.testing.assert_close(steps["agents", "advantage"][ends].squeeze(-1), expected)
    # All steps of an episode share the advantage of its last step.
    torch.testing.assert_close(steps["agents", "advantage"][0], steps["agents", "advantage"][2])
    # Before any update the policy is the reference: ratio 1, KL 0.
    out = loss(steps)
    assert out["kl_reference"].item() == pytest.approx(0.0, abs=1e-6)
    assert out["clip_fraction"].item() == 0.0
    active = steps["agents", "active"]
    advantage = steps["agents", "advantage"].squeeze(-1)
    expected_loss = sum(-(advantage[:, a][active[:, a]]).mean() for a in range(2))
    torch.testing.assert_close(out["loss_objective"], expected_loss, rtol=1e-5, atol=1e-6)


def test_grpo_needs_groups(tmp_path):
    with pytest.raises(ConfigError, match="group_size >= 2"):
        build_trainer(smoke_config("trainer=grpo", "trainer.group_size=1"), tmp_path)
