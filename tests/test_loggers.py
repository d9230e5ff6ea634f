"""What the loggers receive besides scalars: hyper-parameters, summary values, texts; and the job log's lines."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from nip_like.config import run_id
from nip_like.job_log import LOG, JobLog
from nip_like.logging import MetricLogger, flat_hyper_parameters
from tests.conftest import smoke_config

FINAL = {"test/reward": 0.75, "test/episodes": 8.0}


def logged_run(tmp_path: Path, logger: str) -> tuple[MetricLogger, str]:
    """A MetricLogger of a smoke config that got what a short run sends it."""
    config = smoke_config(f"logger={logger}")
    metric_logger = MetricLogger(config.logger, tmp_path, "synthetic")
    identity = run_id(config)
    metric_logger.log_hyper_parameters(config, identity)
    metric_logger.log({"train/reward": 0.5, "timers/iteration": 0.1}, step=1)
    metric_logger.log_text("transcripts/test", "prover: 1\nverifier: accept\n", step=2)
    metric_logger.log(FINAL, step=2)
    metric_logger.close()
    return metric_logger, identity


def test_hyper_parameters_are_flat_and_of_the_types_every_backend_takes():
    flat = flat_hyper_parameters({"a": {"b": 1, "c": None, "d": [1, 2], "e": {}}, "f": "x", "g": True}, "abc")
    assert flat == {"a.b": 1, "a.c": "null", "a.d": "[1, 2]", "a.e": "{}", "f": "x", "g": True, "run_id": "abc"}


def test_csv_backend_keeps_the_hyper_parameters_and_the_transcripts(tmp_path):
    _, identity = logged_run(tmp_path, "csv")
    texts = tmp_path / "metrics" / "texts"
    lines = (texts / "hparams0.txt").read_text().splitlines()
    assert f"run_id: {identity}" in lines
    assert "trainer.trainer_type: ppo" in lines and "seed: 0" in lines
    assert (texts / "transcripts" / "test2.txt").read_text() == "prover: 1\nverifier: accept\n"


def test_tensorboard_backend_holds_config_run_id_hyper_parameters_summary_and_transcripts(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    _, identity = logged_run(tmp_path, "tensorboard")
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()

    def text(tag: str) -> str:
        return events.Tensors(f"{tag}/text_summary")[0].tensor_proto.string_val[0].decode()

    assert text("run_id") == identity
    assert "    trainer:" in text("config").splitlines() and "      trainer_type: ppo" in text("config").splitlines()
    assert "verifier: accept" in text("transcripts/test")
    data = {
        tag.split("/")[-1]: HParamsPluginData.FromString(content)
        for tag, content in events.PluginTagToContent("hparams").items()
    }
    assert set(data) == {"experiment", "session_start_info", "session_end_info"}
    hparams = data["session_start_info"].session_start_info.hparams
    assert hparams["run_id"].string_value == identity
    assert hparams["trainer.num_iterations"].number_value == 3
    assert sorted(info.name.tag for info in data["experiment"].experiment.metric_infos) == sorted(FINAL)
    assert [event.value for event in events.Scalars("test/reward")] == [0.75]


@pytest.fixture
def job_log_file(tmp_path):
    """A file handler on the root logger, as Hydra's job log is, and the nip_like.progress logger at INFO."""
    path = tmp_path / "__main__.log"
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    level = LOG.level
    LOG.setLevel(logging.INFO)
    try:
        yield path
    finally:
        root.removeHandler(handler)
        handler.close()
        LOG.setLevel(level)


def test_job_log_has_a_line_every_n_iterations_and_the_final_metrics(job_log_file, caplog):
    job_log = JobLog(every=2, console=False)
    for step in (1, 2, 3, 4):
        metrics = {"train/reward": step / 10, "loss/policy": -0.01, "timers/iteration": 0.5}
        if step == 3:
            metrics["eval/reward"] = 0.9
        job_log.observe(metrics, step)
    job_log.observe(FINAL, step=4)
    job_log.close()
    lines = job_log_file.read_text().splitlines()
    assert lines == [
        "iteration 2: train/reward 0.2, loss/policy -0.01, timers/iteration 0.5",
        "iteration 4: train/reward 0.4, eval/reward 0.9 (at 3), loss/policy -0.01, timers/iteration 0.5",
        "final test metrics (iteration 4): test/episodes 8, test/reward 0.75",
    ]
    # console=False: nothing but the job log's file handlers got the records (pytest's capture handler did not).
    assert not [record for record in caplog.records if record.name == LOG.name]


def test_job_log_line_waits_for_the_end_of_its_iteration_and_goes_to_the_console_without_a_bar(job_log_file, caplog):
    job_log = JobLog(every=1, console=True)
    job_log.observe({"train/reward": 0.5}, step=1)
    assert job_log_file.read_text() == ""  # the iteration may log more (a text trainer logs in stages)
    job_log.observe({"timers/iteration": 2.0}, step=1)
    job_log.observe({"train/reward": 0.25}, step=2)
    job_log.close()
    assert job_log_file.read_text().splitlines() == [
        "iteration 1: train/reward 0.5, timers/iteration 2",
        "iteration 2: train/reward 0.25, timers/iteration 2 (at 1)",
    ]
    assert [record.getMessage() for record in caplog.records if record.name == LOG.name][0].startswith("iteration 1:")


def test_job_log_every_zero_writes_only_the_final_metrics(job_log_file):
    job_log = JobLog(every=0, console=False)
    job_log.observe({"train/reward": 0.5, "timers/iteration": 1.0}, step=1)
    job_log.observe(FINAL, step=1)
    assert job_log_file.read_text().splitlines() == ["final test metrics (iteration 1): test/episodes 8, test/reward 0.75"]


def test_metric_logger_feeds_the_job_log_at_the_configured_period(tmp_path, job_log_file):
    metric_logger = MetricLogger(smoke_config("logger=none", "logger.log_every=3").logger, tmp_path, "x")
    metric_logger.job_log.console = False
    for step in range(1, 7):
        metric_logger.log({"train/reward": float(step), "timers/iteration": 0.1}, step=step)
    metric_logger.close()
    assert [line.split(":")[0] for line in job_log_file.read_text().splitlines()] == ["iteration 3", "iteration 6"]


@pytest.mark.slow  # W&B starts a service process: seconds
def test_wandb_backend_gets_the_config_and_the_summary(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = smoke_config("logger=wandb")
    metric_logger = MetricLogger(config.logger, tmp_path, "synthetic")
    metric_logger.log_hyper_parameters(config, run_id(config))
    metric_logger.log(FINAL, step=1)
    run = metric_logger.loggers["wandb"].experiment
    assert run.config["run_id"] == run_id(config) and run.config["trainer"]["trainer_type"] == "ppo"
    assert run.summary["test/reward"] == 0.75
    metric_logger.close()


@pytest.mark.slow  # MLflow's file store: seconds
def test_mlflow_backend_gets_the_parameters_and_the_transcripts(tmp_path):
    _, identity = logged_run(tmp_path, "mlflow")
    (params,) = {path.parent for path in (tmp_path / "mlruns").rglob("params/run_id")}
    assert (params / "run_id").read_text() == identity
    assert (params / "trainer.num_iterations").read_text() == "3"
    (transcript,) = (tmp_path / "mlruns").rglob("transcripts/test_2.txt")
    assert transcript.read_text() == "prover: 1\nverifier: accept\n"


def test_progress_bar_is_silent_off_a_terminal_and_still_counts(capsys):
    from nip_like.trainers.base import IterationContext

    context = IterationContext(total=5, initial=1, enabled=True)  # pytest's capture: standard error is no terminal
    context.set_description("Training")
    context.step(2)
    context.close()
    assert context.bar.disable and context.bar.n == 3  # a text trainer reads bar.n to know how far it got
    assert "Training" not in capsys.readouterr().err
