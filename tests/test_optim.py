"""Optimisers, LR schedules and per-agent update schedules."""

import pytest
import torch
from omegaconf import OmegaConf

from nip_like.config import AgentUpdateConfig, OptimizerConfig
from nip_like.errors import ConfigError
from nip_like.optimizers import OPTIMIZERS, LrFactor, build_optimizer
from nip_like.trainers.agent_updates import AgentUpdateSchedule


def params():
    return {"prover": [torch.nn.Parameter(torch.zeros(2))], "verifier": [torch.nn.Parameter(torch.zeros(3))]}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_optimizer_builds_with_per_agent_groups(name):
    config = OmegaConf.structured(OptimizerConfig(name=name, lr=0.1, agent_lr={"verifier": 0.01}))
    optimizer = build_optimizer(config, params())
    assert isinstance(optimizer, OPTIMIZERS[name])
    assert {g["agent"]: g["lr"] for g in optimizer.param_groups} == {"prover": 0.1, "verifier": 0.01}
    # The fastest implementation: fused where PyTorch has one, multi-tensor otherwise.
    implementation = "foreach" if name == "rmsprop" else "fused"
    assert all(group[implementation] is True for group in optimizer.param_groups)
    # It steps (the fused kernels run on the CPU).
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = torch.ones_like(param)
    optimizer.step()
    assert all(param.abs().sum() > 0 for group in optimizer.param_groups for param in group["params"])


def test_bad_optimizer_settings_are_config_errors():
    with pytest.raises(ConfigError, match="one of"):
        build_optimizer(OmegaConf.structured(OptimizerConfig(name="lion")), params())
    with pytest.raises(ConfigError, match="agent_lr names"):
        build_optimizer(OmegaConf.structured(OptimizerConfig(agent_lr={"judge": 1.0})), params())
    with pytest.raises(ConfigError, match="lr_schedule"):
        LrFactor("step", 10, 0.0, 0)


def test_lr_schedules():
    linear = LrFactor("linear", num_iterations=5, final_factor=0.0, warmup_iterations=0)
    assert [linear(i) for i in range(5)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    cosine = LrFactor("cosine", num_iterations=3, final_factor=0.1, warmup_iterations=0)
    assert [cosine(i) for i in range(3)] == pytest.approx([1.0, 0.55, 0.1])
    warm = LrFactor("constant", num_iterations=10, final_factor=0.0, warmup_iterations=3)
    assert [warm(i) for i in range(5)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])


def test_agent_update_schedule():
    config = OmegaConf.create({"prover": OmegaConf.structured(AgentUpdateConfig(start=2, stop=8, every=3))})
    schedule = AgentUpdateSchedule(config, ("prover", "verifier"))
    assert [i for i in range(10) if schedule.is_trained("prover", i)] == [2, 5]
    assert all(schedule.is_trained("verifier", i) for i in range(10))
    assert schedule.trained_agents(0) == ("verifier",)
    with pytest.raises(ConfigError, match="agent_updates names"):
        AgentUpdateSchedule(OmegaConf.create({"judge": {"start": 0, "stop": None, "every": 1}}), ("prover",))
