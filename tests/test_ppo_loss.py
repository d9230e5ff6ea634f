"""MultiAgentPPOLoss: masking of inactive agents, closed-form values, KL variant."""

import math

import pytest
import torch

from nip_like.objectives import MultiAgentPPOLoss, per_agent_mean, standardize_per_agent
from tests.test_environment import make_scenario


def transitions(num_envs=16, seed=0):
    torch.manual_seed(seed)
    scenario = make_scenario()
    agents = scenario.make_agents()
    env = scenario.make_env(num_envs, "train", seed, "cpu")
    with torch.no_grad():
        rollout = env.rollout(3, agents.policy, break_when_any_done=False)
    return agents, rollout


def make_loss(agents, **kwargs):
    loss = MultiAgentPPOLoss(agents.policy, agents.value, agents.agent_names, **kwargs)
    loss.make_value_estimator(gamma=0.9, lmbda=0.9)
    return loss


def losses_and_grads(loss, batch):
    loss.zero_grad()
    out = loss(batch)
    total = out["loss_objective"] + out["loss_entropy"] + out["loss_critic"]
    total.backward()
    grads = [p.grad.clone() if p.grad is not None else None for p in loss.parameters()]
    return out, grads


def test_inactive_agents_do_not_touch_the_learning_signal():
    agents, rollout = transitions()
    loss = make_loss(agents)
    with torch.no_grad():
        loss.value_estimator(rollout)
    batch = rollout.reshape(-1)
    reference, reference_grads = losses_and_grads(loss, batch)

    perturbed = batch.clone()
    inactive = ~perturbed["agents", "active"]
    assert inactive.any()
    # Inactive steps: other actions, nonsense log-probs, huge advantages.
    prover_vocab = 4
    perturbed["agents", "action"] = torch.where(
        inactive, (perturbed["agents", "action"] + 1) % prover_vocab, perturbed["agents", "action"]
    )
    perturbed["agents", "action_log_prob"] = torch.where(inactive, torch.full_like(inactive, -50.0, dtype=torch.float), perturbed["agents", "action_log_prob"])
    perturbed["agents", "advantage"] = torch.where(
        inactive.unsqueeze(-1), torch.full_like(perturbed["agents", "advantage"], 1e6), perturbed["agents", "advantage"]
    )
    changed, changed_grads = losses_and_grads(loss, perturbed)
    for key in ("loss_objective", "loss_entropy", "entropy", "kl_approx", "clip_fraction"):
        torch.testing.assert_close(changed[key], reference[key])
    # The critic sees every step, so compare only the policy parameters' gradients.
    policy_params = {id(p) for p in agents.policy.parameters()}
    for param, before, after in zip(loss.parameters(), reference_grads, changed_grads):
        if id(param) in policy_params and before is not None:
            torch.testing.assert_close(after, before)


def test_clipped_surrogate_matches_closed_form():
    agents, rollout = transitions(num_envs=4)
    batch = rollout.reshape(-1)
    loss = make_loss(agents, normalize_advantage=False, entropy_coeff=0.0, clip_epsilon=0.2)
    with torch.no_grad():
        dist = agents.policy.get_dist(batch.clone())
        current = dist.log_prob(batch["agents", "action"])
    ratios = torch.tensor([0.5, 1.1, 1.5])
    # Give every entry a known ratio and advantage.
    index = torch.arange(batch.numel() * 2).reshape(batch.numel(), 2) % 3
    ratio = ratios[index]
    advantage = torch.where(index == 1, -1.0, 2.0)
    batch["agents", "action_log_prob"] = current - ratio.log()
    batch["agents", "advantage"] = advantage.unsqueeze(-1)
    batch["agents", "value_target"] = torch.zeros(batch.numel(), 2, 1)
    out = loss(batch)
    clipped = ratio.clamp(0.8, 1.2)
    surrogate = torch.minimum(ratio * advantage, clipped * advantage)
    active = batch["agents", "active"]
    expected = sum(-(surrogate[:, a][active[:, a]]).mean() for a in range(2))
    torch.testing.assert_close(out["loss_objective"], expected, rtol=1e-5, atol=1e-5)
    frac = sum(((ratio[:, a] - 1).abs() > 0.2)[active[:, a]].float().mean() for a in range(2)) / 2
    torch.testing.assert_close(out["clip_fraction"], frac)
    for a, name in enumerate(agents.agent_names):
        torch.testing.assert_close(out["agents", name, "loss_objective"], -(surrogate[:, a][active[:, a]]).mean())


def test_kl_variant_is_plain_policy_gradient_on_policy_and_beta_adapts():
    agents, rollout = transitions()
    loss = make_loss(agents, variant="kl", kl_beta=1.0, kl_target=0.01, normalize_advantage=False)
    with torch.no_grad():
        loss.value_estimator(rollout)
    batch = rollout.reshape(-1)
    out = loss(batch)
    # On-policy: ratio 1, KL 0, so the objective is minus the mean advantage of active steps.
    active = batch["agents", "active"]
    advantage = batch["agents", "advantage"].squeeze(-1)
    expected = sum(-(advantage[:, a][active[:, a]]).mean() for a in range(2))
    torch.testing.assert_close(out["loss_objective"], expected, rtol=1e-5, atol=1e-5)
    # KL below target/1.5 halves beta.
    assert loss.kl_beta.item() == pytest.approx(0.5)
    # A large policy change doubles it.
    batch["agents", "action_log_prob"] = batch["agents", "action_log_prob"] - 1.0
    loss(batch)
    assert loss.kl_beta.item() == pytest.approx(1.0)


def test_an_unknown_variant_is_refused_naming_the_losss_own_argument():
    agents, _ = transitions(num_envs=2)
    with pytest.raises(ValueError, match=r"^MultiAgentPPOLoss: variant must be one of \['clip', 'kl'\], got 'trust'$"):
        MultiAgentPPOLoss(agents.policy, agents.value, agents.agent_names, variant="trust")


def test_per_agent_mean_ignores_masked_entries_and_never_returns_nan():
    values = torch.tensor([[1.0, float("nan")], [3.0, float("inf")]])
    mask = torch.tensor([[True, False], [True, False]])
    assert per_agent_mean(values, mask).tolist() == [2.0, 0.0]


def test_standardize_per_agent_uses_each_agents_active_steps():
    values = torch.tensor([[1.0, 10.0], [3.0, 0.0], [100.0, 30.0]])
    mask = torch.tensor([[True, True], [True, False], [False, True]])
    out = standardize_per_agent(values, mask)
    assert out[:2, 0].tolist() == pytest.approx([-1.0, 1.0], abs=1e-6)
    assert out[[0, 2], 1].tolist() == pytest.approx([-1.0, 1.0], abs=1e-6)
    assert math.isfinite(out[2, 0].item())
