"""The RL trainer's seams: its parts in two frozen records made by one builder, few attributes written in one file, policy hooks declared (no probes), TorchRL's private collector state read in one adapter, one test loop, one check of the config."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
from pathlib import Path

import pytest
import torch

from nip_like import distributed
from nip_like.agent_modules import build_actor_critic
from nip_like.errors import ConfigError
from nip_like.experiment import build_trainer
from nip_like.lm.actor_critic import LMActor
from nip_like.logging import MetricLogger
from nip_like.objectives.ppo import MultiAgentPPOLoss
from nip_like.trainers import PpoTrainer, collection, update
from nip_like.trainers.base import TensorDictTrainer
from nip_like.trainers.checked_configs import was_checked
from nip_like.trainers.policy_hooks import PolicyHooks, TensorPolicyHooks, hook_names, policy_hooks
from nip_like.trainers.rl import TensorDictRlTrainer
from nip_like.trainers.rl_build import build_agents, build_parts
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
    assert "_run_test_loop" in vars(TensorDictRlTrainer) and "test" not in vars(TensorDictRlTrainer)


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


def _attributes_written(path: Path, classes: set[str]) -> dict[str, str]:
    """``self.<name>`` assignments in the methods of ``classes`` in ``path``: each name, with the file and line."""
    written = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef) and node.name in classes:
            for target in ast.walk(node):
                if isinstance(target, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                    for name in target.targets if isinstance(target, ast.Assign) else [target.target]:
                        if isinstance(name, ast.Attribute) and isinstance(name.value, ast.Name) and name.value.id == "self":
                            written.setdefault(name.attr, f"{path.name}:{target.lineno}")
    return written


def _rl_trainer_classes() -> dict[Path, set[str]]:
    """The modules of nip_like.trainers and, in each, the RL trainer's own classes (its parts' and its subclasses'), not the base's."""
    for module in sorted((PACKAGE / "trainers").glob("*.py")):  # every trainer of the package, imported
        importlib.import_module(f"nip_like.trainers.{module.stem}")
    own = {cls for cls in TensorDictRlTrainer.__mro__ if cls not in TensorDictTrainer.__mro__}
    pending, found = [TensorDictRlTrainer], set(own)
    while pending:
        for sub in pending.pop().__subclasses__():
            if sub.__module__.startswith("nip_like."):
                found.add(sub)
                pending.append(sub)
    by_file: dict[Path, set[str]] = {}
    for cls in found:
        by_file.setdefault(Path(inspect.getfile(cls)), set()).add(cls.__name__)
    return by_file


def test_the_rl_trainer_writes_few_attributes_all_in_one_file(tmp_path):
    written = {}
    for path, classes in _rl_trainer_classes().items():
        written.update(_attributes_written(path, classes))
    assert {where.split(":")[0] for where in written.values()} == {"rl.py"}, written
    assert len(written) <= 8, written
    # What a trained run holds beyond the base trainer's: those names and no other.
    trainer = build_trainer(smoke_config("trainer.num_iterations=1", "trainer.eval.every=1"), tmp_path / "run")
    trainer.train()
    base = set(_attributes_written(Path(inspect.getfile(TensorDictTrainer)), {"Trainer", "TensorDictTrainer"}))
    assert set(vars(trainer)) - base == set(written) - base, sorted(vars(trainer))


def test_the_parts_are_built_once_and_read_only(tmp_path):
    trainer = build_trainer(smoke_config("trainer.eval.every=0"), tmp_path / "run")
    assert trainer.loss_module is trainer.parts.loss_module and trainer.policy is trainer.agents.modules.policy
    with pytest.raises(AttributeError, match="built once"):
        trainer.optimizer = None
    with pytest.raises(dataclasses.FrozenInstanceError):
        trainer.parts.optimizer = None


def test_one_iteration_runs_on_the_parts_with_a_stand_in_policy_and_no_trainer(tmp_path, monkeypatch):
    # The builder makes the agents and the parts from a config and a scenario alone; collect, lay out and update are
    # functions of those parts. The scenario's networks are swapped for one linear layer per agent.
    config = smoke_config("trainer.eval.every=0")
    validate(config)
    scenario = build_scenario(config)
    probe = scenario.make_env(1, "train", 0, "cpu")
    stand_in = build_actor_critic(scenario.agent_names, probe.observation_size, probe.num_actions, lambda name, size, out: torch.nn.Linear(size, out))
    monkeypatch.setattr(scenario, "make_agents", lambda: stand_in)
    cpu, dist = torch.device("cpu"), distributed.current()
    agents = build_agents(config, scenario, tmp_path, cpu, dist)
    assert agents.policy is stand_in.policy and agents.sharded is None
    loss = MultiAgentPPOLoss(agents.policy, agents.value, scenario.agent_names)
    parts = build_parts(config, scenario, agents, (loss, loss.value_estimator), "stand-in", tmp_path, cpu, dist, 1, 1)

    batch = collection.collect(parts.batches, cpu, dist, seed=0)
    assert batch.batch_size[0] == config.trainer.num_envs
    with torch.no_grad():
        parts.advantage_module(batch)
    data = parts.loss_contract.layout_rollouts(batch)
    buffer = update.fill_buffer(None, data, int(config.trainer.minibatch_size), cpu)
    before = [param.detach().clone() for param in stand_in.policy.parameters()]
    records, norms = update.optimize(
        parts.loss_passes, buffer, parts.optimizer, scenario.agent_names, parts.update_settings, dist, 1, lambda: "no checkpoint"
    )
    assert len(records) == update.minibatches_per_epoch(buffer) * config.trainer.num_epochs
    assert len(norms) == len(records) and all(torch.isfinite(norm).all() for norm in norms)
    assert all(not torch.equal(old, new) for old, new in zip(before, stand_in.policy.parameters()))
