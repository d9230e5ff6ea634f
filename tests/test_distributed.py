"""Data-parallel runs under torchrun (gloo, 2 ranks) against one process; the rank context with one rank."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from nip_like.checkpoint import load_checked
from nip_like.distributed import Distributed, current
from nip_like.errors import CheckpointError, ConfigError
from nip_like.experiment import run_experiment
from nip_like.logging import read_csv_metric
from nip_like.trainers.rl import TensorDictRlTrainer
from tests.conftest import REPO_ROOT, smoke_config
from tests.test_checkpoint import lm_overrides

PROBE = REPO_ROOT / "tests" / "distributed_probe.py"

#: Tiny graph agents on graph isomorphism, PPO; two minibatches of each optimiser step per rank pair.
GRAPH = ("scenario=graph_isomorphism", "protocol=nip", "scenario.num_pairs=200", "trainer.optimizer.grad_accumulation_steps=2")


def _environment() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "NIP_LIKE_DISTRIBUTED_TIMEOUT": "120"}


def torchrun(args: list[str], script: list[str] | None = None, module: str = "nip_like", **kwargs):
    """The command of a 2-rank torchrun (gloo) of ``python -m <module> args`` (or of ``script``)."""
    target = script if script is not None else ["-m", module]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", *target, *args]


def run(command: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=REPO_ROOT, env=_environment(), capture_output=True, text=True, timeout=timeout)


def cli_args(tmp_path: Path, *overrides: str) -> list[str]:
    return ["preset=smoke", "run.progress_bar=false", "run.num_threads=1", f"scenario.cache_dir={tmp_path / 'data'}", *overrides]


def parameters(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_checked(run_dir / "checkpoints" / "last.pt")["trainer"]["loss_module"]


def _replaying(monkeypatch, record_dir: Path) -> None:
    """Make a one-process run optimise on what rank 0 of a torchrun run recorded (data and generator state)."""
    fill = TensorDictRlTrainer._fill_buffer

    def replay(self, data):
        record = torch.load(record_dir / f"{self.state.iteration + 1}.pt", weights_only=False)
        torch.set_rng_state(record["rng"])
        return fill(self, record["data"])

    monkeypatch.setattr(TensorDictRlTrainer, "_fill_buffer", replay)


def _two_ranks_against_one(tmp_path, monkeypatch, overrides: tuple[str, ...]) -> None:
    args = cli_args(tmp_path, *overrides, "trainer.num_iterations=3")
    distributed = run(torchrun([*args, f"hydra.run.dir={tmp_path / 'two'}"], script=[str(PROBE), str(tmp_path / "record"), "--"]))
    assert distributed.returncode == 0, distributed.stderr[-3000:]

    # One process, optimising on the same global batches (and the same generator state at each update).
    _replaying(monkeypatch, tmp_path / "record")
    run_experiment(smoke_config(*overrides, "trainer.num_iterations=3", f"scenario.cache_dir={tmp_path / 'data'}"), tmp_path / "one")

    two, one = parameters(tmp_path / "two"), parameters(tmp_path / "one")
    assert two.keys() == one.keys()
    initial = None
    for key in one:
        torch.testing.assert_close(two[key], one[key], rtol=1e-5, atol=1e-6, msg=key)
    # The runs trained: the parameters moved from their initial values.
    assert any(not torch.equal(one[key], value) for key, value in load_initial(tmp_path, overrides).items())

    # Only rank 0 wrote the folder: one metrics file per metric, one row per step, one summary.
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["ranks"] == 2 and summary["iterations"] == 3
    assert summary["frames"] == 3 * 96  # the global batch (smoke: 96 frames), half from each rank
    assert [step for step, _ in read_csv_metric(tmp_path / "two", "train/iteration")] == [1, 2, 3]
    assert not (tmp_path / "two" / "run.lock").exists()
    assert "Final test metrics" in distributed.stdout and distributed.stdout.count("Final test metrics") == 1


def load_initial(tmp_path, overrides) -> dict[str, torch.Tensor]:
    """The loss module's state of a freshly built trainer of the same config."""
    from nip_like.experiment import build_trainer

    config = smoke_config(*overrides, f"scenario.cache_dir={tmp_path / 'data'}")
    return build_trainer(config, tmp_path / "initial").loss_module.state_dict()


@pytest.mark.slow
def test_two_ranks_train_graph_agents_like_one_process_on_the_same_global_batch(tmp_path, monkeypatch):
    _two_ranks_against_one(tmp_path, monkeypatch, GRAPH)
