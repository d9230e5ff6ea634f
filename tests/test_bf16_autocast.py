"""Under ``run.autocast_dtype=bfloat16`` the forward passes see every optimiser step, and the
numerically sensitive parts of the update stay in float32.

The train context is one autocast region around the whole loop. With autocast's weight cache on,
the first bfloat16 copy of each trainable weight would serve every later forward pass of the
region, so the passes after an optimiser step would still use the weights from before it (on the
CPU a chat-view PPO run's scored log-probabilities did not move in 4 iterations).

``torch.autocast`` runs every matrix product, linear layer and convolution in bfloat16, also where
the inputs are float32. The models' passes are meant to; the value head, GAE's discounted sums (a
``conv1d`` in TorchRL) and the learning-aware solvers' linear algebra are not: bfloat16 keeps about 3
significant digits of a value, an advantage or a Lanczos projection. On the CPU,
``torch.autocast("cpu", dtype=torch.bfloat16)`` lowers the same ops as on CUDA, so these checks need
no GPU (issue 35).
"""

from __future__ import annotations

import dataclasses

from contextlib import ExitStack

import pytest
import torch

import nip_like.objectives.learning_aware.stackelberg as stackelberg
from nip_like import keys
from nip_like.experiment import build_trainer
from nip_like.lm.models import LMAgentConfig, build_lm_policy
from nip_like.lm.tokenizer import build_tokenizer
from nip_like.lm.value import LMValueHead
from tests.conftest import smoke_config

BF16 = dict(device_type="cpu", dtype=torch.bfloat16)


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_the_value_head_computes_in_float32_under_autocast():
    torch.manual_seed(0)
    head = LMValueHead(64)
    hidden = torch.randn(16, 64) * 3
    expected = head(hidden)
    with torch.autocast(**BF16):
        values = head(hidden)
    assert values.dtype == torch.float32
    torch.testing.assert_close(values, expected)


def test_scores_and_values_of_a_policy_are_float32_under_autocast():
    tokenizer = build_tokenizer(["a", "b", "c", "d", "0", "1"])
    torch.manual_seed(0)
    policy = build_lm_policy(LMAgentConfig(max_new_tokens=6), tokenizer)
    encoded = tokenizer(["a b c d", "1", "0 0 1"], padding=True, return_tensors="pt")
    prompt_ids, prompt_mask = encoded["input_ids"], encoded["attention_mask"].bool()
    with torch.autocast(**BF16):
        sample = policy.sample(prompt_ids, prompt_mask, generator=torch.Generator().manual_seed(0))
        scores = policy.evaluate(prompt_ids, prompt_mask, sample["tokens"], sample["token_mask"])
    assert sample["token_log_probs"].dtype == torch.float32
    assert {name: value.dtype for name, value in scores.items()} == dict.fromkeys(("token_log_probs", "entropy", "value"), torch.float32)
    scores["token_log_probs"].sum().backward()  # bans (-inf log-probs) outside the mask give no NaN gradient
    assert all(torch.isfinite(p.grad).all() for p in policy.parameters() if p.grad is not None)


def _one_iteration_under_autocast(tmp_path, *overrides):
    trainer = build_trainer(smoke_config("run.autocast_dtype=bfloat16", "trainer.num_iterations=1", *overrides), tmp_path / "run")
    original, seen = trainer.advantage_module, {}

    def advantages(batch):
        with torch.autocast("cpu", enabled=False):  # the same batch and critic, autocast off
            seen["expected"] = original(batch.clone())
        original(batch)  # as the trainer runs it
        seen["output"] = batch.clone()

    trainer.parts = dataclasses.replace(trainer.parts, advantage_module=advantages)  # the parts are frozen
    with ExitStack() as stack:
        trainer._build_train_context(stack)
        assert torch.is_autocast_enabled("cpu")
        metrics = trainer.train_iteration()
    return trainer, seen, metrics


def test_advantages_and_value_targets_are_computed_in_float32_under_autocast(tmp_path):
    _, seen, metrics = _one_iteration_under_autocast(tmp_path)
    for key in (keys.ADVANTAGE_KEY, keys.VALUE_TARGET_KEY):
        torch.testing.assert_close(seen["output"].get(key), seen["expected"].get(key))
    assert all(torch.isfinite(torch.tensor(value)) for value in metrics.values())


def test_the_learning_aware_solver_runs_in_float32_under_autocast(tmp_path, monkeypatch):
    calls = []
    solver = stackelberg.low_rank_inverse

    def recorded(hvp, b, rank, damping, **options):
        solved = solver(hvp, b, rank, damping, **options)
        calls.append((torch.is_autocast_enabled("cpu"), solved[0].dtype))
        return solved

    monkeypatch.setattr(stackelberg, "low_rank_inverse", recorded)  # where SPGLoss looks it up
    _one_iteration_under_autocast(tmp_path, "trainer=spg", "trainer.objective.ihvp_method=low_rank")
    assert calls and all(call == (False, torch.float32) for call in calls)


def test_the_forward_passes_of_the_train_context_see_each_optimizer_step(tmp_path):
    trainer = build_trainer(smoke_config("run.autocast_dtype=bfloat16", "trainer.num_iterations=1"), tmp_path / "run")
    layers = [m for m in trainer.loss_module.modules() if isinstance(m, torch.nn.Linear) and m.weight.requires_grad]
    torch.manual_seed(0)
    inputs = [torch.randn(4, layer.in_features) for layer in layers]
    with ExitStack() as stack:
        trainer._build_train_context(stack)
        with torch.no_grad():
            before = [layer(x) for layer, x in zip(layers, inputs)]
        trainer.train_iteration()  # optimiser steps, inside the same autocast region
        with torch.no_grad():
            after = [layer(x) for layer, x in zip(layers, inputs)]
    with torch.no_grad(), torch.autocast(**BF16):  # a fresh region: today's weights
        expected = [layer(x) for layer, x in zip(layers, inputs)]
    moved = [k for k in range(len(layers)) if not torch.equal(before[k], expected[k])]
    assert moved, "the iteration moved no layer"
    for k in moved:
        torch.testing.assert_close(after[k], expected[k], rtol=0, atol=0)
