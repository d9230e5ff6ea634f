"""The update's passes over language-model agents: one body pass per agent, one micro-batch's graph at a time.

The value of a step is read from the same pass that scores the agent's message
(its hidden state at the prompt's last token), so the update runs each agent's
model once per row; and when the passes of all agents together exceed the
token budget, each micro-batch's activations are recomputed in the backward
pass, which keeps one micro-batch's graph alive at a time and changes no
gradient.
"""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from nip_like.objectives.action_scores import score_actions
from tests.test_duplicates_scenario import scenario_for


def _rollout(tmp_path, shared_body: bool = True, budget=None):
    scenario = scenario_for("debate", tmp_path, first_speaker="prover", max_rounds=2)
    scenario.config.default_agent = OmegaConf.merge(
        scenario.config.default_agent, {"shared_body": shared_body, "max_tokens_per_micro_batch": budget}
    )
    torch.manual_seed(0)
    env, agents = scenario.make_env(8, "train", 0, "cpu"), scenario.make_agents()
    with torch.no_grad():
        rollout = env.rollout(2, agents.policy, break_when_any_done=False).reshape(-1)
    return agents, rollout


def _count_passes(actor) -> list[int]:
    counts = []
    for name in actor.agent_names:
        policy = actor.policy(name)
        counts.append(0)
        index = len(counts) - 1
        for model in (policy.model, *( [policy.value_head.body] if policy.value_head is not None and policy.value_head.body is not None else [])):
            model.register_forward_pre_hook(lambda module, args, kwargs, index=index: counts.__setitem__(index, counts[index] + 1), with_kwargs=True)
    return counts


@pytest.mark.parametrize("shared_body", [True, False])
def test_the_value_read_from_the_scoring_pass_is_the_critics(tmp_path, shared_body):
    agents, rollout = _rollout(tmp_path, shared_body)
    scores = score_actions(agents.policy, rollout, with_value=True)
    critic = agents.value(rollout.clone()).get(("agents", "state_value")).squeeze(-1)
    torch.testing.assert_close(scores.value, critic, rtol=1e-5, atol=1e-5)
    plain = score_actions(agents.policy, rollout)
    torch.testing.assert_close(scores.token_log_probs, plain.token_log_probs, rtol=1e-5, atol=1e-6)
    assert plain.value is None


def test_a_shared_body_runs_once_per_agent_for_scores_and_value(tmp_path):
    agents, rollout = _rollout(tmp_path)
    for name in agents.policy.agent_names:  # the one-off two-token probe of automatic chunked scoring, before counting
        assert agents.policy.policy(name).chunkable
    counts = _count_passes(agents.policy)
    score_actions(agents.policy, rollout, with_value=True)
    assert counts == [1] * len(counts)  # before: a scoring pass and the critic's pass


def _saved_bytes_and_gradients(agents, rollout):
    saved = []

    def pack(tensor):
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    agents.policy.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        scores = score_actions(agents.policy, rollout, with_value=True)
    loss = scores.token_log_probs.sum() + scores.value.pow(2).sum()
    loss.backward()
    gradients = {name: p.grad.clone() for name, p in agents.policy.named_parameters() if p.grad is not None}
    return sum(saved), gradients


def test_over_the_budget_across_agents_each_micro_batch_is_recomputed_with_the_same_gradient(tmp_path):
    agents, rollout = _rollout(tmp_path)
    whole, expected = _saved_bytes_and_gradients(agents, rollout)
    # Each agent's rows fit in one pass of this budget, both agents' together do not: the graph must not hold both.
    for name in agents.policy.agent_names:
        agents.policy.policy(name).max_tokens_per_micro_batch = max(_pass_tokens(rollout))
    bounded, found = _saved_bytes_and_gradients(agents, rollout)
    assert bounded < whole / 4, (bounded, whole)
    assert found.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(found[name], expected[name], rtol=1e-4, atol=1e-6)


def _pass_tokens(rollout) -> list[int]:
    """Each agent's pass (a shared value body: every row): rows x (prompt columns a pass keeps + message width).

    A pass keeps the columns with a real token in some row, and the last column always (its output predicts the
    message's first token).
    """
    mask = rollout.get(("agents", "prompt_mask"))
    message = rollout.get(("agents", "action")).shape[-1]
    kept = [int(mask[:, index, :-1].any(0).sum()) + 1 for index in range(mask.shape[1])]
    return [mask.shape[0] * (columns + message) for columns in kept]


def _pad_prompts_left(rollout, columns: int):
    """The same rollout with ``columns`` more padding columns on the left of every prompt (the chat view's wide layout)."""
    padded = rollout.clone()
    ids, mask = rollout.get(("agents", "prompt_ids")), rollout.get(("agents", "prompt_mask"))
    padded.set(("agents", "prompt_ids"), torch.cat([ids.new_zeros((*ids.shape[:-1], columns)), ids], -1))
    padded.set(("agents", "prompt_mask"), torch.cat([mask.new_zeros((*mask.shape[:-1], columns)), mask], -1))
    return padded


def test_the_recompute_decision_counts_the_columns_a_pass_takes_not_the_padded_width(tmp_path):
    agents, rollout = _rollout(tmp_path)
    whole, expected = _saved_bytes_and_gradients(agents, rollout)
    wide = _pad_prompts_left(rollout, 200)  # 8 x 2 rows x 200 more columns: far over the held limit if counted
    needed = sum(_pass_tokens(rollout))
    for name in agents.policy.agent_names:
        agents.policy.policy(name).max_tokens_held = needed
    held, found = _saved_bytes_and_gradients(agents, wide)
    assert held == whole  # the same pass: nothing recomputed, nothing more saved
    for name in expected:
        torch.testing.assert_close(found[name], expected[name], rtol=1e-4, atol=1e-6)
    for name in agents.policy.agent_names:  # one token less than both passes take: recomputed
        agents.policy.policy(name).max_tokens_held = needed - 1
    bounded, _ = _saved_bytes_and_gradients(agents, wide)
    assert bounded < whole / 4, (bounded, whole)
