"""The command line: one-line errors with exit status 2, user trainers by dotted path.

Bad input is checked in this process, through the same :func:`nip_like.cli.report_errors`
that the entry points use; one subprocess test checks the real exit status and standard
error of ``python -m nip_like``.
"""

import json
import math
import shutil

import pytest

import nip_like.resume
from nip_like.cli import report_errors
from nip_like.experiment import build_trainer, run_experiment
from nip_like.smoke import shrink
from tests.conftest import REPO_ROOT, make_config, run_cli, smoke_config

QUICK = ["preset=smoke", "run.progress_bar=false"]


def assert_one_line_error(result, *fragments):
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def reported(capsys, action, *args) -> str:
    """Run ``action(*args)`` as the entry points do; check exit status 2 and return the one-line error."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_, report_errors():
        action(*args)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def build_from_overrides(overrides: list[str], run_dir):
    """Compose the config from command-line overrides and build its trainer, as ``python -m nip_like`` does."""
    return build_trainer(make_config(*overrides), run_dir)


@pytest.mark.parametrize(
    "override, fragments",
    [
        ("trainer.trainer_type=dpoo", ["unknown trainer 'dpoo'", "'ppo'"]),
        ("scenario.name=mazes", ["unknown scenario 'mazes'", "'hidden_bits'"]),
        ("protocol=judge", ["unknown protocol 'judge'", "'prover_verifier'", "'solo_verifier'"]),
        ("trainer.num_epochs=four", ["trainer.num_epochs", "Integer"]),
        ("trainer.num_epoch=4", ["unknown config key trainer.num_epoch: trainer (TrainerConfig) has no option 'num_epoch'; did you mean num_epochs?"]),
        ("trainer.objective.entropy_strat=0.2", ["unknown config key trainer.objective.entropy_strat", "did you mean entropy_coeff?"]),
        ("trainer.lr=0.1", ["trainer (TrainerConfig) has no option 'lr'; did you mean trainer.optimizer.lr or trainer.pretrain.lr?"]),
        ("trainer.minibatch_size=1000", ["minibatch_size (1000) is larger than the batch"]),
        ("trainer.frames_per_batch=100", ["frames_per_batch (100) must be a multiple of trainer.num_envs (16)"]),
        ("logger=csv_and_more", ["unknown logger 'csv_and_more'", "'tensorboard'"]),
        ("protocol=adp protocol.max_rounds=4", ["unknown config key protocol.max_rounds: protocol (ProofRewardsConfig) has no option 'max_rounds'"]),
        ("trainer.objective.clip_epsilon=wide", ["trainer.objective.clip_epsilon", "Float"]),
        ("run.device=tpu", ["run.device 'tpu'"]),
        ("+trainer.optimizer.lrr=0.1", ["unknown config keys ['trainer.optimizer.lrr']"]),
        ("+scenario.num_bitz=3", ["unknown config keys ['scenario.num_bitz']"]),
    ],
)
def test_bad_config_gives_one_line(tmp_path, capsys, override, fragments):
    line = reported(capsys, build_from_overrides, [*QUICK, *override.split()], tmp_path / "run")
    for fragment in fragments:
        assert fragment in line, line
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize(
    "override, fragment",
    [
        # A config error of Hydra's (composing the config), and one of nip_like's (building the trainer).
        ("trainer.num_epochs=four", "could not be converted to Integer"),
        ("trainer.frames_per_batch=100", "frames_per_batch (100) must be a multiple of trainer.num_envs (16)"),
        # A typo in an option: the nearest options, not Hydra's advice to append the key with +.
        ("trainer.objective.entropy_strat=0.2", "trainer.objective (PPOConfig) has no option 'entropy_strat'; did you mean entropy_coeff?"),
    ],
)
@pytest.mark.slow
def test_bad_config_exits_with_status_2_and_one_line(tmp_path, override, fragment):
    result = run_cli([*QUICK, override, f"hydra.run.dir={tmp_path / 'run'}"])
    assert_one_line_error(result, fragment)
    assert result.stdout == ""
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_typo_in_an_option_gets_the_nearest_options_instead_of_hydras_advice_to_append_it(capsys):
    # Composed by Hydra itself, as python -m nip_like does: its error reaches report_errors as Hydra raised it.
    from hydra import compose, initialize_config_dir

    from nip_like.config import CONFIG_DIR, register_configs

    def compose_with_typo():
        register_configs()
        with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
            compose("config", overrides=["preset=none", "trainer.objective.entropy_strat=0.2"])

    line = reported(capsys, compose_with_typo)
    assert line == "error: unknown config key trainer.objective.entropy_strat: trainer.objective (PPOConfig) has no option 'entropy_strat'; did you mean entropy_coeff?\n"


@pytest.mark.slow  # about a second or more: the fast tier keeps tests under ~0.8 s
def test_bad_checkpoints_give_one_line_and_lose_nothing(tmp_path, capsys):
    run_dir = tmp_path / "run"
    config = smoke_config()
    run_experiment(config, run_dir)
    summary = (run_dir / "summary.json").read_text()
    config_text = (run_dir / "config.yaml").read_text()
    resume = nip_like.resume.main
    # A new run into the same folder refuses instead of overwriting it.
    assert "already holds a run" in reported(capsys, run_experiment, config, run_dir)
    # Resuming may not change hyper-parameters.
    assert "cannot override 'seed=4'" in reported(capsys, resume, [str(run_dir), "seed=4"])
    # A corrupt checkpoint.
    last = run_dir / "checkpoints" / "last.pt"
    good = last.read_bytes()
    last.write_bytes(good[: len(good) // 2])
    assert f"checkpoint {last} is damaged" in reported(capsys, resume, [str(run_dir)])
    # A missing one.
    last.unlink()
    assert "has no checkpoints/last.pt" in reported(capsys, resume, [str(run_dir)])
    assert "not a run folder" in reported(capsys, resume, [str(tmp_path / "nowhere")])
    assert (run_dir / "summary.json").read_text() == summary
    assert (run_dir / "config.yaml").read_text() == config_text
    assert (run_dir / "checkpoints" / "best.pt").is_file()


NAN_TRAINER = '''
from nip_like.trainers import PpoTrainer


class NanTrainer(PpoTrainer):
    def _get_loss_module_and_gae(self):
        loss, gae = super()._get_loss_module_and_gae()
        loss.critic_coeff = float("nan")
        return loss, gae
'''


def test_nan_loss_gives_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "nan_trainer.py").write_text(NAN_TRAINER)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = smoke_config("trainer.trainer_type=nan_trainer.NanTrainer")
    line = reported(capsys, run_experiment, config, tmp_path / "run")
    assert "the loss became nan at iteration 1" in line and "loss_critic=nan" in line, line


@pytest.mark.slow
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


@pytest.mark.slow
def test_main_job_in_test_run_mode_prints_test_metrics(tmp_path):
    # The main job: graph isomorphism (NIP protocol, PPO), one iteration of each loop.
    result = run_cli(["run.test_run=true", f"scenario.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={tmp_path / 'run'}"])
    assert result.returncode == 0, result.stderr
    assert "Training" not in result.stderr  # standard error is a pipe, not a terminal: no progress bar noise
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    shrunk = shrink(make_config("preset=quick", "run.test_run=true"))  # what test-run mode plays: one iteration of the shrunk batch
    assert (summary["trainer_type"], summary["iterations"], summary["frames"]) == ("ppo", 1, shrunk.trainer.frames_per_batch)
    assert shrunk.trainer.frames_per_batch < make_config("preset=quick").trainer.frames_per_batch
    assert summary["gradient_steps"] > 0
    # The printed metrics are the summary's: 8 test episodes (one batch in test-run mode) of graph isomorphism.
    assert "Final test metrics" in result.stdout
    printed = dict(line.split() for line in result.stdout.split("Final test metrics")[1].splitlines()[1:] if line)
    metrics = summary["test_metrics"]
    assert set(printed) == set(metrics) and {"test/accuracy", "test/precision", "test/recall"} <= set(metrics)
    assert all(float(printed[name]) == pytest.approx(value, abs=5e-5) for name, value in metrics.items())
    assert metrics["test/episodes"] == 8 and metrics["test/accuracy"] * 8 == round(metrics["test/accuracy"] * 8)


@pytest.mark.parametrize(
    "module, trainer, overrides, expected",
    [
        # 16 segments of 6 steps, minibatches of 8: 3 iterations x 2 epochs x 2 steps.
        ("segment_ppo_trainer", "SegmentPpoTrainer", ["trainer.minibatch_size=8"], {"frames": 288, "gradient_steps": 12}),
        ("value_regression_trainer", "ValueRegressionTrainer", [], {}),
        ("simpo_trainer", "SimpoTrainer", ["trainer=dpo", "trainer.objective.gamma=0.5"], {"frames": 288}),
    ],
)
def test_documented_example_trainers_run(tmp_path, monkeypatch, run_probe, module, trainer, overrides, expected):
    # In this process; test_user_trainer_in_its_own_file_trains_by_config_override runs one from the command line.
    monkeypatch.syspath_prepend(str(REPO_ROOT / "docs" / "examples"))
    metrics = run_experiment(smoke_config(f"trainer.trainer_type={module}.{trainer}", *overrides), tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["trainer_type"] == f"{module}.{trainer}" and summary["iterations"] == 3
    assert expected.items() <= summary.items()
    assert run_probe.changed() == {"prover", "verifier"}
    assert metrics and all(math.isfinite(value) for value in metrics.values())
    assert (tmp_path / "checkpoints" / "last.pt").is_file()
