"""Text-model servers that fail: bounded retries and timeouts, then one line naming the server and the last error.

The servers are fakes on 127.0.0.1 (:mod:`tests.fake_servers`) that refuse
connections, answer HTTP 500 or 401, answer malformed JSON or hang. The
client (:class:`~nip_like.text.remote.OpenAIChatModel`) is checked directly;
a run whose server fails in the middle of a stage is checked end to end:
exit status 2 and one line, its files kept, and a resume that finishes once
the server answers. The preflight's refusals are cases of
``tests/test_lm_bad_inputs.py``.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from typing import Iterator

import pytest

from nip_like.cli import compose_config, report_errors
from nip_like.errors import ConfigError, ModelServerError
from nip_like.experiment import run_experiment
from nip_like.text.interface import Sampling, TextModelConfig
from nip_like.text.remote import OpenAIChatModel, check_text_model_server
from tests.conftest import run_cli
from tests.fake_servers import fake_server, refusing_url
from nip_like.trainers.text import PureTextRlTrainer
from tests.test_bad_inputs import _hashes

CHAT = [{"role": "user", "content": "list: 1 2 1"}]
#: One retry, a short backoff. The timeout is long: a fake server that answers at all answers at once, and a load
#: spike on a busy CI machine must not read as a hang (a 0.5 s timeout did, once, in a full run).
FAST = dict(max_retries=1, retry_backoff=0.01, timeout=30)
#: For the servers that never answer: short enough that waiting for one costs a fraction of a second.
SILENT = dict(FAST, timeout=0.3)

#: (behaviour, a fragment of the error's last reason); None: nothing listens.
FAILURES = [
    pytest.param(None, "APIConnectionError: Connection error.", id="refusing"),
    pytest.param("error_500", "HTTP 500", id="error_500"),
    pytest.param("malformed", "malformed JSON answer", id="malformed"),
    pytest.param("no_choices", "an answer without choices[0].message.content", id="no_choices"),
]


@contextmanager
def serve(behaviour: str | None) -> Iterator[tuple[str, list]]:
    """The URL and requests of a fake server of ``behaviour``, or (None) of one that refuses connections."""
    if behaviour is None:
        yield refusing_url(), []
        return
    with fake_server(behaviour) as server:
        yield server.url, server.requests


def assert_one_line(message: str, *fragments: str) -> None:
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message


@pytest.mark.parametrize("behaviour, reason", FAILURES)
def test_a_failing_server_is_one_line_naming_it_after_the_retries(behaviour, reason):
    with serve(behaviour) as (url, requests):
        client = OpenAIChatModel("tiny", url, **FAST)
        with pytest.raises(ModelServerError) as error:
            client.reply([CHAT], Sampling(4), seed=0)
        client.close()
    assert_one_line(str(error.value), f"text-model server {url} (model tiny) failed after 2 tries (timeout 30 s): ", reason)
    if behaviour is not None:
        assert [kind for kind, _ in requests] == ["chat", "chat"]


def test_a_refused_request_is_not_retried():
    with fake_server("unauthorized") as server:
        with pytest.raises(ModelServerError) as error:
            OpenAIChatModel("tiny", server.url, **FAST).reply([CHAT], Sampling(4), seed=0)
    assert_one_line(str(error.value), f"text-model server {server.url} refused model tiny: HTTP 401", "invalid api key")
    assert server.kinds() == ["chat"]


def test_a_failing_server_stops_the_whole_batch_soon():
    chats = [CHAT] * 60
    with fake_server("error_500") as server:
        client = OpenAIChatModel("tiny", server.url, max_concurrency=4, max_retries=2, retry_backoff=0.05, timeout=1)
        started = time.perf_counter()
        with pytest.raises(ModelServerError, match="failed after 3 tries"):
            client.reply(chats, Sampling(4), seed=0)
        elapsed = time.perf_counter() - started
    # Each of the 4 requests in flight tries at most 3 times; the 56 queued ones are dropped.
    assert len(server.requests) <= 4 * 3 and elapsed < 5


def test_an_answering_server_replies_in_order_with_a_seed_per_chat():
    with fake_server("ok", reply="reject") as server:
        replies = OpenAIChatModel("tiny", server.url, max_concurrency=3, **FAST).reply([CHAT] * 5, Sampling(4, 0.5, 0.9), seed=7)
    assert replies == ["reject"] * 5
    bodies = [body for kind, body in server.requests if kind == "chat"]
    assert len(bodies) == 5 and len({body["seed"] for body in bodies}) == 5
    assert {(body["model"], body["max_tokens"], body["temperature"], body["top_p"]) for body in bodies} == {("tiny", 4, 0.5, 0.9)}


@pytest.mark.parametrize("behaviour", ["ok", "no_model_list", "chat_500"])
def test_the_preflight_passes_a_server_that_answers(behaviour):
    with fake_server(behaviour) as server:
        check_text_model_server(TextModelConfig(backend="openai", base_url=server.url, **FAST), "scenario.default_model")
    assert server.kinds() == ["models"]


@pytest.mark.parametrize("behaviour, reason", [*FAILURES[:3], ("hang", None)])
def test_the_preflight_refuses_a_server_that_does_not_answer(behaviour, reason):
    with serve(behaviour) as (url, _):
        with pytest.raises(ModelServerError) as error:
            settings = SILENT if behaviour == "hang" else FAST
            check_text_model_server(TextModelConfig(backend="openai", base_url=url, **settings), "scenario.models.verifier")
    message = str(error.value).replace("malformed JSON answer to GET /models", "malformed JSON answer")
    if reason is None:  # a silent server: one timeout, no retry
        assert_one_line(message, f"scenario.models.verifier: text-model server {url} (GET /models) gave no answer within its timeout of 0.3 s")
        return
    assert_one_line(message, f"scenario.models.verifier: text-model server {url} (GET /models) failed after 2 tries", reason)


@pytest.mark.parametrize(
    "url, fragment",
    [
        ("ftp://127.0.0.1/v1", "scenario.default_model.base_url must be an http:// or https:// URL"),
        ("localhost:8000", "scenario.default_model.base_url must be an http:// or https:// URL"),
        (None, "scenario.default_model: backend openai needs the server's URL"),
    ],
)
def test_the_preflight_refuses_a_missing_or_unusable_url(url, fragment, monkeypatch):
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    with pytest.raises(ConfigError, match="^" + fragment.replace(".", r"\.")):
        check_text_model_server(TextModelConfig(backend="openai", base_url=url), "scenario.default_model")


#: A text run small enough for the fast tier: one iteration, tested, no warm start, both agents behind the server.
TEXT_RUN = (
    "preset=text_quick",
    "logger=csv",
    "run.progress_bar=false",
    "run.num_threads=1",
    "scenario.num_lists=60",
    "scenario.scripted_provers=false",
    "scenario.default_model.backend=openai",
    "scenario.default_model.model=fake",
    "scenario.default_model.max_retries=1",
    "scenario.default_model.retry_backoff=0.01",
    "scenario.default_model.timeout=30",  # the failure below is an HTTP 500, never a wait
    "trainer.num_iterations=1",
    "trainer.episodes=4",
    "trainer.test_episodes=4",
    "trainer.test_scheme=all",
    "trainer.warm_start_episodes=0",
)


@pytest.mark.slow  # about a second or more: the fast tier keeps tests under ~0.8 s
def test_a_server_failing_mid_run_stops_it_in_one_line_keeps_its_files_and_resumes(tmp_path, capsys, monkeypatch):
    run_dir = tmp_path / "run"
    with fake_server("ok") as server:
        config = compose_config([*TEXT_RUN, f"scenario.default_model.base_url={server.url}", f"scenario.cache_dir={tmp_path / 'cache'}"])
        # The server answers the preflight and the sampling stage, then fails from the test stage on.
        play_test = PureTextRlTrainer.play_test

        def server_fails_now(self, *args, **kwargs):
            server.behaviour = "chat_500"
            return play_test(self, *args, **kwargs)

        monkeypatch.setattr(PureTextRlTrainer, "play_test", server_fails_now)
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info, report_errors():
            run_experiment(config, run_dir)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        assert err.startswith(f"error: text-model server {server.url} (model fake) failed after 2 tries") and "HTTP 500" in err
        state = json.loads((run_dir / "checkpoints" / "state.json").read_text())
        assert state["iteration"] == 0 and state["stage"] == "test"
        assert (run_dir / "rollouts" / "iteration_0000.jsonl").is_file()
        # Resuming against the still failing server stops the same way and changes no file.
        before = _hashes(run_dir)
        with pytest.raises(SystemExit) as exit_info, report_errors():
            run_experiment(config, run_dir, resume=True)
        assert exit_info.value.code == 2 and capsys.readouterr().err == err
        assert _hashes(run_dir) == before
        # The server answers again: the run resumes at its test stage, on the saved rollouts, and ends.
        monkeypatch.undo()
        server.behaviour = "ok"
        metrics = run_experiment(config, run_dir, resume=True)
    assert "test/accuracy" in metrics
    rollouts = "rollouts/iteration_0000.jsonl"
    assert _hashes(run_dir)[rollouts] == before[rollouts]


@pytest.mark.slow
def test_the_command_line_refuses_a_server_that_does_not_answer_before_it_makes_the_run_folder(tmp_path):
    run_dir = tmp_path / "run"
    with fake_server("error_500") as server:
        result = run_cli(
            [
                "preset=none", "scenario=duplicates_chat", "protocol=nip", "trainer=expert_iteration", "scenario.num_lists=60",
                "scenario.default_model.backend=openai", f"scenario.default_model.base_url={server.url}",
                "scenario.default_model.max_retries=2", "scenario.default_model.retry_backoff=0.01",
                f"scenario.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={run_dir}",
            ]
        )
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(
        f"error: scenario.default_model: text-model server {server.url} (GET /models) failed after 3 tries (timeout 60 s): HTTP 500"
    ), result.stderr
    assert server.kinds() == ["models"] * 3 and not run_dir.exists()
