"""No tensor is created inside ``nip_like`` without the device of the data it meets (CI's stand-in for a GPU).

On the CPU a tensor made without ``device=`` lands where the data is, so a
missing device only shows on a GPU. :class:`~tests.device_guard.DeviceGuard`
records every such factory call made from the package while one iteration of
every RL trainer trains graph agents and language-model agents (the chat view
with LoRA adapters); the places that build on the CPU on purpose are listed in
:data:`~tests.device_guard.CPU_ON_PURPOSE`. A second test builds language-model
agents on the meta device and checks that every parameter and buffer of the
policy, its value head and its reference is there too.
"""

from __future__ import annotations

import pytest
import torch

from nip_like.experiment import build_trainer
from tests.conftest import fast_trainers, smoke_config, tiered
from tests.device_guard import DeviceGuard
from tests.lm_folders import chat_model  # noqa: F401 - the fixture
from tests.test_duplicates_scenario import RL_TRAINERS
from tests.test_gi_scenario import gi_config
from tests.test_lm_chat import chat_config


def _train_guarded(config, folder) -> dict[str, int]:
    trainer = build_trainer(config, folder)
    with DeviceGuard() as guard:
        trainer.train()
    return guard.found


def _report(found: dict[str, int]) -> str:
    return "tensors made without a device (pass device= or build from a tensor of the data):\n" + "\n".join(
        f"  {where} x{count}" for where, count in sorted(found.items())
    )


#: The fast tier guards the first standard objective and the first learning-aware trainer; the full run guards them all.
GUARDED = tiered(RL_TRAINERS, fast=[fast_trainers(RL_TRAINERS)[0], fast_trainers(RL_TRAINERS)[-1]])


@pytest.mark.parametrize("trainer", GUARDED)
def test_graph_agents_train_without_a_tensor_off_their_device(tmp_path_factory, trainer):
    cache = tmp_path_factory.getbasetemp() / "device_guard_gi"
    config = gi_config(cache, "protocol=nip", f"trainer={trainer}", "trainer.num_iterations=1", "trainer.group_size=4", "trainer.eval.every=1")
    found = _train_guarded(config, tmp_path_factory.mktemp("run"))
    assert not found, _report(found)


#: The fast tier guards the first standard objective on chat agents (the graph agents' guard above adds a learning-aware trainer); the full run guards them all.
CHAT_GUARDED = tiered(RL_TRAINERS, fast=fast_trainers(RL_TRAINERS)[:1])


@pytest.mark.parametrize("trainer", CHAT_GUARDED)
def test_chat_agents_with_lora_train_without_a_tensor_off_their_device(chat_model, tmp_path, trainer):
    config = chat_config(
        chat_model("qwen2"), tmp_path, f"trainer={trainer}", "scenario.default_agent.lora.r=4", "trainer.group_size=2",
        "trainer.eval.every=1", "trainer.eval.num_episodes=4",
    )
    found = _train_guarded(config, tmp_path / "run")
    assert not found, _report(found)


def test_the_guard_finds_a_tensor_made_without_a_device():
    from nip_like.objectives import masking

    with DeviceGuard() as guard:
        torch.zeros(3)  # made here, outside the package: not its business
        masking.per_agent_mean(torch.ones(2, 3), torch.ones(2, 3, dtype=torch.bool))
    assert not guard.found
    source = "import torch\ndef made_here():\n    return torch.zeros(())\n"
    namespace: dict = {}
    exec(compile(source, masking.__file__, "exec"), namespace)  # a function that claims to live in the package
    with DeviceGuard() as guard:
        namespace["made_here"]()
    assert list(guard.found) == ["nip_like/objectives/masking.py:3 (made_here: torch.zeros)"]


@pytest.mark.parametrize("shared_body", [True, False])
@pytest.mark.parametrize("lora", [False, True])
def test_a_policy_built_around_a_model_on_another_device_keeps_everything_there(chat_model, shared_body, lora):
    """The meta device stands in for a GPU: a policy, value head and reference built around a moved model stay with it."""
    from nip_like.lm.actor_critic import LMActor
    from nip_like.lm.lora import LoraOptions, add_lora
    from nip_like.lm.models import LMAgentConfig, build_lm
    from nip_like.lm.policy import LMPolicy
    from nip_like.lm.value import LMValueHead

    model, tokenizer = build_lm(LMAgentConfig(pretrained_path=str(chat_model("qwen2"))))
    if lora:
        model = add_lora(model, LoraOptions(r=4))
    model = model.to("meta")
    policy = LMPolicy(model, tokenizer, max_new_tokens=4, value_head=LMValueHead.for_model(model, shared_body=shared_body))
    reference = LMActor({"prover": policy}, 4).frozen_reference()
    tensors = {**dict(policy.named_parameters()), **dict(policy.named_buffers()), **dict(reference.named_buffers())}
    tensors.update({f"reference.{name}": value for name, value in reference.named_parameters()})
    elsewhere = sorted(name for name, tensor in tensors.items() if tensor.device.type != "meta")
    assert not elsewhere, f"not on the model's device: {elsewhere}"


@pytest.mark.parametrize("lora", [False, True])
def test_a_sharded_agent_keeps_every_shard_and_buffer_on_its_models_device(chat_model, tmp_path, lora):
    """FSDP2 as ``run.fsdp`` applies it (nip_like.lm.sharding.shard_module: each decoder layer, the model, the value head's
    body and linear layer), on a model on the meta device standing in for a GPU: no shard or buffer lands elsewhere."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from nip_like.lm.lora import LoraOptions, add_lora
    from nip_like.lm.models import LMAgentConfig, build_lm
    from nip_like.lm.policy import LMPolicy
    from nip_like.lm.sharding import is_sharded, shard_module
    from nip_like.lm.value import LMValueHead

    model, tokenizer = build_lm(LMAgentConfig(pretrained_path=str(chat_model("qwen2"))))
    if lora:
        model = add_lora(model, LoraOptions(r=4))
    model = model.to("meta")
    policy = LMPolicy(model, tokenizer, max_new_tokens=4, value_head=LMValueHead.for_model(model, shared_body=False))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        for module in (policy.model, policy.value_head.body, policy.value_head.linear):
            shard_module(module, mesh)
        tensors = {**dict(policy.named_parameters()), **dict(policy.named_buffers())}
        assert any(is_sharded(tensor) for tensor in tensors.values())
        local = {name: tensor.to_local() if is_sharded(tensor) else tensor for name, tensor in tensors.items()}
        elsewhere = sorted(name for name, tensor in local.items() if tensor.device.type != "meta")
        assert not elsewhere, f"not on the model's device: {elsewhere}"
    finally:
        dist.destroy_process_group()


def test_an_agent_left_out_of_a_step_gets_a_norm_on_its_own_device():
    """torch's norm of an empty gradient list is a CPU tensor; the step's norms must stack with the others' (meta here)."""
    from nip_like.trainers.update import optimizer_step

    moved, idle = torch.nn.Parameter(torch.ones(3, device="meta")), torch.nn.Parameter(torch.ones(2, device="meta"))
    moved.grad = torch.ones(3, device="meta")
    optimizer = torch.optim.SGD([{"params": [moved], "agent": "prover"}, {"params": [idle], "agent": "verifier"}], lr=0.1)
    for max_grad_norm in (1.0, None):
        norms = optimizer_step(optimizer, ("prover", "verifier"), max_grad_norm)
        assert norms.device.type == "meta" and norms.shape == (2,)
