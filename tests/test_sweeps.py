"""Sweeps: grid expansion, job states, the batch script and Hydra's multirun, on real runs."""

from __future__ import annotations

import json
import shutil
import signal
import time
from pathlib import Path

import pytest

from nip_like.errors import ConfigError
from nip_like.experiment import build_trainer, run_experiment
from nip_like.sweeps.grid import expand_sweep
from nip_like.sweeps.progress import PROGRESS_FILE_ENV, progress_from_environment, read_progress
from nip_like.sweeps.state import INCOMPLETE_DIR, JobState, inspect_job, move_aside
from tests.conftest import popen_cli, run_cli, smoke_config, stop_at
from tests.script_modules import script_module

#: A two-objective, two-seed sweep that uses the shared sweep settings and no sizes of its own,
#: so that preset=smoke on the command line makes every job take a few seconds.
TINY_SWEEP = """\
# @package _global_
defaults:
  - _common

hydra:
  sweeper:
    params:
      trainer: ppo,dpo
      seed: 0,1
"""

QUICK = ["preset=smoke", "logger=csv"]


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("configs")
    (folder / "sweep").mkdir()
    (folder / "sweep" / "tiny.yaml").write_text(TINY_SWEEP)
    return folder


def run_sweep(args: list[str], config_dir: Path, out: Path, timeout: int = 300):
    """Run ``scripts/run_sweep.py tiny`` with the test config folder."""
    return run_cli(
        ["tiny", "--config-dir", str(config_dir), "--out", str(out), "--no-progress-bar", *args],
        module="scripts.run_sweep",
        timeout=timeout,
    )


def run_sweep_here(capsys, args: list[str], config_dir: Path, out: Path, sweep: str = "tiny") -> tuple[int, str]:
    """Run ``scripts/run_sweep.py`` in this process (its jobs are still processes of their own).

    For the tests whose claim is about what the sweep does, not about its
    command line: the script's interpreter start-up (seconds) is saved. The
    command line itself is run by ``finished_sweep`` and the interruption test.

    Returns
    -------
    tuple[int, str]
        The exit status ``main`` returns and what it printed to standard output.
    """
    with script_module("run_sweep") as script:
        capsys.readouterr()
        status = script.main([sweep, "--config-dir", str(config_dir), "--out", str(out), "--no-progress-bar", *args])
    return status, capsys.readouterr().out


# ------------------------------------------------------------ grid and states
@pytest.mark.slow
def test_ready_sweep_expands_to_matched_jobs_with_declared_iterations():
    sweep = expand_sweep("ppo_vs_dpo", out=Path("/tmp/unused"))
    names = [job.name for job in sweep.jobs]
    assert len(names) == 10 and "seed=0,trainer=ppo" in names and "seed=4,trainer=dpo" in names
    assert all(job.error is None for job in sweep.jobs)
    # 60 train iterations and 1024 / 256 test iterations, whatever the trainer's own default.
    assert {job.iterations for job in sweep.jobs} == {64}
    assert sweep.total_iterations == 640
    assert len({job.run_id for job in sweep.jobs}) == 10
    # The default root is the config's fixed hydra.sweep.dir.
    assert expand_sweep("ppo_vs_dpo").root == (Path.cwd() / "outputs" / "sweeps" / "ppo_vs_dpo").absolute()


@pytest.mark.slow
def test_command_line_sweeps_replace_the_grid_and_test_run_is_short(tmp_path):
    sweep = expand_sweep("ppo_vs_dpo", ["seed=7", "run.test_run=true"], out=tmp_path)
    # A test run gets folders of its own, apart from the full runs'.
    names = sorted(job.name for job in sweep.jobs)
    assert names == ["run.test_run=True,seed=7,trainer=dpo", "run.test_run=True,seed=7,trainer=ppo"]
    assert {job.iterations for job in sweep.jobs} == {2}
    assert all(job.folder.parent == tmp_path for job in sweep.jobs)
    # Hydra's sweep functions work as in a multirun.
    sweep = expand_sweep("ppo_vs_dpo", ["seed=range(2)", "trainer=glob(ppo*)"], out=tmp_path)
    assert sorted(job.name for job in sweep.jobs) == [f"seed={s},trainer={t}" for s in (0, 1) for t in ("ppo", "ppo_kl")]


def test_bad_sweeps_are_refused_in_one_line(config_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"no sweep config 'nope' .*available sweeps: \[.*'objectives'"):
        expand_sweep("nope")
    with pytest.raises(ConfigError, match="changes with the time.*give --out DIR"):
        expand_sweep("tiny", config_dir=config_dir)
    with pytest.raises(ConfigError, match="trainer.num_epochs"):
        expand_sweep("tiny", ["trainer.num_epochs=four"], out=tmp_path, config_dir=config_dir)


def test_a_bad_grid_point_fails_alone(config_dir, tmp_path):
    sweep = expand_sweep("tiny", ["trainer=ppo,nope", "seed=0"], out=tmp_path, config_dir=config_dir)
    plans = {plan.job.name: plan for plan in map(inspect_job, sweep.jobs)}
    assert plans["seed=0,trainer=ppo"].state == JobState.NEW
    assert plans["seed=0,trainer=nope"].state == JobState.BAD_CONFIG
    assert "Could not find 'trainer/nope'" in plans["seed=0,trainer=nope"].detail


def test_job_states(config_dir, tmp_path):
    sweep = expand_sweep("tiny", ["seed=0"], out=tmp_path, config_dir=config_dir)
    ppo, dpo = sorted(sweep.jobs, key=lambda job: job.name, reverse=True)
    assert inspect_job(ppo).state == JobState.NEW
    ppo.folder.mkdir()
    (ppo.folder / "stderr.log").write_text("crashed\n")
    assert inspect_job(ppo).state == JobState.NEW  # only logs: no run started
    (ppo.folder / "config.yaml").write_text("seed: 0\n")
    assert inspect_job(ppo).state == JobState.INCOMPLETE
    moved = move_aside(ppo.folder, tmp_path)
    assert moved == tmp_path / INCOMPLETE_DIR / "seed=0,trainer=ppo.1"
    assert (moved / "stderr.log").read_text() == "crashed\n" and not ppo.folder.exists()
    # A running Hydra job keeps its own files in place.
    ppo.folder.mkdir()
    for name in (".hydra", "metrics"):
        (ppo.folder / name).mkdir()
    moved = move_aside(ppo.folder, tmp_path, keep=(".hydra",))
    assert moved.name == "seed=0,trainer=ppo.2" and [entry.name for entry in moved.iterdir()] == ["metrics"]
    assert [entry.name for entry in ppo.folder.iterdir()] == [".hydra"]
    # A summary of another config is a conflict, not a finished job.
    dpo.folder.mkdir()
    (dpo.folder / "config.yaml").write_text("seed: 0\nrun:\n  test_run: false\n")
    (dpo.folder / "summary.json").write_text(json.dumps({"run_id": "someone-else", "test_metrics": {}}))
    plan = inspect_job(dpo)
    assert plan.state == JobState.CONFLICT and "holds a run of another config" in plan.detail


def test_a_run_writes_its_progress_through_the_hook_the_sweep_hands_in(tmp_path, monkeypatch):
    assert progress_from_environment(0) is None  # no sweep: nothing follows the run
    progress = tmp_path / "progress"
    monkeypatch.setenv(PROGRESS_FILE_ENV, str(progress))
    config = smoke_config("trainer.num_iterations=2")
    run_experiment(config, tmp_path / "run", progress=progress_from_environment)
    total = build_trainer(config, tmp_path / "count").get_total_num_iterations()
    assert total > 2 and read_progress(progress) == total  # every loop's iterations, the test's too
    run_experiment(config, tmp_path / "other")  # without the hook, the file is left alone
    assert read_progress(progress) == total




def test_a_job_resumed_by_nip_like_resume_reports_its_progress_too(tmp_path, monkeypatch):
    from nip_like import resume

    config = smoke_config("trainer.num_iterations=3", "run.checkpoint_every=1", "run.progress_bar=false")
    stop_at(monkeypatch, 2, KeyboardInterrupt)
    with pytest.raises(BaseException):
        run_experiment(config, tmp_path / "run", handle_signals=False)
    monkeypatch.undo()
    progress = tmp_path / "progress"
    monkeypatch.setenv(PROGRESS_FILE_ENV, str(progress))
    assert resume.main([str(tmp_path / "run"), "logger.print_metrics=false"]) == 0
    total = build_trainer(config, tmp_path / "count").get_total_num_iterations()
    assert read_progress(progress) == total  # the iterations done before the stop count too
@pytest.mark.slow  # composes each grid point: a second or more
def test_dry_run_lists_jobs_and_touches_nothing(config_dir, tmp_path, capsys):
    out = tmp_path / "sweep"
    status, stdout = run_sweep_here(capsys, ["--dry-run", *QUICK, "trainer=ppo,nope"], config_dir, out)
    assert status == 0, stdout
    lines = stdout.splitlines()
    assert lines[0].startswith(f"Sweep tiny in {out}: 4 jobs (2 to run, 2 failing before they start)")
    assert "of 10 iterations left" in lines[0]  # smoke: 3 train + 2 test iterations per job
    assert any(line.startswith("run") and "preset=smoke,seed=1,trainer=ppo" in line for line in lines)
    assert any(line.startswith("fail") and "Could not find 'trainer/nope'" in line for line in lines)
    assert not out.exists()


# ---------------------------------------------------------------- real runs
@pytest.fixture(scope="module")
def finished_sweep(config_dir, tmp_path_factory) -> Path:
    """The tiny sweep (PPO and DPO, seeds 0 and 1), run to the end, 2 jobs at a time."""
    out = tmp_path_factory.mktemp("sweep") / "tiny"
    result = run_sweep([*QUICK, "--jobs", "2"], config_dir, out)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 finished." in result.stdout
    return out


@pytest.mark.slow
def test_sweep_runs_every_job_and_the_report_reads_it(finished_sweep, tmp_path, capsys):
    names = sorted(path.name for path in finished_sweep.iterdir())
    assert names == [f"preset=smoke,seed={seed},trainer={trainer}" for seed in (0, 1) for trainer in ("dpo", "ppo")]
    for name in names:
        summary = json.loads((finished_sweep / name / "summary.json").read_text())
        assert summary["iterations"] == 3 and not summary["resumed"]
        assert not (finished_sweep / name / ".sweep_progress").exists()
    out = tmp_path / "report"
    # The report script in this process: what is tested is what it reads from the sweep, not its start-up.
    with script_module("compare_objectives") as report:
        capsys.readouterr()
        assert report.main([str(finished_sweep), "--out", str(out), "--reps", "500"]) == 0
    stdout = capsys.readouterr().out
    assert "Matched budget: every run collected 288 frames" in stdout
    assert "| dpo | 2 |" in stdout and "| ppo | 2 |" in stdout
    written = {path.name for path in out.iterdir()}
    assert written >= {"report.md", "summary.csv", "curves_frames.png", "reward_vs_kl.png"}


@pytest.mark.slow
def test_rerun_finishes_only_what_was_missing(finished_sweep, config_dir, tmp_path, capsys):
    out = tmp_path / "tiny"
    shutil.copytree(finished_sweep, out)
    kept = out / "preset=smoke,seed=0,trainer=ppo"
    interrupted = out / "preset=smoke,seed=0,trainer=dpo"
    incomplete = out / "preset=smoke,seed=1,trainer=ppo"
    missing = out / "preset=smoke,seed=1,trainer=dpo"
    kept_summary = (kept / "summary.json").read_bytes()
    (interrupted / "summary.json").unlink()
    (incomplete / "summary.json").unlink()
    shutil.rmtree(incomplete / "checkpoints")
    shutil.rmtree(missing)

    # The sweep script in this process (its jobs are processes): finished_sweep ran its command line.
    status, plan = run_sweep_here(capsys, ["--dry-run", *QUICK], config_dir, out)
    assert status == 0 and "4 jobs (1 to run, 1 to resume, 1 to restart, 1 finished)" in plan
    status, stdout = run_sweep_here(capsys, [*QUICK, "--jobs", "2"], config_dir, out)
    assert status == 0, stdout
    assert "3 finished, 1 already finished." in stdout
    assert (kept / "summary.json").read_bytes() == kept_summary
    assert json.loads((interrupted / "summary.json").read_text())["resumed"] is True
    assert json.loads((incomplete / "summary.json").read_text())["resumed"] is False
    assert (out / INCOMPLETE_DIR / f"{incomplete.name}.1" / "config.yaml").is_file()
    assert json.loads((missing / "summary.json").read_text())["iterations"] == 3
    status, again = run_sweep_here(capsys, ["--dry-run", *QUICK], config_dir, out)
    assert status == 0 and "4 jobs (4 finished); 0 of 20 iterations left" in again


@pytest.mark.slow
def test_a_failing_job_is_reported_and_the_others_finish(config_dir, tmp_path, capsys):
    out = tmp_path / "sweep"
    grid = ["trainer=ppo", "seed=0", "trainer.minibatch_size=32,5000"]
    # The sweep script in this process; both jobs are processes of their own, run side by side.
    status, stdout = run_sweep_here(capsys, [*QUICK, *grid, "--jobs", "2"], config_dir, out)
    assert status == 1, stdout
    assert "1 finished, 1 failed." in stdout
    failure = "trainer.minibatch_size=5000,trainer=ppo: error: trainer.minibatch_size (5000) is larger than the batch"
    assert failure in stdout
    assert (out / "preset=smoke,seed=0,trainer.minibatch_size=32,trainer=ppo" / "summary.json").is_file()


@pytest.mark.slow
def test_hydra_multirun_runs_jobs_in_parallel_and_reports_a_failing_one(config_dir, tmp_path, capsys):
    out = tmp_path / "multirun"
    args = ["--config-dir", str(config_dir), "+sweep=tiny", *QUICK, f"hydra.sweep.dir={out}"]
    args += ["hydra.sweeper.params.trainer=ppo", "hydra.sweeper.params.seed=0", "trainer.minibatch_size=32,5000"]
    result = run_cli(args)
    assert result.returncode == 2, result.stderr
    good = out / "preset=smoke,seed=0,trainer.minibatch_size=32,trainer=ppo"
    bad = out / "preset=smoke,seed=0,trainer.minibatch_size=5000,trainer=ppo"
    assert "Joblib.Parallel(n_jobs=2" in result.stdout  # Hydra logs to standard output
    assert f"error: {bad}: trainer.minibatch_size (5000) is larger than the batch" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: sweep job {bad} failed")
    assert (good / "summary.json").is_file() and not (bad / "summary.json").exists()
    # The same command again resumes an interrupted job and restarts the failed one.
    (good / "summary.json").unlink()
    again = run_cli(args)
    assert again.returncode == 2, again.stderr
    assert f"Resuming from its last checkpoint: {good}" in again.stdout
    assert json.loads((good / "summary.json").read_text())["resumed"] is True
    assert f"Restarting (no checkpoint yet; what it held moved to {out / INCOMPLETE_DIR / bad.name}.1)" in again.stdout
    # The batch script finds the same folders: it would skip the finished job and restart the failed one.
    status, plan = run_sweep_here(
        capsys, ["--dry-run", *QUICK, "trainer=ppo", "seed=0", "trainer.minibatch_size=32,5000"], config_dir, out
    )
    assert status == 0 and "2 jobs (1 to restart, 1 finished)" in plan, plan


@pytest.mark.slow
def test_interrupting_a_sweep_and_running_it_again(config_dir, tmp_path, capsys):
    out = tmp_path / "sweep"
    # Enough iterations (a few seconds) that the first job is caught mid-run, once it has a checkpoint; the
    # second job, not started at the interrupt, needs no more than the smoke preset's 3 to show it runs later.
    grid = [*QUICK, "trainer=ppo", "seed=0", "trainer.num_iterations=40,3", "--jobs", "1"]
    args = ["tiny", "--config-dir", str(config_dir), "--out", str(out), "--no-progress-bar", *grid]
    first = out / "preset=smoke,seed=0,trainer.num_iterations=40,trainer=ppo"
    process = popen_cli(args, module="scripts.run_sweep")
    deadline = time.time() + 120
    while not (first / "checkpoints" / "last.pt").is_file() and time.time() < deadline:
        time.sleep(0.1)
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stdout + stderr
    assert "Interrupted" in stdout and "1 stopped, 1 not started." in stdout
    assert not (first / "summary.json").exists()

    # Run again (the script in this process; its jobs are processes): the same folders, finished.
    status, stdout = run_sweep_here(capsys, grid, config_dir, out)
    assert status == 0, stdout
    assert "2 jobs (1 to run, 1 to resume)" in stdout
    assert json.loads((first / "summary.json").read_text())["resumed"] is True
