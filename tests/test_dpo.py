"""DPO, IPO and hinge: closed forms on hand-built tensors, pairing, the reference, the trainer."""

import math

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.modules import MaskedCategorical, ProbabilisticActor

from nip_like import keys
from nip_like.objectives.action_scores import ActionScores, score_actions
from nip_like.errors import ConfigError
from nip_like.experiment import build_trainer, run_experiment
from nip_like.logging import read_csv_metric
from nip_like.objectives.dpo import (
    DPOLoss,
    episode_log_probs,
    group_extremes,
    pad_episodes,
    preference_loss,
)
from nip_like.objectives.episodes import episode_ids
from nip_like.objectives.reference import ReferencePolicy
from tests.conftest import hidden_bits_correct, smoke_config
from tests.test_grpo import rollout


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


def test_preference_losses_closed_form():
    logits = torch.tensor([2.0, -1.0, 0.0])
    beta = 0.5
    sigmoid = preference_loss(logits, beta, "sigmoid")
    assert sigmoid.tolist() == pytest.approx([-log_sigmoid(1.0), -log_sigmoid(-0.5), math.log(2)])
    smoothed = preference_loss(logits, beta, "sigmoid", label_smoothing=0.1)
    assert smoothed[0].item() == pytest.approx(-0.9 * log_sigmoid(1.0) - 0.1 * log_sigmoid(-1.0))
    # IPO regresses the log-ratio difference onto 1 / (2 beta) = 1.
    assert preference_loss(logits, beta, "ipo").tolist() == pytest.approx([1.0, 4.0, 1.0])
    assert preference_loss(logits, beta, "hinge").tolist() == pytest.approx([0.0, 1.5, 1.0])
    with pytest.raises(ValueError, match="sigmoid, ipo, hinge"):
        preference_loss(logits, beta, "kto")


def test_group_extremes_pick_first_best_and_worst_and_measure_the_gap():
    returns = torch.tensor([0.0, 1.0, 1.0, 0.5, 0.5, 2.0, -1.0])
    groups = torch.tensor([5, 5, 5, 9, 9, 3, 5])
    best, worst, gap = group_extremes(returns, groups)
    # Groups in sorted id order: 3, 5, 9.
    assert best.tolist() == [5, 1, 3]
    assert worst.tolist() == [5, 6, 3]
    assert gap.tolist() == [0.0, 2.0, 0.0]


def hand_steps(mask_rows, active_rows, actions):
    """One episode of hand-built steps: 2 agents, 3 actions."""
    mask = torch.tensor(mask_rows, dtype=torch.bool)
    return TensorDict(
        {
            "agents": {
                "observation": torch.zeros(len(actions), 2, 4),
                "action_mask": mask,
                "active": torch.tensor(active_rows, dtype=torch.bool),
                "action": torch.tensor(actions),
            }
        },
        batch_size=[len(actions)],
    )


def test_episode_log_probs_sum_or_average_the_agents_own_active_steps():
    # Uniform logits: each log-prob is -log(number of legal actions).
    steps = hand_steps(
        mask_rows=[[[1, 1, 1], [1, 1, 0]], [[1, 1, 0], [1, 0, 0]], [[1, 1, 1], [1, 1, 1]]],
        active_rows=[[1, 0], [1, 0], [0, 1]],
        actions=[[2, 0], [1, 0], [0, 2]],
    ).unsqueeze(0)
    scores = score_actions(uniform_actor(), steps)
    prover = episode_log_probs(scores, steps, torch.tensor([0]), length_normalize=False)
    verifier = episode_log_probs(scores, steps, torch.tensor([1]), length_normalize=False)
    assert prover.item() == pytest.approx(-math.log(3) - math.log(2))
    assert verifier.item() == pytest.approx(-math.log(3))
    mean = episode_log_probs(scores, steps, torch.tensor([0]), length_normalize=True)
    assert mean.item() == pytest.approx((-math.log(3) - math.log(2)) / 2)


def test_length_normalisation_divides_by_the_agents_tokens():
    # Two steps of one agent: a 3-token message and a 1-token message (T = 3).
    steps = TensorDict({"agents": {"active": torch.ones(1, 2, 1, dtype=torch.bool)}}, batch_size=[1, 2])
    token_log_probs = torch.tensor([[[[-1.0, -2.0, -3.0]], [[-4.0, 0.0, 0.0]]]])
    token_mask = torch.tensor([[[[True, True, True]], [[True, False, False]]]])
    scores = ActionScores(token_log_probs, token_mask, torch.zeros_like(token_log_probs))
    total = episode_log_probs(scores, steps, torch.tensor([0]), length_normalize=False)
    mean = episode_log_probs(scores, steps, torch.tensor([0]), length_normalize=True)
    assert total.item() == pytest.approx(-10.0)
    assert mean.item() == pytest.approx(-10.0 / 4)


def uniform_actor() -> ProbabilisticActor:
    """A policy with zero logits whatever it sees (uniform over legal actions)."""
    net = nn.Linear(4, 3)
    nn.init.zeros_(net.weight)
    nn.init.zeros_(net.bias)
    return ProbabilisticActor(
        TensorDictModule(net, in_keys=[keys.OBSERVATION_KEY], out_keys=[keys.LOGITS_KEY]),
        in_keys={"logits": keys.LOGITS_KEY, "mask": keys.ACTION_MASK_KEY},
        out_keys=[keys.ACTION_KEY],
        distribution_class=MaskedCategorical,
        return_log_prob=True,
        log_prob_key=keys.LOG_PROB_KEY,
    )


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
def test_dpo_loss_and_trl_statistics_closed_form(loss_type):
    actor = uniform_actor()
    chosen = hand_steps([[[1, 1, 1], [1, 1, 1]]] * 2, [[1, 0], [0, 1]], [[0, 0], [1, 1]])
    rejected = hand_steps([[[1, 1, 0], [1, 1, 1]], [[1, 0, 0], [1, 1, 1]]], [[1, 0], [1, 0]], [[0, 0], [0, 0]])
    pairs = TensorDict(
        {
            "chosen": chosen.unsqueeze(0),
            "rejected": rejected.unsqueeze(0),
            "agent": torch.tensor([0]),
            "return_gap": torch.tensor([1.0]),
            "reference_logps": {"chosen": torch.tensor([-2.0]), "rejected": torch.tensor([-0.5])},
        },
        batch_size=[1],
    )
    beta = 0.5
    loss = DPOLoss(actor, ("prover", "verifier"), ReferencePolicy(actor), beta=beta, loss_type=loss_type)
    out = loss(pairs)
    # The prover acted once in the chosen episode (3 legal actions), twice in the rejected one (2, then 1).
    policy_chosen, policy_rejected = -math.log(3), -math.log(2) + 0.0
    chosen_ratio, rejected_ratio = policy_chosen + 2.0, policy_rejected + 0.5
    logits = torch.tensor([chosen_ratio - rejected_ratio])
    assert out["loss_objective"].item() == pytest.approx(preference_loss(logits, beta, loss_type).item())
    assert out["rewards/chosen"].item() == pytest.approx(beta * chosen_ratio)
    assert out["rewards/rejected"].item() == pytest.approx(beta * rejected_ratio)
    assert out["rewards/margins"].item() == pytest.approx(beta * (chosen_ratio - rejected_ratio))
    assert out["rewards/accuracies"].item() == float(chosen_ratio > rejected_ratio)
    assert out["logps/chosen"].item() == pytest.approx(policy_chosen)
    assert out["logps/rejected"].item() == pytest.approx(policy_rejected)
    # The gradient reaches the policy.
    out["loss_objective"].backward()
    assert actor.module[0].module.weight.grad is not None


def test_pad_episodes_gathers_in_order_and_marks_padding_inactive():
    rounds = torch.tensor([[0, 1, 0, 1, 2, 0]])
    done = torch.tensor([[False, True, False, False, True, False]]).unsqueeze(-1)
    batch = TensorDict(
        {
            "state": {"round": rounds},
            "step": torch.arange(6).unsqueeze(0),
            "agents": {"active": torch.ones(1, 6, 2, dtype=torch.bool)},
            "next": {"done": done},
        },
        batch_size=[1, 6],
    )
    ids, complete = episode_ids(batch)
    assert complete.tolist() == [[True] * 5 + [False]]
    episodes = torch.stack([ids[0, 3], ids[0, 0]])
    steps = pad_episodes(batch, ids, episodes)
    assert steps.batch_size == (2, 3)
    assert steps["step"].tolist() == [[2, 3, 4], [0, 1, 1]]
    assert steps["agents", "active"].all(-1).tolist() == [[True, True, True], [True, True, False]]
    assert not steps["agents", "active"][1, 2].any()
    assert "next" not in steps.keys()


def test_layout_pairs_the_best_and_worst_episode_of_each_group_per_agent():
    agents, batch = rollout(num_envs=8, steps=6, group_size=4, seed=3)
    loss = DPOLoss(agents.policy, agents.agent_names, ReferencePolicy(agents.policy), beta=0.3)
    pairs = loss.layout_rollouts(batch)
    ends = batch["next", "done"].squeeze(-1)
    returns = batch["next", "agents", "episode_return"][ends].squeeze(-1)
    groups = batch["state", "group_id"][ends]
    expected = 0
    for index in range(2):
        for group in groups.unique():
            values = returns[groups == group, index]
            expected += int(values.max() > values.min())
    assert 0 < expected == pairs.batch_size[0]
    metrics = loss.layout_metrics()
    assert metrics["pairs/kept"] == expected
    assert metrics["pairs/kept"] + metrics["pairs/dropped"] == 2 * groups.unique().numel()
    assert (pairs["return_gap"] > 0).all()
    # Both episodes of a pair started on the same datapoint.
    assert (pairs["chosen", "state", "group_id"][:, 0] == pairs["rejected", "state", "group_id"][:, 0]).all()
    # The reference is the initial policy: every ratio is 0, the sigmoid loss is log 2.
    out = loss(pairs)
    assert out["loss_objective"].item() == pytest.approx(math.log(2), abs=1e-5)
    assert out["rewards/margins"].item() == pytest.approx(0.0, abs=1e-6)


def test_margin_drops_pairs_and_counts_them():
    agents, batch = rollout(num_envs=8, steps=6, group_size=4, seed=3)
    loss = DPOLoss(agents.policy, agents.agent_names, ReferencePolicy(agents.policy), margin=1.5)
    pairs = loss.layout_rollouts(batch)
    assert pairs.batch_size == (0,)
    assert loss.layout_metrics()["pairs/kept"] == 0
    # Four groups (two blocks of four environments, two episodes each), two agents.
    assert loss.layout_metrics()["pairs/dropped"] == 4 * 2


def test_reference_sync_copies_or_averages_the_policy():
    agents, batch = rollout(num_envs=8, steps=6, group_size=4)
    reference = ReferencePolicy(agents.policy)
    initial = [p.clone() for p in reference.policy.parameters()]
    with torch.no_grad():
        for param in agents.policy.parameters():
            param.add_(1.0)
    loss = DPOLoss(agents.policy, agents.agent_names, reference, ref_sync_every=2, ref_mixup_alpha=0.25)
    loss.start_iteration(0)
    assert all(torch.equal(a, b) for a, b in zip(reference.policy.parameters(), initial))
    loss.start_iteration(1)
    for ref, start, now in zip(reference.policy.parameters(), initial, agents.policy.parameters()):
        torch.testing.assert_close(ref, 0.75 * start + 0.25 * now)
    assert int(loss.state_dict()["num_layouts"]) == 2


def test_dpo_trainer_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="group_size >= 2"):
        build_trainer(smoke_config("trainer=dpo", "trainer.group_size=1"), tmp_path / "a")
    with pytest.raises(ConfigError, match=r"trainer.objective.loss_type must be one of \[.sigmoid., .ipo., .hinge.\], got .kto."):
        build_trainer(smoke_config("trainer=dpo", "trainer.objective.loss_type=kto"), tmp_path / "b")
    with pytest.raises(Exception, match=r"trainer.objective \(IPOConfig\) has no option 'loss_type'"):
        smoke_config("trainer=ipo", "trainer.objective.loss_type=sigmoid")  # IPO's loss type is fixed
    with pytest.raises(ConfigError, match=r"trainer.objective.beta must be > 0, got 0"):
        build_trainer(smoke_config("trainer=dpo", "trainer.objective.beta=0"), tmp_path / "d")


def test_an_iteration_without_pairs_makes_no_update(tmp_path):
    trainer = build_trainer(smoke_config("trainer=dpo", "trainer.objective.margin=5", "trainer.eval.every=0"), tmp_path)
    before = [p.clone() for p in trainer.policy.parameters()]
    metrics = trainer.train_iteration()
    assert metrics["train/layout_items"] == 0
    assert metrics["train/pairs/kept"] == 0 and metrics["train/pairs/dropped"] > 0
    assert trainer.state.gradient_steps == 0
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.policy.parameters()))


def test_moving_reference_is_separate_from_the_diagnostics_reference(tmp_path):
    still = build_trainer(smoke_config("trainer=dpo"), tmp_path / "a")
    assert still.loss_module.reference is still.reference_policy
    moving = build_trainer(smoke_config("trainer=dpo", "trainer.objective.ref_sync_every=1"), tmp_path / "b")
    assert moving.loss_module.reference is not moving.reference_policy


@pytest.mark.parametrize("trainer", ["dpo", "ipo"])
def test_preference_trainers_run_end_to_end_and_log_trl_names(tmp_path, trainer, run_probe):
    metrics = run_experiment(smoke_config(f"trainer={trainer}", "logger=csv"), tmp_path)
    assert run_probe.changed() == {"prover", "verifier"}  # the pairs trained both agents
    csv = {
        name: [value for _, value in read_csv_metric(tmp_path, name)]
        for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                     "logps/rejected", "train/pairs/kept", "train/pairs/dropped", "objective/kl", "loss/policy")
    }
    assert len(csv["train/pairs/kept"]) == 3 and sum(csv["train/pairs/kept"]) > 0
    assert all(math.isfinite(value) for value in csv["loss/policy"]) and any(csv["loss/policy"])
    # TRL's statistics agree with one another: margin = chosen - rejected reward, accuracy a share.
    assert csv["rewards/margins"] == pytest.approx(
        [chosen - rejected for chosen, rejected in zip(csv["rewards/chosen"], csv["rewards/rejected"])], abs=1e-6
    )
    assert all(0.0 <= value <= 1.0 for value in csv["rewards/accuracies"])
    # The test metrics agree with a count by hand of the test episodes.
    correct = hidden_bits_correct(run_probe.test_decisions(64), run_probe.trainer.agent_names.index("verifier"))
    assert metrics["test/accuracy"] == pytest.approx(correct.float().mean().item())
    agents = [metrics["test/agents/prover/reward"], metrics["test/agents/verifier/reward"]]
    assert metrics["test/reward"] == pytest.approx(sum(agents) / 2)


@pytest.mark.slow  # about a second or more: the fast tier keeps tests under ~0.8 s
def test_pairs_of_episodes_of_different_lengths_train(tmp_path):
    # Graph isomorphism's episodes end when the verifier decides: a pair's two episodes, and the longest episode
    # of one iteration and the next, differ in length (the sides are padded alike; the buffer is rebuilt).
    config = smoke_config(
        "scenario=graph_isomorphism", "protocol=nip", "scenario.num_pairs=200", f"scenario.cache_dir={tmp_path / 'data'}",
        "trainer=dpo", "trainer.num_iterations=3", "logger=csv",
    )
    run_experiment(config, tmp_path / "run")
    assert [step for step, _ in read_csv_metric(tmp_path / "run", "train/iteration")] == [1, 2, 3]
    assert sum(value for _, value in read_csv_metric(tmp_path / "run", "train/pairs/kept")) > 0
