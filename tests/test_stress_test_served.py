"""A frozen co-player served remotely: the stress test's target on a stand-in chat server on 127.0.0.1."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from nip_like.cli import report_errors
from nip_like.errors import ConfigError, ModelServerError
from nip_like.experiment import run_experiment
from nip_like.interrupts import StopNow, handle_interrupts
from nip_like.lm.served_config import ServedConfig
from nip_like.text.served import check_served, served_player
from nip_like.scenarios.stress_test.target import Target, TargetConfig
from nip_like.text.interface import Sampling
from tests.conftest import make_config
from tests.fake_servers import fake_server, refusing_url
from tests.lm_folders import chat_model  # noqa: F401 - the fixture
from tests.test_signals_in_waits import signal_soon
from tests.test_stress_test import SIZES


def seeded(body: dict) -> str:
    """The target's reply: an insult on odd seeds, so that the scores depend on the seeds the run asked with."""
    return "You idiot." if body["seed"] % 2 else "Fine."


@pytest.mark.slow
def test_a_served_player_sends_the_chat_and_reads_the_answers_text():
    with fake_server("ok", reply=seeded) as server:
        player = served_player(ServedConfig(base_url=server.url, model="target"), "scenario.target.served")
        chats = [[{"role": "user", "content": "hello"}], [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]]
        replies = player.reply(chats, Sampling(12, temperature=0.5), seed=3)
        player.close()
    bodies = [body for kind, body in server.requests if kind == "chat"]
    assert sorted(body["messages"][-1]["content"] for body in bodies) == ["hello", "hi"]
    assert all(body["model"] == "target" and body["max_tokens"] == 12 and body["temperature"] == 0.5 for body in bodies)
    assert replies == [seeded(body) for body in sorted(bodies, key=lambda body: body["messages"][-1]["content"] != "hello")]


@pytest.mark.parametrize(
    ("served", "message"),
    [
        (ServedConfig(model="m"), "scenario.target.served.base_url is missing"),
        (ServedConfig(base_url="http://127.0.0.1:9/v1"), "scenario.target.served.model is missing"),
        (ServedConfig(base_url="127.0.0.1:9", model="m"), "scenario.target.served.base_url must be an http:// or https:// URL"),
    ],
)
def test_a_served_player_without_a_usable_server_entry_is_one_line(served, message):
    with pytest.raises(ConfigError) as error:
        served_player(served, "scenario.target.served")
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_a_server_that_does_not_answer_is_refused_before_the_run():
    served = ServedConfig(base_url=refusing_url(), model="m", max_retries=0)
    with pytest.raises(ModelServerError) as error:
        check_served(served, "scenario.target.served")
    message = str(error.value)
    assert message.startswith("scenario.target.served: text-model server") and "failed after 1 try" in message and "\n" not in message


@pytest.mark.slow
def test_a_stop_request_ends_the_wait_for_a_silent_served_target_at_once():
    with fake_server("hang") as server, handle_interrupts():
        target = Target(TargetConfig(served=ServedConfig(base_url=server.url, model="fake", timeout=60)), folder=None)
        timer = signal_soon()
        started = time.monotonic()
        with pytest.raises(StopNow) as stopped:
            target.reply([[{"role": "user", "content": "hello"}]] * 3, seed=0)
        elapsed = time.monotonic() - started
        timer.cancel()
    assert stopped.value.what == f"an answer from the text-model server at {server.url}"
    assert elapsed < 5.0, elapsed  # the server would hold it 60 s; the margin is for a loaded machine


# ------------------------------------------------------------------ a run against the stand-in server
@pytest.fixture(scope="module")
def folder(chat_model) -> Path:  # noqa: F811 - the fixture
    return chat_model("qwen2", **SIZES)


def served_run(folder: Path, cache: Path, url: str, *overrides: str):
    return make_config(
        "preset=stress_test_quick", "logger=none", "run.progress_bar=false", f"scenario.cache_dir={cache}",
        f"scenario.default_agent.pretrained_path={folder}", f"scenario.target.served.base_url={url}",
        "scenario.target.served.model=fake", "scenario.target.served.max_retries=1", "scenario.target.served.retry_backoff=0.05",
        "scenario.ppl_weight=0", "trainer.eval.every=0", "trainer.num_test_episodes=4", "trainer.test_batch_episodes=4",
        "run.checkpoint_every=1", *overrides,
    )


@pytest.mark.slow
def test_a_run_against_a_served_target_that_dies_stops_in_one_line_and_resumes(folder, tmp_path, capsys):
    cache = tmp_path / "cache"
    with fake_server("ok", reply=seeded) as server:
        reference = run_experiment(served_run(folder, cache, server.url), tmp_path / "reference")
    assert reference["test/attack_success_rate"] > 0 and "test/likelihood" not in reference
    asked = [body for kind, body in server.requests if kind == "chat"]
    assert asked and all(body["model"] == "fake" and body["max_tokens"] == 12 for body in asked)
    # One training iteration's turns: 4 environments, 2 turns, 2 frames each.
    per_iteration = 8
    with fake_server("ok", reply=seeded, dies_after=per_iteration + 3) as server:
        run = served_run(folder, cache, server.url)
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info, report_errors():
            run_experiment(run, tmp_path / "run")
        port = server.server_port
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: scenario.target.served: text-model server {server.url} (model fake) failed after 2 tries"), err
    assert "the last checkpoint is" in err and "resume with" in err
    with fake_server("ok", reply=seeded, port=port):
        resumed = run_experiment(run, tmp_path / "run", resume=True)
    assert resumed == reference
