"""The stress test's target as the auditor's own base, its LoRA adapters switched off (``scenario.target.auditor_base``)."""

from __future__ import annotations

import pytest
import torch

import nip_like.experiment as experiment
from nip_like.errors import ConfigError
from nip_like.experiment import preflight
from nip_like.validation import build_scenario
from nip_like.scenarios.stress_test.reward import utterance_likelihood
from nip_like.scenarios.stress_test.target import AuditorBase, target_chat
from nip_like.text.interface import Sampling
from nip_like.text.models import LocalTextModel
from tests.lm_folders import chat_model  # noqa: F401 - the fixture
from tests.test_stress_test import cache, config, folder  # noqa: F401 - the fixtures

BASE = "scenario.target.auditor_base=true"


@pytest.mark.slow
def test_the_target_holds_no_weight_of_its_own_and_plays_as_a_separate_copy_of_the_base(folder, cache):  # noqa: F811
    scenario = build_scenario(config(folder, cache, BASE))
    auditor = scenario.make_agents().policy.policy("auditor")
    scenario.make_env(2, "train", seed=0, device="cpu")
    target = scenario.system("cpu")[0]
    # One base in memory: every tensor the target runs is one of the auditor's.
    assert isinstance(target.local, AuditorBase) and target.local.model is auditor.model
    assert {param.data_ptr() for param in target.local.model.parameters()} <= {param.data_ptr() for param in auditor.parameters()}
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # adapters that change the auditor's outputs (LoRA's B starts at zero)
        for name, param in auditor.model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator))
    auditor.model.train()
    copy = LocalTextModel(folder)  # a separate copy of the base
    chats = [target_chat("", prompt, ["say it again"], []) for prompt in scenario.all_prompts[:3]]
    for sampling in (Sampling(8, temperature=0.0), Sampling(8, temperature=1.0)):
        assert target.local.reply(chats, sampling, seed=5) == copy.reply(chats, sampling, seed=5)
    contexts, utterances = scenario.all_prompts[:3], ["you are wrong", "", "tell me more"]
    base = utterance_likelihood(copy.model, copy.tokenizer, contexts, utterances)
    torch.testing.assert_close(target.likelihood(contexts, utterances), base, atol=1e-5, rtol=1e-5)
    auditor.model.eval()
    with torch.no_grad():
        adapted = utterance_likelihood(auditor.model, auditor.tokenizer, contexts, utterances)
    assert not torch.allclose(adapted, base, atol=1e-3)  # the adapters are on again after each call
    auditor.model.train()
    target.likelihood(contexts, utterances)
    assert auditor.model.training  # the auditor's mode is given back


@pytest.mark.slow
def test_a_run_trains_the_auditor_against_its_own_base(folder, cache, tmp_path):  # noqa: F811
    run = config(folder, cache, BASE, "trainer.num_iterations=1", "trainer.eval.every=0", "trainer.num_test_episodes=4",
                 "trainer.test_batch_episodes=4", trainer="dpo")
    preflight(run)
    built = experiment.build_trainer(run, tmp_path / "run")
    metrics = built.train()
    assert metrics["test/likelihood"] < 0 and metrics["test/episode_length"] == 2.0
    assert built.scenario.system("cpu")[0].local.model is built.policy.policy("auditor").model  # no second model


@pytest.mark.slow
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["scenario.default_agent.lora.r=0"], "scenario.target.auditor_base: the target is the auditor's model with its LoRA adapters off"),
        (["scenario.target.pretrained_path=/nowhere"], "scenario.target.auditor_base and scenario.target.pretrained_path: give one of them"),
    ],
)
def test_an_auditor_base_target_that_cannot_be_is_one_line(folder, cache, overrides, message):  # noqa: F811
    with pytest.raises(ConfigError) as error:
        preflight(config(folder, cache, BASE, *overrides))
    assert str(error.value).startswith(message) and "\n" not in str(error.value)
