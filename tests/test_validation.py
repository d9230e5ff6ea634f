"""The config checks in one pass (nip_like.validation): every problem reported together, one line each, before any folder."""

import pytest
from hydra import initialize_config_dir

from nip_like.cli import report_errors
from nip_like.config import CONFIG_DIR
from nip_like.errors import ConfigError
from nip_like.experiment import build_trainer, preflight
from nip_like.sweeps.grid import _make_job
from nip_like.validation import validate, validate_schemas
from tests.conftest import make_config, run_cli

QUICK = ["preset=smoke", "run.progress_bar=false"]


def problems_of(*overrides: str) -> list[str]:
    """The lines of the ConfigError that validating the config of ``overrides`` raises."""
    with pytest.raises(ConfigError) as error:
        validate(make_config(*QUICK, *overrides))
    return str(error.value).splitlines()


def test_problems_in_several_sections_are_reported_together():
    lines = problems_of(
        "trainer.optimizer.lr=-0.1",
        "trainer.objective.gamma=1.5",
        "run.checkpoint_every=-1",
        "run.device=tpu",
        "+scenario.num_bitz=3",
        "+protocol.rounds=2",
    )
    expected = [
        "unknown config keys ['scenario.num_bitz', 'protocol.rounds']",
        "trainer.optimizer.lr must be > 0, got -0.1",
        "trainer.objective.gamma must be in [0, 1], got 1.5",
        "run.checkpoint_every must be >= 0, got -1",
        "run.device 'tpu' is not a torch device",
    ]
    assert len(lines) == len(expected), lines
    for fragment in expected:
        assert sum(fragment in line for line in lines) == 1, (fragment, lines)


def test_the_trainers_relations_are_all_reported_when_its_fields_are_fine():
    lines = problems_of("trainer.frames_per_batch=100", "trainer.eval.metric=reward", "trainer.group_size=3")
    assert lines == [
        "trainer.num_envs (16) must be a multiple of trainer.group_size (3)",
        "trainer.frames_per_batch (100) must be a multiple of trainer.num_envs (16)",
        "trainer.eval.metric must name an evaluation metric (eval/...), got 'reward'",
    ]


def test_a_broken_section_is_not_checked_further():
    # group_size=0 is out of range: the relations that divide by it are not checked (nor do they crash).
    assert problems_of("trainer.group_size=0", "trainer.frames_per_batch=100") == [
        "trainer.group_size must be >= 1, got 0"
    ]
    # An unknown scenario: its options, and what the trainer requires of it, are not checked; the rest is.
    lines = problems_of("scenario.name=mazes", "trainer.num_epochs=0")
    assert len(lines) == 2 and lines[0].startswith("unknown scenario 'mazes'"), lines
    assert lines[1] == "trainer.num_epochs must be >= 1, got 0"


def test_components_hooks_and_capabilities_are_in_the_pass():
    # The capability a trainer requires, and a learning-aware trainer's own hook, beside a range.
    lines = problems_of("trainer=pspg", "protocol=solo_verifier", "trainer.optimizer.eps=0.0")
    assert lines[0] == "trainer.optimizer.eps must be > 0, got 0.0"
    assert len(lines) == 1  # the trainer's section is broken: its hook waits for the fix
    lines = problems_of("trainer=pspg", "protocol=solo_verifier", "run.checkpoint_every=-2")
    assert lines[0] == "run.checkpoint_every must be >= 0, got -2"
    assert any("needs a protocol with leaders and followers" in line for line in lines[1:]), lines
    # A capability the scenario lacks (hidden bits has no labelled data to pretrain on), with a bad logger field.
    lines = problems_of("trainer.pretrain.agents=[verifier]", "logger.diagnostics_every=-1")
    assert lines[0] == "logger.diagnostics_every must be >= 0, got -1"
    assert lines[1].startswith("trainer.pretrain.agents needs a scenario with demonstrations or labelled data"), lines


def test_a_valid_config_passes_and_builds_its_scenario():
    checked = validate(make_config(*QUICK))
    assert checked.trainer.name == "ppo" and checked.scenario.protocol.name == make_config(*QUICK).protocol.name


@pytest.mark.slow  # a subprocess: seconds of start-up
def test_the_command_line_prints_a_line_per_problem_and_makes_no_folder(tmp_path):
    result = run_cli([*QUICK, "trainer.frames_per_batch=100", "run.checkpoint_every=-1", f"hydra.run.dir={tmp_path / 'run'}"])
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == [
        "error: run.checkpoint_every must be >= 0, got -1",
        "error: trainer.frames_per_batch (100) must be a multiple of trainer.num_envs (16)",
    ], result.stderr
    assert not (tmp_path / "run").exists()


def test_in_process_entry_points_report_every_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_, report_errors():
        build_trainer(make_config(*QUICK, "trainer.num_epochs=0", "seed=-1"), tmp_path / "run")
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: seed must be >= 0, got -1",
        "error: trainer.num_epochs must be >= 1, got 0",
    ]
    assert not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match="trainer.num_epochs"):
        preflight(make_config(*QUICK, "trainer.num_epochs=0"))


def test_a_sweep_job_keeps_its_problems_on_one_line(tmp_path):
    with pytest.raises(ConfigError) as error:
        validate_schemas(make_config(*QUICK, "trainer.num_epochs=0", "seed=-1"))
    assert len(str(error.value).splitlines()) == 2
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        job = _make_job([*QUICK, "trainer.num_epochs=0", "seed=-1"], [], tmp_path)
    assert job.error == "seed must be >= 0, got -1; trainer.num_epochs must be >= 1, got 0"


def test_test_rollouts_must_divide_the_test_batches():
    assert problems_of("trainer.test_rollouts=3") == [
        "trainer.num_test_episodes (64) must be a multiple of trainer.test_rollouts (3)",
        "trainer.test_batch_episodes (32) must be a multiple of trainer.test_rollouts (3)",
    ]


def test_a_run_folder_from_before_an_option_existed_is_still_checked_and_evaluated(tmp_path):
    from nip_like.evaluate import evaluate_run
    from nip_like.experiment import run_experiment
    from tests.conftest import smoke_config

    run_dir = tmp_path / "run"
    tested = run_experiment(smoke_config(), run_dir, handle_signals=False)
    config = run_dir / "config.yaml"
    lines = config.read_text().splitlines()
    old = [line for line in lines if not line.strip().startswith("test_rollouts:")]
    assert len(old) == len(lines) - 1
    config.write_text("\n".join(old) + "\n")  # as a run of the version before trainer.test_rollouts wrote it
    assert evaluate_run(run_dir)["metrics"] == tested
