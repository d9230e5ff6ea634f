"""PureTextRlTrainer and expert iteration: stages, state, resume at every stage boundary, failed jobs."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from nip_like.cli import compose_config
from nip_like.config import hyper_parameters, run_id
from nip_like.errors import ConfigError, FineTuneError
from nip_like.evaluate import evaluate_run
from nip_like.experiment import build_trainer, preflight, run_experiment
from nip_like.scenarios.duplicates.chat import ScriptedDuplicatesModel, read_list_line
from nip_like.text.interface import Sampling, TextModel
from nip_like.text.rollouts import play_episodes
from nip_like.errors import RunInterrupted
from nip_like.text.jobs import SubmititFineTuneBackend
from nip_like.trainers.text import STAGES, PureTextRlTrainer
from tests.conftest import built_once, run_cli
from tests.test_text_jobs import attempts, kill_when_started

TINY = (
    "preset=text_quick",
    "logger=csv",
    "run.progress_bar=false",
    "run.num_threads=1",
    "scenario.num_lists=600",
    "scenario.scripted_provers=false",  # both agents are local models (the preset scripts the prover)
    "scenario.default_model.hidden_size=16",
    "scenario.default_model.num_layers=1",
    "scenario.default_model.num_heads=2",
    "scenario.default_model.intermediate_size=32",
    "trainer.num_iterations=2",
    "trainer.episodes=16",
    "trainer.test_episodes=16",
    "trainer.warm_start_episodes=24",
    "trainer.warm_start_epochs=1",
    "trainer.test_scheme=first_and_last",
)


#: Expert iteration keeping every turn, so that every group has a job each iteration.
KEEP_ALL = "trainer.objective.reward_threshold=0.0"


def config(*overrides: str):
    return compose_config([*TINY, *overrides])


#: No warm start: a run whose first fine-tune jobs are iteration 0's. For the tests whose claim is about a later
#: stage, this saves the two warm-start jobs (a process each, about 10 s of CPU) in the test and in its reference.
NO_WARM_START = "trainer.warm_start_episodes=0"


def reference_run(tmp_path_factory, name: str, *overrides: str) -> tuple[Path, dict]:
    """A finished run of ``config(*overrides)`` and its final test metrics, made once for the whole test session.

    The uninterrupted runs that the resume, retry and fault tests end against
    (here and in tests/test_text_faults.py) are made once, under a file lock in
    the folder that every pytest-xdist worker's base folder is in, and read
    back by every later caller: each costs four fine-tune processes.

    Parameters
    ----------
    tmp_path_factory : pytest.TempPathFactory
        The session's temporary folders.
    name : str
        The reference's folder name (one per config).
    *overrides : str
        Overrides of :func:`config`.

    Returns
    -------
    tuple[Path, dict]
        The run folder (read only) and ``summary.json``'s ``test_metrics``, which a
        run returns as its final metrics (``test_a_run_goes_through_every_stage...``).
    """

    def build(folder: Path) -> None:
        run_experiment(config(*overrides), folder / "run")

    run = built_once(tmp_path_factory, f"text_reference_{name}", "run/summary.json", build) / "run"
    return run, json.loads((run / "summary.json").read_text())["test_metrics"]


@pytest.fixture(scope="module")
def keep_all_run(tmp_path_factory) -> tuple[Path, dict]:
    """A finished run of ``config(KEEP_ALL)`` and its test metrics (read only): the reference of the resume and retry tests."""
    return reference_run(tmp_path_factory, "keep_all", KEEP_ALL)


@pytest.fixture(scope="module")
def keep_all_cold_run(tmp_path_factory) -> tuple[Path, dict]:
    """As :func:`keep_all_run`, without the warm start (``NO_WARM_START``)."""
    return reference_run(tmp_path_factory, "keep_all_cold", KEEP_ALL, NO_WARM_START)


@pytest.mark.slow  # about a second or more: the fast tier keeps tests under ~0.8 s
def test_the_text_trainers_loop_is_their_own_the_rl_loops_fields_are_refused_and_not_in_the_run_id(tmp_path):
    loop = config().trainer
    assert "num_envs" not in loop and "optimizer" not in loop and "frames_per_batch" not in loop
    assert loop.episodes == 16 and loop.objective.reward_threshold == 0.5  # the loop's and the algorithm's options
    assert "num_envs" not in hyper_parameters(config())["trainer"]
    for trainer in ("expert_iteration", "malt"):
        with pytest.raises(ConfigError, match=rf"^trainer {trainer} does not read trainer.num_envs, trainer.optimizer: "):
            preflight(config(f"trainer={trainer}", "+trainer.num_envs=8", "+trainer.optimizer={lr: 0.1}"))


@pytest.mark.slow
def test_on_the_command_line_a_field_the_text_loop_does_not_have_is_one_line():
    # Naming the field and the loop's schema.
    result = run_cli(["preset=text_quick", "trainer.frames_per_batch=96"])
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "trainer (TextTrainerConfig) has no option 'frames_per_batch'" in result.stderr


@pytest.mark.slow
def test_a_run_goes_through_every_stage_and_leaves_a_readable_folder(keep_all_run):
    run_dir, metrics = keep_all_run
    assert set(metrics) >= {"test/accuracy", "test/agents/verifier/reward", "test/decided"}
    state = json.loads((run_dir / "checkpoints" / "state.json").read_text())
    assert state["iteration"] == 2 and state["stage"] == "final_test"
    # The warm start and the first iteration's job changed both groups' models; the last iteration has no job.
    for group in ("prover", "verifier"):
        assert state["groups"][group]["model"].endswith(f"models/{group}/it0000-{group}")
        assert (run_dir / "fine_tune" / f"{run_id(config(KEEP_ALL))}-warm-{group}" / "job.json").is_file()
    assert not list((run_dir / "fine_tune").glob("*-it0001-*"))
    # Every iteration's rollouts and tests are readable JSONL; the tests ran at the first and last iteration.
    for iteration in (0, 1):
        lines = (run_dir / "rollouts" / f"iteration_{iteration:04d}.jsonl").read_text().splitlines()
        assert len(lines) == 17 and json.loads(lines[1])["turns"][0]["agent"] == "prover"
    assert sorted(path.name for path in (run_dir / "tests").glob("*.json")) == ["iteration_0000.json", "iteration_0001.json"]
    steps = [int(row.split(",")[0]) for row in (run_dir / "metrics" / "scalars" / "eval" / "accuracy.csv").read_text().split()]
    assert steps == [0, 1]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["test_metrics"] == metrics and summary["iterations"] == 2
    # python -m nip_like.evaluate plays the saved models again: the same metrics on the test split.
    again = evaluate_run(run_dir)
    assert again["metrics"] == metrics and again["episodes"] == 16
    assert json.loads(again["transcripts"].splitlines()[0])["turns"][0]["agent"] == "prover"
    assert "val/accuracy" in evaluate_run(run_dir, split="val", episodes=8)["metrics"]
    with pytest.raises(ConfigError, match="split"):
        evaluate_run(run_dir, split="dev")


def stop_after_stages(monkeypatch, count: int) -> None:
    """Make the run stop (as on SIGTERM) after ``count`` more stages have completed and been saved."""
    done = {"stages": 0}
    original = PureTextRlTrainer.stop_if_requested

    def stop(self, iteration, checkpointed=False):
        done["stages"] += 1
        if done["stages"] >= count:
            from nip_like.interrupts import StopRequested

            raise StopRequested(iteration)
        return original(self, iteration, checkpointed)

    monkeypatch.setattr(PureTextRlTrainer, "stop_if_requested", stop)


@pytest.mark.slow
def test_a_run_stopped_after_every_stage_resumes_to_the_same_results(tmp_path, monkeypatch, keep_all_run):
    reference_dir, reference = keep_all_run
    run_dir = tmp_path / "run"
    stages_seen = []
    # The warm start, the five stages of the first iteration, then sampling, statistics and the test of the
    # last one (it has no jobs); the final test ends the run.
    total = 1 + len(STAGES) + 3
    for stop in range(total):
        stop_after_stages(monkeypatch, 1)
        with pytest.raises(RunInterrupted):
            run_experiment(config(KEEP_ALL), run_dir, resume=stop > 0)
        monkeypatch.undo()
        state = json.loads((run_dir / "checkpoints" / "state.json").read_text())
        stages_seen.append((state["iteration"], state["stage"]))
    assert len(set(stages_seen)) == len(stages_seen), "each resume went one stage further"
    assert run_experiment(config(KEEP_ALL), run_dir, resume=True) == reference
    # Nothing was done twice: one attempt per job (a job still running at a stop was adopted), one rollouts file
    # per iteration.
    for job in (run_dir / "fine_tune").iterdir():
        assert len(attempts(job)) == 1, job
    assert (run_dir / "rollouts" / "iteration_0000.jsonl").read_text() == (reference_dir / "rollouts" / "iteration_0000.jsonl").read_text()


@pytest.mark.slow
def test_a_failed_job_names_its_log_and_the_stage_is_retried_on_the_same_rollouts(tmp_path, monkeypatch, keep_all_cold_run):
    # Iteration 0's job is the one killed: the warm start's jobs would add nothing but time.
    overrides = (KEEP_ALL, NO_WARM_START)
    run_dir = tmp_path / "run"
    original = SubmititFineTuneBackend.submit

    def submit_and_kill(self, spec):
        status = original(self, spec)
        if "-it0000-" in spec.job_id:
            # The job is killed from outside (as by the OOM killer) once it has started.
            kill_when_started(self, spec.job_id)
        return status

    monkeypatch.setattr(SubmititFineTuneBackend, "submit", submit_and_kill)
    with pytest.raises(FineTuneError) as error:
        run_experiment(config(*overrides), run_dir)
    message = str(error.value)
    assert "\n" not in message and "ended without a result" in message
    log = Path(message.split("log: ")[1])
    assert log.name.endswith("_0_log.out") and log.is_file() and "--- started" in log.read_text()
    state = json.loads((run_dir / "checkpoints" / "state.json").read_text())
    assert state["iteration"] == 0 and state["stage"] == "create_fine_tune_jobs"
    rollouts = (run_dir / "rollouts" / "iteration_0000.jsonl").read_text()
    monkeypatch.undo()
    metrics = run_experiment(config(*overrides), run_dir, resume=True)
    assert metrics == keep_all_cold_run[1]
    assert (run_dir / "rollouts" / "iteration_0000.jsonl").read_text() == rollouts
    assert len(attempts(log.parent)) == 2  # the retry ran the job again, with a log of its own


@pytest.mark.slow
def test_a_resumed_run_adopts_the_jobs_that_are_still_running(tmp_path, monkeypatch):
    overrides = (KEEP_ALL, "trainer.warm_start_episodes=0", "trainer.fine_tune.epochs=200")
    run_dir = tmp_path / "run"
    # Stopped right after the first iteration's jobs were submitted (sampling, statistics, test, jobs).
    stop_after_stages(monkeypatch, 4)
    with pytest.raises(RunInterrupted):
        run_experiment(config(*overrides), run_dir)
    monkeypatch.undo()
    state = json.loads((run_dir / "checkpoints" / "state.json").read_text())
    assert state["stage"] == "await_fine_tune_jobs"
    jobs = [state["groups"][group]["job_id"] for group in ("prover", "verifier")]
    # The jobs went on without the trainer; the resumed run re-attaches them and waits, it does not start them again.
    assert [SubmititFineTuneBackend(run_dir / "fine_tune").status(job).state for job in jobs] == ["running", "running"]
    assert "test/accuracy" in run_experiment(config(*overrides), run_dir, resume=True)
    for job in jobs:
        assert len(attempts(run_dir / "fine_tune" / job)) == 1
    state = json.loads((run_dir / "checkpoints" / "state.json").read_text())
    for group in ("prover", "verifier"):
        assert state["groups"][group]["model"].endswith(f"models/{group}/it0000-{group}")


@pytest.mark.slow
def test_scripted_provers_are_never_fine_tuned_and_the_verifier_learns_its_decisions(tmp_path):
    run_dir = tmp_path / "run"
    run_experiment(config("scenario.scripted_provers=true", "trainer.test_scheme=none"), run_dir)
    state = json.loads((run_dir / "checkpoints" / "state.json").read_text())
    assert state["groups"]["prover"]["model"] == "scripted"
    assert not list((run_dir / "fine_tune").glob("*prover*")) and not (run_dir / "models" / "prover").exists()
    assert sorted(path.name for path in (run_dir / "tests").glob("*.json")) == ["iteration_0001.json"]


@pytest.mark.slow
def test_the_documented_example_trainer_runs_from_its_own_file(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "docs" / "examples"))
    overrides = ("trainer.trainer_type=label_distillation_trainer.LabelDistillationTrainer", "trainer.warm_start_episodes=0")
    metrics = run_experiment(config(*overrides), tmp_path / "run")
    assert "test/accuracy" in metrics
    assert [path.name for path in (tmp_path / "run" / "fine_tune").iterdir()] == [f"{run_id(config(*overrides))}-it0000-verifier"]


@pytest.mark.slow
def test_malt_runs_on_trees_of_replies(tmp_path):
    run_dir = tmp_path / "run"
    # No warm start: what is tested is how MALT samples (its two warm-start jobs would only add time).
    overrides = ("trainer=malt", "trainer.objective.branching=2", "trainer.episodes=6", NO_WARM_START)
    metrics = run_experiment(config(*overrides), run_dir)
    assert "test/accuracy" in metrics
    rollouts = (run_dir / "rollouts" / "iteration_0000.jsonl").read_text().splitlines()
    assert len(rollouts) == 1 + 6 * 2**2  # a header, then the 4 leaves of each of the 6 trees
    tests = (run_dir / "tests" / "iteration_0001.jsonl").read_text().splitlines()
    assert len(tests) == 1 + 16  # tests play plain episodes


class CoinVerifier(TextModel):
    """Accepts or rejects at random (seeded): its siblings differ, and the right one is worth more."""

    def reply(self, chats, sampling, seed):
        rng = random.Random(seed)
        return [rng.choice(["accept", "reject"]) for _ in chats]


def test_malt_pairs_the_better_sibling_over_the_worse_for_dpo(tmp_path):
    trainer = build_trainer(config("trainer=malt", "trainer.objective.branching=3"), tmp_path / "run")
    scenario = trainer.scenario
    players = {"prover": ScriptedDuplicatesModel("accept"), "verifier": CoinVerifier()}
    trees = play_episodes(scenario, players, {a: Sampling(8) for a in players}, "train", 20, 1, by_agent=True, branching=3)
    specs = trainer._stage_create_fine_tune_jobs(trees)
    assert specs["verifier"].method == "dpo"
    pairs = [json.loads(line) for line in Path(specs["verifier"].dataset).read_text().splitlines()]
    assert pairs
    for pair in pairs:
        cells = [value for value in read_list_line(pair["prompt"][1]["content"]) if value is not None]
        sound = "accept" if len(cells) != len(set(cells)) else "reject"
        assert pair["chosen"][0]["content"] == sound != pair["rejected"][0]["content"]


@pytest.mark.slow  # about a second or more: the fast tier keeps tests under ~0.8 s
def test_a_jobs_seed_hangs_on_the_seed_and_its_place_in_the_run_not_on_the_run_id(tmp_path):
    # Runs whose ids differ (another length, a scenario cache elsewhere) train their shared jobs the same way.
    specs = {}
    for name, overrides in {"base": (), "longer": ("trainer.num_iterations=5",), "reseeded": ("seed=1",)}.items():
        trainer = build_trainer(config(f"scenario.cache_dir={tmp_path / 'data'}", *overrides), tmp_path / name)
        specs[name] = trainer.job_spec("verifier", "sft", tmp_path / "data.jsonl")
    assert specs["base"].job_id != specs["longer"].job_id
    assert specs["base"].seed == specs["longer"].seed != specs["reseeded"].seed
