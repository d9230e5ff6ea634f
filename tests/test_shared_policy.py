"""One policy for several roles (``share_policy_with``): one model, a value head and per-role advantages for each role."""

from __future__ import annotations

import pytest
import torch

from nip_like import experiment, keys
from nip_like.errors import ConfigError
from nip_like.objectives import ppo
from nip_like.objectives.episodes import complete_episodes
from tests.lm_folders import chat_model  # noqa: F401 - the fixture
from tests.test_lm_chat import chat_config
from tests.test_shared_base import warm_started_on_both_roles


def one_policy(folder, tmp_path, *overrides: str, lora: int = 4):
    """The tiny chat game, the verifier playing the prover's model (``lora=0``: the whole model trains)."""
    return chat_config(
        folder, tmp_path, f"scenario.default_agent.lora.r={lora}",
        f"+scenario.agents.verifier={{pretrained_path: {folder}, max_new_tokens: 12, lora: {{r: {lora}}}, share_policy_with: prover}}",
        *overrides,
    )


@pytest.mark.parametrize("lora", [pytest.param(4, marks=pytest.mark.slow), pytest.param(0, marks=pytest.mark.slow)], ids=["lora", "full"])  # 2 s and more
def test_one_model_plays_both_roles_and_trains_on_both_roles_tokens(chat_model, tmp_path, lora):
    folder = chat_model("qwen2")
    trainer = experiment.build_trainer(one_policy(folder, tmp_path, "trainer.num_iterations=2", lora=lora), tmp_path / "run")
    prover, verifier = trainer.policy.policy("prover"), trainer.policy.policy("verifier")
    assert verifier.model is prover.model and verifier.policy_owner == "prover"
    assert verifier.value_head is not None and verifier.value_head is not prover.value_head
    # One optimiser group trains the model (the owner's, with its value head); the verifier's holds its value head.
    groups = {group["agent"]: {id(param) for param in group["params"]} for group in trainer.optimizer.param_groups}
    model = {id(param) for param in prover.model.parameters() if param.requires_grad}
    assert model <= groups["prover"] and groups["verifier"] == {id(param) for param in verifier.value_head.parameters()}
    assert not groups["prover"] & groups["verifier"]
    if lora:
        assert not any(True for _ in trainer.reference_policy.parameters())  # the model with its adapters off
    else:  # one frozen copy of the one model, not one per role
        copies = trainer.reference_policy.policy.copies
        assert copies["prover"].model is copies["verifier"].model
        assert sum(param.numel() for param in trainer.reference_policy.parameters()) == sum(
            param.numel() for param in prover.model.parameters()
        ) + sum(param.numel() for name in ("prover", "verifier") for param in copies[name].value_head.parameters())

    # Each role's tokens reach the one model: the gradient of each role's log-probabilities on it is non-zero.
    batch = next(trainer._collector_iterator)
    trained = [param for param in prover.model.parameters() if param.requires_grad]
    for index in range(2):
        scores = trainer.policy.score_actions(batch)
        role = scores.token_log_probs[..., index, :][scores.token_mask[..., index, :]]
        assert role.numel() > 0
        gradients = torch.autograd.grad(role.sum(), trained, allow_unused=True)
        assert any(grad is not None and bool(grad.abs().sum() > 0) for grad in gradients)

    before = {name: param.detach().clone() for name, param in prover.model.named_parameters() if param.requires_grad}
    heads = [head.linear.weight.detach().clone() for head in (prover.value_head, verifier.value_head)]
    trainer.train()
    assert any(not torch.equal(param, before[name]) for name, param in prover.model.named_parameters() if name in before)
    assert all(not torch.equal(head.linear.weight, old) for head, old in zip((prover.value_head, verifier.value_head), heads))


@pytest.mark.slow  # about a second or more: the fast tier keeps tests under ~0.8 s
def test_advantages_are_normalised_per_role_as_by_hand(chat_model, tmp_path, monkeypatch):
    folder = chat_model("qwen2")
    trainer = experiment.build_trainer(one_policy(folder, tmp_path), tmp_path / "run")
    batch = next(trainer._collector_iterator)
    trainer.advantage_module(batch)  # the value targets; the advantages are then set by hand
    active = batch.get(keys.ACTIVE_KEY)
    generator = torch.Generator().manual_seed(0)
    # Roles on very different scales: pooled statistics would leave the prover's near zero and the verifier's large.
    advantage = torch.randn(active.shape, generator=generator) * torch.tensor([0.1, 10.0]) + torch.tensor([5.0, -3.0])
    batch.set(trainer.loss_module.tensor_keys.advantage, advantage.unsqueeze(-1))
    seen = []
    standardize = ppo.standardize_per_agent
    monkeypatch.setattr(ppo, "standardize_per_agent", lambda values, mask: seen.append(standardize(values, mask)) or seen[-1])
    trainer.loss_module(batch)
    expected = torch.zeros_like(advantage)
    for role in range(2):
        values = [float(v) for v, a in zip(advantage[..., role].flatten(), active[..., role].flatten()) if a]
        mean = sum(values) / len(values)
        std = (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5
        expected[..., role] = (advantage[..., role] - mean) / (std + 1e-8)
    torch.testing.assert_close(seen[0][active], expected[active], atol=1e-5, rtol=1e-5)
    for role in range(2):  # each role's advantages have mean 0 and standard deviation 1 on its own steps
        normalised = seen[0][..., role][active[..., role]]
        assert abs(float(normalised.mean())) < 1e-5 and abs(float(normalised.std(unbiased=False)) - 1) < 1e-4


@pytest.mark.slow
def test_grpo_forms_its_groups_per_role_as_by_hand(chat_model, tmp_path):
    folder = chat_model("qwen2")
    trainer = experiment.build_trainer(one_policy(folder, tmp_path, "trainer=grpo", "trainer.group_size=2"), tmp_path / "run")
    batch = next(trainer._collector_iterator)
    found = complete_episodes(batch)
    returns = found.returns.clone()
    returns[:, 1] = returns[:, 1] * 100 + torch.arange(returns.shape[0])  # the verifier's returns on another scale
    expected = torch.zeros_like(returns)
    for role in range(returns.shape[1]):
        for group in found.groups.unique():
            members = (found.groups == group).nonzero().flatten().tolist()
            values = [float(returns[m, role]) for m in members]
            mean = sum(values) / len(values)
            std = (sum((v - mean) ** 2 for v in values) / max(len(values) - 1, 1)) ** 0.5
            for m in members:
                expected[m, role] = (returns[m, role] - mean) / std if len(values) > 1 and std > 1e-6 else 0.0
    from nip_like.objectives.episodes import group_relative

    torch.testing.assert_close(group_relative(returns, found.groups), expected, atol=1e-5, rtol=1e-5)
    steps = trainer.loss_module.layout_rollouts(batch)
    assert steps.get(trainer.loss_module.tensor_keys.advantage).shape[-2:] == (2, 1)
    trainer.train()


def test_one_policy_is_refused_where_it_cannot_apply(chat_model, tmp_path):
    folder = chat_model("qwen2")
    with pytest.raises(ConfigError, match=r"^trainer lola differentiates each agent's update through the others' parameters; verifier play"):
        experiment.build_trainer(one_policy(folder, tmp_path, "trainer=lola"), tmp_path / "run")
    with pytest.raises(ConfigError, match=r"trainer.pretrain.agents names \['verifier'\], which play another agent's model in the warm start \(share_policy_with, .*\): name that agent instead"):
        experiment.build_trainer(one_policy(folder, tmp_path, 'trainer.pretrain.agents=["verifier"]'), tmp_path / "run2")


@pytest.mark.slow
def test_the_owners_warm_start_fits_every_role_and_both_play_the_adapters_added_after_it(chat_model, tmp_path, monkeypatch):
    from nip_like.lm.lora import has_lora

    trainer = warm_started_on_both_roles(chat_model("qwen2"), tmp_path, monkeypatch, "share_policy_with")
    prover, verifier = trainer.policy.policy("prover"), trainer.policy.policy("verifier")
    assert has_lora(prover.model) and verifier.model is prover.model
    trainer.train()


@pytest.mark.slow  # about a second or more: the fast tier keeps tests under ~0.8 s
def test_the_model_trains_in_its_owners_group_whichever_agent_comes_first(chat_model, tmp_path):
    folder = chat_model("qwen2")
    config = chat_config(
        folder, tmp_path, "scenario.default_agent.lora.r=4", "scenario.default_agent.share_policy_with=verifier",
        f"+scenario.agents.verifier={{pretrained_path: {folder}, max_new_tokens: 12, lora: {{r: 4}}}}",
        "+trainer.optimizer.agent_lr.verifier=0.01",
    )
    trainer = experiment.build_trainer(config, tmp_path / "run")
    prover, verifier = trainer.policy.policy("prover"), trainer.policy.policy("verifier")
    assert prover.model is verifier.model and prover.policy_owner == "verifier"
    groups = {group["agent"]: group for group in trainer.optimizer.param_groups}
    model = {id(param) for param in verifier.model.parameters() if param.requires_grad}
    assert model <= {id(param) for param in groups["verifier"]["params"]} and groups["verifier"]["lr"] == 0.01
    assert {id(param) for param in groups["prover"]["params"]} == {id(param) for param in prover.value_head.parameters()}
    metrics = trainer.train_iteration()
    assert {"train/grad_norm/prover", "train/grad_norm/verifier"} <= set(metrics)
