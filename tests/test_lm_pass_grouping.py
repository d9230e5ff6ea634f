"""Scoring passes grouped by length: less padding, the same scores and gradients, no needless recomputation.

With a token budget (the automatic one of every trained LM agent), an agent's
rows go through its model in groups of similar length
(:func:`~nip_like.lm.micro_batches.micro_batches`, cut by
:func:`~nip_like.lm.micro_batches.least_padding_runs`), and a group is
recomputed in the backward pass only when the groups together exceed the
budget. Each row's scores do not depend on the rows beside it, so the grouped
passes give the one-pass values and gradients up to float error.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from nip_like.lm.micro_batches import PASS_COST_TOKENS, held_tokens, least_padding_runs, micro_batches
from nip_like.lm.models import LMAgentConfig, build_lm_policy
from tests.lm_folders import chat_model  # noqa: F401 - the fixture


def _cost(sorted_lengths: list[int], runs: list[tuple[int, int]], pass_cost: int) -> int:
    return sum((end - start) * sorted_lengths[end - 1] + pass_cost for start, end in runs)


def _brute_force_cost(sorted_lengths: list[int], pass_cost: int) -> int:
    cuts = [end for end in range(1, len(sorted_lengths)) if sorted_lengths[end] != sorted_lengths[end - 1]]
    best = None
    for count in range(len(cuts) + 1):
        for chosen in itertools.combinations(cuts, count):
            bounds = [0, *chosen, len(sorted_lengths)]
            cost = _cost(sorted_lengths, list(zip(bounds, bounds[1:])), pass_cost)
            best = cost if best is None else min(best, cost)
    return best


def test_the_runs_cover_the_rows_at_the_least_cost():
    generator = random.Random(0)
    for _ in range(30):
        lengths = sorted(generator.choice([3, 5, 9, 20, 21, 40]) for _ in range(generator.randint(1, 12)))
        pass_cost = generator.choice([0, 4, 30, 1000])
        runs = least_padding_runs(lengths, pass_cost)
        assert runs[0][0] == 0 and runs[-1][1] == len(lengths)
        assert all(end == start for (_, end), (start, _) in zip(runs, runs[1:]))
        assert all(lengths[start - 1] != lengths[start] for start, _ in runs[1:])  # cuts between different lengths only
        assert _cost(lengths, runs, pass_cost) == _brute_force_cost(lengths, pass_cost)
    assert least_padding_runs([], 10) == []


def test_rows_of_very_different_lengths_get_their_own_passes_when_that_saves_more_than_a_pass():
    lengths = torch.tensor([60, 4] * 64)
    groups = micro_batches(lengths, 64, budget=10**6)
    assert [sorted(set(lengths[group].tolist())) for group in groups] == [[4], [60]]
    assert held_tokens(groups, lengths) == 64 * 4 + 64 * 60
    # A few short rows do not pay for a pass of their own; without a budget, one pass as before.
    few = torch.tensor([60] * 64 + [4] * 2)
    assert len(micro_batches(few, 64, budget=10**6)) == 1
    assert len(micro_batches(lengths, 64, budget=None)) == 1
    # The budget still bounds each group.
    for group in micro_batches(lengths, 64, budget=600):
        assert group.numel() * int(lengths[group].max()) <= 600
    assert PASS_COST_TOKENS > 0


def _rows(rows: int = 96):
    """Left-padded prompts of two very different lengths (as the chat view's first and last rounds), messages with masks."""
    torch.manual_seed(0)
    width = 40
    prompt_lengths = torch.where(torch.arange(rows) % 2 == 0, 4, 38) + torch.randint(0, 3, (rows,))
    prompt_mask = torch.arange(width) >= width - prompt_lengths.unsqueeze(-1)
    prompts = torch.where(prompt_mask, torch.randint(300, 900, (rows, width)), 0)
    tokens = torch.randint(300, 900, (rows, 6))
    token_mask = torch.arange(6) < torch.randint(1, 7, (rows, 1))
    return prompts, prompt_mask, tokens, token_mask


def _scored(folder, budget, rows):
    torch.manual_seed(1)  # the same value head and adapters
    policy = build_lm_policy(LMAgentConfig(pretrained_path=str(folder), max_new_tokens=6, max_tokens_per_micro_batch=budget))
    assert policy.chunkable  # the one-off two-token probe of automatic chunked scoring, before counting passes
    forwards = []
    policy.model.register_forward_pre_hook(lambda *_: forwards.append(torch.is_grad_enabled()))
    weights = torch.randn(rows[2].shape)
    scored = policy.evaluate(*rows)
    passes = len(forwards)
    loss = (scored["token_log_probs"] * weights).sum() + scored["value"].square().sum() + scored["entropy"].mean()
    loss.backward()
    grads = {name: param.grad.clone() for name, param in policy.named_parameters() if param.grad is not None}
    return scored, grads, policy.pop_padding_counts(), passes, len(forwards) - passes


def test_grouped_passes_give_the_one_pass_scores_and_gradients_without_recomputing(chat_model):
    rows = _rows()
    one, grads_one, counts_one, passes_one, _ = _scored(chat_model("qwen2"), None, rows)
    grouped, grads_grouped, counts_grouped, passes_grouped, recomputed = _scored(chat_model("qwen2"), 10**5, rows)
    assert passes_one == 1 and passes_grouped == 2  # the short rows and the long rows
    assert recomputed == 0  # both groups fit the budget together: nothing is run again in the backward pass
    for name in ("token_log_probs", "entropy", "value"):
        torch.testing.assert_close(grouped[name], one[name], atol=1e-5, rtol=1e-5)
    assert grads_one.keys() == grads_grouped.keys() and grads_one
    for name in grads_one:
        torch.testing.assert_close(grads_grouped[name], grads_one[name], atol=1e-5, rtol=1e-4)
    assert counts_grouped[0] == counts_one[0] and counts_grouped[1] < 0.7 * counts_one[1]


def test_groups_that_exceed_the_budget_together_are_recomputed(chat_model):
    rows = _rows()
    lengths = rows[1].sum(-1) + rows[3].sum(-1)
    budget = int(lengths.max()) * 48  # each group within it, both together not
    _, _, _, passes, recomputed = _scored(chat_model("qwen2"), budget, rows)
    assert passes >= 2 and recomputed == passes


def test_held_tokens_count_each_passes_rows_times_its_longest_row(chat_model):
    policy = build_lm_policy(LMAgentConfig(pretrained_path=str(chat_model("qwen2")), max_new_tokens=6, max_tokens_per_micro_batch=4096))
    prompts, prompt_mask, tokens, token_mask = _rows()
    lengths = prompt_mask.sum(-1) + token_mask.sum(-1)
    groups = micro_batches(lengths, prompts.shape[1] + tokens.shape[1], 4096)
    assert policy.held_tokens(prompt_mask, token_mask) == sum(g.numel() * int(lengths[g].max()) for g in groups)
    assert policy.held_tokens(prompt_mask, token_mask) < prompts.shape[0] * (prompts.shape[1] + tokens.shape[1])
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        policy.max_tokens_per_micro_batch = 10
        policy.held_tokens(prompt_mask, token_mask)
