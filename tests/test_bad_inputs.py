"""Every bad input: one line naming what is wrong, exit status 2, and nothing already written changes.

Each case is a command line's overrides, run in this process the way the
entry points run it (compose, check, build, start training) inside
:func:`nip_like.cli.report_errors`, against the folder of a finished run. The
error must be a single ``error: ...`` line that contains the fragment (which
names the field), the exit status 2, and every file of the existing run must
be byte-for-byte as it was.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from nip_like.cli import report_errors
from nip_like.experiment import build_trainer, run_experiment
from tests.conftest import run_cli, smoke_config

#: (overrides, a fragment of the one-line error that names the field or option).
CASES = [
    # unknown keys, options and names
    ("trainer.num_epoch=4", "trainer (TrainerConfig) has no option 'num_epoch'; did you mean num_epochs?"),
    ("+trainer.optimizer.lrr=0.1", "trainer.optimizer.lrr"),
    ("+scenario.num_bitz=3", "scenario.num_bitz"),
    ("+protocol.rounds=3", "protocol.rounds"),
    ("trainer.trainer_type=dpoo", "unknown trainer 'dpoo'"),
    ("scenario.name=mazes", "unknown scenario 'mazes'"),
    ("protocol=judge", "unknown protocol 'judge'"),
    ("logger=csv_and_more", "unknown logger 'csv_and_more'"),
    ("trainer=adam", "unknown trainer 'adam'"),
    ("preset=fast", "unknown preset 'fast'"),
    ("+trainer.agent_updates.judge={start:1}", "judge"),
    # types
    ("trainer.num_epochs=four", "trainer.num_epochs"),
    ("trainer.objective.clip_epsilon=wide", "trainer.objective.clip_epsilon"),
    ("run.progress_bar=maybe", "run.progress_bar"),
    # values outside their declared range or set
    ("trainer.optimizer.lr=-0.1", "trainer.optimizer.lr must be > 0"),
    ("trainer.optimizer.max_grad_norm=-1", "trainer.optimizer.max_grad_norm must be > 0"),
    ("trainer.optimizer.momentum=1.5", "trainer.optimizer.momentum must be in [0, 1)"),
    ("trainer.optimizer.lr_final_factor=2", "trainer.optimizer.lr_final_factor must be in [0, 1]"),
    ("trainer.optimizer.warmup_iterations=-3", "trainer.optimizer.warmup_iterations must be >= 0"),
    ("trainer.optimizer.betas=[0.9]", "trainer.optimizer.betas must be a list of 2"),
    ("+trainer.optimizer.agent_lr.prover=-1", "trainer.optimizer.agent_lr must be all > 0"),
    ("trainer.objective.gamma=1.5", "trainer.objective.gamma must be in [0, 1]"),
    ("trainer.objective.lmbda=-0.5", "trainer.objective.lmbda must be in [0, 1]"),
    ("trainer.objective.clip_epsilon=-0.2", "trainer.objective.clip_epsilon must be > 0"),
    ("trainer.objective.entropy_coeff=nan", "trainer.objective.entropy_coeff must be >= 0"),
    ("trainer.objective.kl_target=0", "trainer.objective.kl_target must be > 0"),
    ("trainer.objective.variant=trust", "trainer.objective.variant must be one of ['clip', 'kl']"),
    ("trainer.num_envs=0", "trainer.num_envs must be >= 1"),
    ("trainer.test_batch_episodes=0", "trainer.test_batch_episodes must be >= 1"),
    ("trainer.num_test_episodes=0", "trainer.num_test_episodes must be >= 1"),
    ("trainer.divergence_bound=0", "trainer.divergence_bound must be > 0"),
    ("trainer.eval.every=-1", "trainer.eval.every must be >= 0"),
    ("trainer.eval.early_stopping_patience=-2", "trainer.eval.early_stopping_patience must be >= 0"),
    ("trainer.eval.mode=best", "trainer.eval.mode must be one of ['max', 'min']"),
    ("run.checkpoint_every=-1", "run.checkpoint_every must be >= 0"),
    ("run.num_threads=0", "run.num_threads must be >= 1"),
    ("run.autocast_dtype=int8", "run.autocast_dtype must be one of"),
    ("run.autocast_dtype=bf16", "run.autocast_dtype must be one of"),
    ("logger.diagnostics_every=-1", "logger.diagnostics_every must be >= 0"),
    ("seed=-1", "seed must be >= 0"),
    ("scenario.default_agent.hidden_size=-4", "scenario.default_agent.hidden_size must be >= 1"),
    ("scenario.num_bits=40", "scenario.num_bits must be in [1, 16]"),
    ("protocol.message_rounds=0", "protocol.message_rounds must be >= 1"),
    # settings that do not fit together, or that name what does not exist
    ("trainer.minibatch_size=1000", "trainer.minibatch_size (1000) is larger than the batch"),
    ("trainer.frames_per_batch=100", "trainer.frames_per_batch (100) must be a multiple of trainer.num_envs"),
    ("trainer.eval.test_checkpoint=best trainer.eval.every=0", "trainer.eval.test_checkpoint=best needs evaluation"),
    ("trainer.eval.metric=eval/acuracy", "trainer.eval.metric 'eval/acuracy' is not among the evaluation metrics"),
    ("trainer.optimizer.name=lion", "trainer.optimizer.name must be one of"),
    ("trainer=dpo trainer.group_size=1", "set trainer.group_size >= 2"),
    ("trainer=ipo trainer.objective.loss_type=sigmoid", "trainer.objective.loss_type"),
    ("+trainer.optimizer.agent_lr.judge=0.1", "judge"),
    ("run.device=tpu", "run.device 'tpu'"),
    ("scenario.cache_dir=/dev/null/cache scenario=graph_isomorphism protocol=nip", "scenario.cache_dir"),
    # a scenario without what the trainer requires of it (nip_like.scenarios.base capabilities)
    ("trainer=solo_agent", "trainer solo_agent needs a scenario with demonstrations or labelled data "
     "(Demonstrating or Labelled); scenario 'hidden_bits' has none; trainers for it: "),
    # (preset=none: the smoke preset sets the RL loop's fields, which a text trainer refuses; see the next case)
    ("preset=none trainer=expert_iteration", "trainer expert_iteration needs a scenario with text agents in chat "
     "(ChatGame); scenario 'hidden_bits' has none"),
    ("trainer=expert_iteration", "Key 'num_envs' not in 'TextTrainerConfig'"),
    ("scenario=duplicates_chat protocol=nip", "trainer ppo needs a scenario with agents that are torch modules "
     "(TensorGame); scenario 'duplicates_chat' has none; trainers for it: expert_iteration, malt"),
    ("trainer.pretrain.agents=[verifier]", "trainer.pretrain.agents needs a scenario with demonstrations or labelled data"),
]


def _hashes(folder: Path) -> dict[str, str]:
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


@pytest.fixture(scope="module")
def existing_run(tmp_path_factory) -> Path:
    """A finished run whose folder every bad command is pointed at."""
    folder = tmp_path_factory.mktemp("existing") / "run"
    run_experiment(smoke_config("trainer.num_iterations=1", "logger=csv"), folder)
    return folder


def _run_command(overrides: list[str], run_dir: Path) -> None:
    """What ``python -m nip_like`` does with ``overrides``, up to the first training step."""
    trainer = build_trainer(smoke_config(*overrides), run_dir)
    trainer.check_eval_metric()


def test_there_are_at_least_forty_cases():
    assert len(CASES) >= 40 and len({overrides for overrides, _ in CASES}) == len(CASES)


@pytest.mark.parametrize("overrides, fragment", CASES, ids=[overrides for overrides, _ in CASES])
def test_bad_input_is_one_line_exit_2_and_loses_nothing(existing_run, capsys, overrides, fragment):
    before = _hashes(existing_run)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info, report_errors():
        _run_command(overrides.split(), existing_run)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert fragment in err, err
    assert _hashes(existing_run) == before


@pytest.mark.slow  # the command line end to end (6 s); the same refusals in process are among CASES above
def test_a_scenario_without_what_the_trainer_requires_is_refused_before_the_run_folder_is_made(tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli(["preset=smoke", "trainer=solo_agent", f"hydra.run.dir={run_dir}"])
    assert result.returncode == 2
    assert result.stderr.startswith("error: trainer solo_agent needs a scenario with demonstrations or labelled data")
    assert result.stderr.count("\n") == 1, result.stderr
    assert not run_dir.exists()
