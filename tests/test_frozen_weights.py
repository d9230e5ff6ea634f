"""A frozen co-player stays frozen through the update: no gradient, no logged loss, no weights in the checkpoints."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.objectives.value import GAE

from nip_like import experiment
from nip_like.checkpoint import load_checked
from nip_like.experiment import run_experiment
from nip_like.trainers.grad_flags import requires_grad_kept
from tests.conftest import make_config, stopped_and_resumed


def test_value_estimates_keep_each_parameter_trainable_or_frozen():
    trained, frozen = nn.Linear(3, 1), nn.Linear(3, 1)
    frozen.requires_grad_(False)
    value = TensorDictModule(lambda obs: trained(obs) + frozen(obs), in_keys=["observation"], out_keys=["state_value"])
    value.extra = nn.ModuleList([trained, frozen])  # trained first: torchrl's hold_out_net reads the first parameter only
    gae = GAE(gamma=0.9, lmbda=0.9, value_network=value)
    batch = TensorDict(
        {
            "observation": torch.randn(2, 4, 3),
            "next": {
                "observation": torch.randn(2, 4, 3),
                "reward": torch.randn(2, 4, 1),
                "done": torch.zeros(2, 4, 1, dtype=torch.bool),
                "terminated": torch.zeros(2, 4, 1, dtype=torch.bool),
            },
        },
        batch_size=[2, 4],
    )
    with torch.no_grad(), requires_grad_kept(value):
        gae(batch.clone())
    assert trained.weight.requires_grad and not frozen.weight.requires_grad
    with torch.no_grad():  # what the trainer guards against: torchrl turns every flag on
        gae(batch.clone())
    assert frozen.weight.requires_grad


def token_game(tmp_path, *overrides: str):
    """The lm_quick game (token view, full fine-tuning) at a few seconds an iteration, no warm start."""
    return make_config(
        "preset=lm_quick", "scenario.num_lists=200", "trainer.pretrain.agents=[]", "trainer.num_envs=4",
        "trainer.frames_per_batch=32", "trainer.minibatch_size=16", "trainer.num_epochs=1", "trainer.eval.every=0",
        "trainer.num_test_episodes=8", "trainer.test_batch_episodes=8", "run.progress_bar=false", "logger=none",
        f"scenario.cache_dir={tmp_path / 'data'}", *overrides,
    )


def tensors(value):
    """Every tensor in a nested checkpoint state."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict) or hasattr(value, "items"):
        for item in value.values():
            yield from tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors(item)


@pytest.mark.slow
def test_a_frozen_verifier_of_the_token_view_trains_nothing_logs_no_loss_and_is_not_checkpointed(tmp_path, monkeypatch):
    run_experiment(token_game(tmp_path, "trainer.num_iterations=1"), tmp_path / "earlier")
    frozen = (f"+scenario.agents.verifier={{frozen_from: {tmp_path / 'earlier'}}}", "trainer.num_iterations=2", "run.checkpoint_every=1")
    trainer = experiment.build_trainer(token_game(tmp_path, *frozen), tmp_path / "run")
    verifier = list(trainer.policy.policy("verifier").parameters())
    before = [param.detach().clone() for param in verifier]
    metrics = trainer.train_iteration()
    # The prover trained and logged its losses; the verifier is still frozen, unchanged, and logged none.
    assert "agents/prover/loss/policy" in metrics
    assert not [name for name in metrics if name.startswith("agents/verifier/loss/")]
    assert not any(param.requires_grad for param in verifier)
    assert all(torch.equal(param, old) for param, old in zip(verifier, before))
    trainer.save_checkpoint("last")
    saved = list(tensors(load_checked(trainer.checkpoint_dir / "last.pt")["trainer"]))
    held = [index for index, param in enumerate(verifier) if any(t.shape == param.shape and torch.equal(t, param) for t in saved)]
    assert not held, f"last.pt holds {len(held)} of the frozen verifier's {len(verifier)} tensors"
    # Resumed, the verifier's weights come back from its source: the same run as one without a stop.
    reference = run_experiment(token_game(tmp_path, *frozen), tmp_path / "reference")
    assert stopped_and_resumed(monkeypatch, token_game(tmp_path, *frozen), tmp_path / "resumed", 1) == reference
