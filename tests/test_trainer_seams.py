"""The RL trainer's seams: policy hooks declared (no probes), TorchRL's private collector state read in one adapter, one test loop, one check of the config."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch

from nip_like.agent_modules import build_actor_critic
from nip_like.errors import ConfigError
from nip_like.experiment import build_trainer
from nip_like.lm.actor_critic import LMActor
from nip_like.logging import MetricLogger
from nip_like.trainers import PpoTrainer
from nip_like.trainers.base import TensorDictTrainer
from nip_like.trainers.checked_configs import was_checked
from nip_like.trainers.evaluation import RlEvaluation
from nip_like.trainers.policy_hooks import PolicyHooks, TensorPolicyHooks, hook_names, policy_hooks
from nip_like.trainers.rl import TensorDictRlTrainer
from nip_like.validation import build_scenario, validate
from tests.conftest import smoke_config

PACKAGE = Path(__file__).resolve().parent.parent / "nip_like"
#: A question put to the policy about what it has, instead of a declared hook.
POLICY_PROBE = re.compile(r"\b(?:getattr|hasattr)\(self\.policy\b")
#: A read of a TorchRL collector's private state: its carrier, or any underscored attribute of a collector.
PRIVATE_COLLECTOR = re.compile(r"\._carrier\b|\bcollector\._\w+")


def _code_lines(path: Path) -> list[str]:
    """The lines of ``path`` with comments cut off (docstrings may name what they describe)."""
    return [line.split("#", 1)[0] for line in path.read_text().splitlines()]


def test_the_trainers_ask_no_policy_what_it_has():
    probes = {
        path.name: sum(bool(POLICY_PROBE.search(line)) for line in _code_lines(path))
        for path in sorted((PACKAGE / "trainers").glob("*.py"))
    }
    assert probes and all(count == 0 for count in probes.values()), {name: n for name, n in probes.items() if n}


def test_the_private_collector_state_is_read_in_the_adapter_only():
    reads = {
        f"{path.relative_to(PACKAGE)}:{number}": line.strip()
        for path in sorted(PACKAGE.rglob("*.py"))
        for number, line in enumerate(_code_lines(path), 1)
        if PRIVATE_COLLECTOR.search(line)
    }
    assert list(reads) and all(where.startswith("trainers/collector_state.py:") for where in reads), reads
    assert len(reads) == 1, reads  # one function reads it: collector_state.in_flight


def test_the_language_model_actor_implements_every_hook_as_declared():
    for name in hook_names():
        declared = list(inspect.signature(getattr(PolicyHooks, name)).parameters)
        implemented = list(inspect.signature(getattr(LMActor, name)).parameters)
        assert implemented == declared, name
    assert set(hook_names()) == {
        "after_warm_start", "weights_changed", "pop_sampler_metrics", "pop_padding_fraction", "frozen_sources",
        "whole_states", "save_pretrained", "close_servers", "policy",
    }


def test_a_tensor_policy_gets_hooks_that_do_nothing(tmp_path):
    agents = build_actor_critic(("prover", "verifier"), 3, 2, lambda name, size, out: torch.nn.Linear(size, out))
    hooks = policy_hooks(agents.policy)
    assert isinstance(hooks, TensorPolicyHooks) and isinstance(hooks, PolicyHooks)
    assert hooks.pop_sampler_metrics() == {} and hooks.pop_padding_fraction() is None
    assert hooks.frozen_sources() == {} and hooks.whole_states() == {} and hooks.policy("verifier") is None
    assert hooks.save_pretrained(tmp_path / "last") == [] and not (tmp_path / "last").exists()


def test_a_policy_with_some_hooks_only_is_refused_in_one_line():
    class HalfHooked(torch.nn.Module):
        def weights_changed(self) -> None:
            pass

        def close_servers(self) -> None:
            pass

    with pytest.raises(TypeError) as error:
        policy_hooks(HalfHooked())
    message = str(error.value)
    assert "\n" not in message
    assert "implements the hooks ['weights_changed', 'close_servers']" in message
    assert "but not ['after_warm_start', 'pop_sampler_metrics'," in message


def test_every_tensor_trainer_has_one_test_loop_convention():
    # test() is TensorDictTrainer's: the test context around the hook _run_test_loop, which the RL trainer writes too.
    assert TensorDictRlTrainer.test is TensorDictTrainer.test
    assert "_run_test_loop" in vars(RlEvaluation) and "test" not in vars(RlEvaluation)


def test_a_run_checks_its_trainer_options_once(tmp_path, monkeypatch):
    calls = []
    original = PpoTrainer.validate.__func__
    monkeypatch.setattr(PpoTrainer, "validate", classmethod(lambda cls, *args: calls.append(cls) or original(cls, *args)))
    trainer = build_trainer(smoke_config("trainer.eval.every=0"), tmp_path)
    assert calls == [PpoTrainer]  # by nip_like.validation.validate, not again by the trainer
    assert was_checked(trainer.config)


def test_a_trainer_built_directly_checks_its_options(tmp_path):
    config = smoke_config("trainer.group_size=3")  # the smoke run's 16 environments are no multiple of 3
    with pytest.raises(ConfigError, match=r"trainer.num_envs \(\d+\) must be a multiple of trainer.group_size \(3\)"):
        validate(config)
    assert not was_checked(config)
    with pytest.raises(ConfigError, match=r"must be a multiple of trainer.group_size \(3\)"):
        PpoTrainer(config, build_scenario(config), tmp_path, MetricLogger(config.logger, tmp_path, "direct"))


def test_a_config_changed_after_its_check_is_checked_again():
    config = smoke_config()
    validate(config)
    assert was_checked(config)
    config.trainer.group_size = 3
    assert not was_checked(config)
