"""The plain PPO loop of the docs (docs/examples/plain_ppo_loop.py) computes what the framework's PPO does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig

from nip_like.experiment import build_trainer
from tests.conftest import make_config

EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"

#: Two short iterations, with the framework's extras on: evaluation, checkpoints, CSV logs, diagnostics.
SMALL = (
    "trainer.num_iterations=2",
    "trainer.num_envs=8",
    "trainer.frames_per_batch=96",
    "trainer.num_epochs=2",
    "trainer.minibatch_size=32",
    "trainer.eval.every=1",
    "trainer.eval.num_episodes=16",
    "trainer.num_test_episodes=16",
    "trainer.test_batch_episodes=16",
    "run.checkpoint_every=1",
    "run.progress_bar=false",
    "run.num_threads=1",
)


@pytest.fixture
def plain_ppo_loop(monkeypatch):
    """The example module ``docs/examples/plain_ppo_loop.py``."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import plain_ppo_loop

    return plain_ppo_loop


def framework_parameters(config: DictConfig, run_dir: Path) -> list[torch.Tensor]:
    """Train (and test) with the framework's PPO trainer; return its final parameters."""
    trainer = build_trainer(config, run_dir)
    try:
        trainer.train()
    finally:
        trainer.collector.shutdown()
        trainer.logger.close()
    return [parameter.detach().clone() for parameter in trainer.loss_module.parameters()]


def plain_parameters(module, config: DictConfig) -> list[torch.Tensor]:
    """Train with the example's plain loop; return its final parameters."""
    loop = module.build_plain_loop(config)
    try:
        module.run_plain_loop(loop)
    finally:
        loop.close()
    return [parameter.detach().clone() for parameter in loop.loss_module.parameters()]


def identical(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Return whether two lists of parameters are bit-identical."""
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.slow  # about a second or more: the fast tier keeps tests under ~0.8 s
def test_plain_loop_ends_with_the_frameworks_parameters_bit_for_bit(tmp_path, plain_ppo_loop):
    config = make_config(*SMALL)
    framework = framework_parameters(config, tmp_path)
    plain = plain_parameters(plain_ppo_loop, config)
    assert len(plain) == len(framework) > 0
    for index, (mine, theirs) in enumerate(zip(plain, framework)):
        assert torch.equal(mine, theirs), f"parameter {index} differs by up to {(mine - theirs).abs().max():.3g}"

    # The comparison can fail: another seed, or one objective hyper-parameter
    # changed on the plain side only, ends with other parameters.
    for override in ("seed=1", "trainer.objective.entropy_coeff=0.02"):
        assert not identical(plain_parameters(plain_ppo_loop, make_config(*SMALL, override)), framework), override
