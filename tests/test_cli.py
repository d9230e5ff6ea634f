"""The command line: one-line errors with exit status 2, user trainers by dotted path."""

import json
import shutil

import pytest

from tests.conftest import REPO_ROOT, run_cli

QUICK = ["preset=smoke", "run.progress_bar=false"]


def assert_one_line_error(result, *fragments):
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.mark.parametrize(
    "override, fragments",
    [
        ("trainer.trainer_type=dpoo", ["unknown trainer 'dpoo'", "'ppo'"]),
        ("scenario.name=mazes", ["unknown scenario 'mazes'", "'hidden_bits'"]),
        ("protocol=judge", ["Could not find 'protocol/judge'", "prover_verifier", "solo_verifier"]),
        ("trainer.num_epochs=four", ["trainer.num_epochs", "Integer"]),
        ("trainer.num_epoch=4", ["Key 'num_epoch' not in 'TrainerConfig'"]),
        ("trainer.minibatch_size=1000", ["minibatch_size (1000) is larger than the batch"]),
        ("trainer.frames_per_batch=100", ["frames_per_batch (100) must be a multiple of trainer.num_envs (16)"]),
        ("logger=csv_and_more", ["Could not find 'logger/csv_and_more'"]),
        ("run.device=tpu", ["run.device 'tpu'"]),
        ("+trainer.optimizer.lrr=0.1", ["unknown config keys ['trainer.optimizer.lrr']"]),
        ("+scenario.num_bitz=3", ["unknown config keys ['scenario.num_bitz']"]),
    ],
)
def test_bad_config_gives_one_line(tmp_path, override, fragments):
    result = run_cli([*QUICK, override, f"hydra.run.dir={tmp_path / 'run'}"])
    assert_one_line_error(result, *fragments)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_bad_checkpoints_give_one_line_and_lose_nothing(tmp_path):
    run_dir = tmp_path / "run"
    assert run_cli([*QUICK, f"hydra.run.dir={run_dir}"]).returncode == 0
    summary = (run_dir / "summary.json").read_text()
    config = (run_dir / "config.yaml").read_text()
    # A new run into the same folder refuses instead of overwriting it.
    assert_one_line_error(run_cli([*QUICK, f"hydra.run.dir={run_dir}"]), "already holds a run")
    # Resuming may not change hyper-parameters.
    assert_one_line_error(run_cli([str(run_dir), "seed=4"], module="nip_like.resume"), "cannot override 'seed=4'")
    # A corrupt checkpoint.
    last = run_dir / "checkpoints" / "last.pt"
    good = last.read_bytes()
    last.write_bytes(good[: len(good) // 2])
    assert_one_line_error(run_cli([str(run_dir)], module="nip_like.resume"), "corrupt or unreadable")
    # A missing one.
    last.unlink()
    assert_one_line_error(run_cli([str(run_dir)], module="nip_like.resume"), "has no checkpoints/last.pt")
    assert_one_line_error(run_cli([str(tmp_path / "nowhere")], module="nip_like.resume"), "not a run folder")
    assert (run_dir / "summary.json").read_text() == summary
    assert (run_dir / "config.yaml").read_text() == config
    assert (run_dir / "checkpoints" / "best.pt").is_file()


NAN_TRAINER = '''
from nip_like.trainers import PpoTrainer


class NanTrainer(PpoTrainer):
    def _get_loss_module_and_gae(self):
        loss, gae = super()._get_loss_module_and_gae()
        loss.critic_coeff = float("nan")
        return loss, gae
'''


def test_nan_loss_gives_one_line(tmp_path):
    (tmp_path / "nan_trainer.py").write_text(NAN_TRAINER)
    result = run_cli([*QUICK, "trainer.trainer_type=nan_trainer.NanTrainer", "hydra.run.dir=run"], cwd=tmp_path)
    assert_one_line_error(result, "the loss became nan at iteration 1", "loss_critic=nan")


def test_user_trainer_in_its_own_file_trains_by_config_override(tmp_path):
    shutil.copy(REPO_ROOT / "docs" / "examples" / "a2c_trainer.py", tmp_path)
    result = run_cli(
        [*QUICK, "trainer.trainer_type=a2c_trainer.A2CTrainer", "trainer.num_epochs=1", "hydra.run.dir=run"],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["trainer_type"] == "a2c_trainer.A2CTrainer"
    assert summary["gradient_steps"] == 3 * 3
    assert "test/accuracy" in result.stdout


def test_main_job_in_test_run_mode_prints_test_metrics(tmp_path):
    # The main job: graph isomorphism (NIP protocol, PPO), one iteration of each loop.
    result = run_cli(["run.test_run=true", f"scenario.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={tmp_path / 'run'}"])
    assert result.returncode == 0, result.stderr
    assert "Final test metrics" in result.stdout and "test/accuracy" in result.stdout
    assert "test/precision" in result.stdout  # a graph-isomorphism metric
    assert "Training" in result.stderr and "Testing" in result.stderr  # the progress bars


@pytest.mark.parametrize(
    "module, trainer, overrides",
    [
        ("segment_ppo_trainer", "SegmentPpoTrainer", ["trainer.minibatch_size=8"]),
        ("value_regression_trainer", "ValueRegressionTrainer", []),
        ("simpo_trainer", "SimpoTrainer", ["trainer=dpo", "trainer.objective.gamma=0.5"]),
    ],
)
def test_documented_example_trainers_run(tmp_path, module, trainer, overrides):
    shutil.copy(REPO_ROOT / "docs" / "examples" / f"{module}.py", tmp_path)
    result = run_cli([*QUICK, f"trainer.trainer_type={module}.{trainer}", *overrides, "hydra.run.dir=run"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "run" / "summary.json").is_file()
    assert (tmp_path / "run" / "checkpoints" / "last.pt").is_file()
