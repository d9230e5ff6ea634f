"""``python -m nip_like.analyse plot``: a run's curves as a PNG and an HTML page; and what a real run's logs hold."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nip_like.analyse import PLOT_HTML, PLOT_PNG, main, plot_runs
from nip_like.analysis.run_curves import MAIN_METRICS
from nip_like.errors import ReportError
from tests.conftest import run_cli
from tests.test_compare import write_run

TRANSCRIPT = {"label": 1, "turns": [{"agent": "prover", "message": "bit 3 is 1"}], "decision": "accept"}


@pytest.fixture
def finished_run(tmp_path) -> Path:
    """A synthetic finished run with an evaluation's and the test's transcripts."""
    folder = write_run(tmp_path / "runs" / "10-00-00_hidden_bits", "ppo", 0, 0.625, [0.25, 0.5, 0.75, 1.0])
    (folder / "transcripts").mkdir()
    (folder / "transcripts" / "eval_000004.jsonl").write_text(json.dumps({"old": True}) + "\n")
    (folder / "transcripts" / "test.jsonl").write_text(json.dumps(TRANSCRIPT) + "\n")
    return folder


def test_plot_of_one_run_writes_the_curves_and_a_page_with_metrics_config_and_transcripts(finished_run, tmp_path):
    png, html, metrics = plot_runs([str(finished_run)], tmp_path / "out")
    assert metrics == [name for name in MAIN_METRICS if name in ("train/reward", "eval/reward", "objective/kl")]
    assert (png, html) == (tmp_path / "out" / PLOT_PNG, tmp_path / "out" / PLOT_HTML)
    assert png.read_bytes()[:4] == b"\x89PNG"
    page = html.read_text()
    assert "data:image/png;base64," in page
    assert "<th>test/reward</th><td>0.625</td>" in page and "<th>frames</th><td>400</td>" in page
    assert "bit 3 is 1" in page and "test.jsonl" in page and '"old"' not in page  # the latest transcripts: the test's
    assert "trainer_type: ppo" in page  # the config


def test_plot_draws_the_metrics_named_for_runs_side_by_side_and_defaults_into_the_run_folder(finished_run, tmp_path):
    other = write_run(tmp_path / "other" / "10-00-00_hidden_bits", "dpo", 1, 0.5, [0.1, 0.2, 0.3, 0.4])
    png, html, metrics = plot_runs([str(finished_run), "eval/reward", str(other)])  # folders and metrics in any order
    assert metrics == ["eval/reward"] and png.parent == finished_run / "plots"
    page = html.read_text()
    # Two runs of one folder name are told apart by their parent folders.
    assert "runs/10-00-00_hidden_bits" in page and "other/10-00-00_hidden_bits" in page
    assert page.count("<h3>Config</h3>") == 2


def test_an_unfinished_run_is_plotted_without_final_metrics(finished_run, tmp_path):
    (finished_run / "summary.json").unlink()
    _, html, _ = plot_runs([str(finished_run), "train/reward"], tmp_path / "out")
    assert "Not finished" in html.read_text()


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["{runs}"], "is not a run folder: it has no config.yaml"),
        (["{runs}"], "it holds run folders: 10-00-00_hidden_bits"),
        (["{runs}/missing"], "is not a folder"),
        (["{run}", "eval/acuracy"], "metric 'eval/acuracy' is not logged by run"),
        (["{run}", "eval/acuracy"], "logged: eval/reward, objective/kl, timers/iteration, train/frames, train/reward"),
        (["{run}", "--x", "steps"], "--x must be one of iteration, frames, seconds, got 'steps'"),
        (["eval/reward"], "plot needs a run folder; 'eval/reward' is not a folder"),
    ],
)
def test_bad_plot_arguments_are_one_line(finished_run, capsys, arguments, message):
    values = {"runs": finished_run.parent, "run": finished_run}
    with pytest.raises(SystemExit) as exit_:
        main(["plot", *(argument.format(**values) for argument in arguments)])
    error = capsys.readouterr().err
    assert exit_.value.code == 2 and error.count("\n") == 1 and error.startswith("error: "), error
    assert message in error


def test_a_run_without_csv_metrics_is_named(finished_run):
    for path in sorted((finished_run / "metrics").rglob("*.csv")):
        path.unlink()
    with pytest.raises(ReportError, match="has no CSV metrics .* without the csv logger"):
        plot_runs([str(finished_run)])


@pytest.fixture(scope="module")
def real_run(tmp_path_factory) -> tuple[Path, object]:
    """A real smoke run (hidden bits, 3 iterations) with the TensorBoard backend and a job-log line every iteration."""
    folder = tmp_path_factory.mktemp("real") / "run"
    result = run_cli(
        ["preset=none", "preset=smoke", "logger=tensorboard", "logger.log_every=1", "run.num_threads=1",
         f"hydra.run.dir={folder}"]
    )
    assert result.returncode == 0, result.stderr
    return folder, result


@pytest.mark.slow  # a real run in a subprocess: seconds
def test_real_run_job_log_has_a_line_per_iteration_and_the_final_metrics(real_run):
    folder, result = real_run
    log = (folder / "__main__.log").read_text().splitlines()
    lines = [line.split(" - ", 1)[1] for line in log if "nip_like.progress" in line]
    assert [line.split(":")[0] for line in lines] == ["iteration 1", "iteration 2", "iteration 3", "final test metrics (iteration 3)"]
    test_reward = json.loads((folder / "summary.json").read_text())["test_metrics"]["test/reward"]
    assert f"test/reward {test_reward:.4g}" in lines[-1]
    # Standard error is a pipe: no progress bar there; the periodic lines go to the console instead.
    assert "Training" not in result.stderr and "iteration 2: train/reward" in result.stdout


@pytest.mark.slow  # a real run in a subprocess: seconds
def test_real_run_tensorboard_events_hold_the_run_id_as_a_hyper_parameter(real_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    folder, _ = real_run
    events = EventAccumulator(str(folder / "tensorboard"))
    events.Reload()
    content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = HParamsPluginData.FromString(content).session_start_info.hparams
    assert hparams["run_id"].string_value == json.loads((folder / "summary.json").read_text())["run_id"]


@pytest.mark.slow  # two subprocesses: seconds
def test_plot_command_on_a_real_run(real_run):
    folder, _ = real_run
    result = run_cli(["plot", str(folder)], module="nip_like.analyse")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Curves of train/reward, eval/reward, train/accuracy, eval/accuracy, loss/policy")
    assert (folder / "plots" / PLOT_PNG).read_bytes()[:4] == b"\x89PNG"
    page = (folder / "plots" / PLOT_HTML).read_text()
    summary = json.loads((folder / "summary.json").read_text())
    assert f"<th>run_id</th><td>{summary['run_id']}</td>" in page
    assert f"<th>test/accuracy</th><td>{summary['test_metrics']['test/accuracy']:.4g}</td>" in page
    assert "scenario:" in page and "name: hidden_bits" in page
