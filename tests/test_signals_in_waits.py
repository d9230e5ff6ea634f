"""A stop request (SIGINT or SIGTERM) ends a long wait inside an iteration or stage at once: a request to a silent
server, a fine-tune job, a long generation. And a silent server is reported after one timeout, not one per retry."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from nip_like import interrupts
from nip_like.errors import ModelServerError
from nip_like.interrupts import StopNow, handle_interrupts
from nip_like.text.interface import Sampling
from nip_like.text.models import LocalTextModel, create_model_folder
from nip_like.text.remote import OpenAIChatModel
from nip_like.text.tokenizer import build_chat_tokenizer
from tests.conftest import popen_cli
from tests.fake_servers import fake_server
from tests.lm_folders import chat_model  # noqa: F401 - the fixture
from tests.test_text import TINY_MODEL
from tests.test_text_server_errors import TEXT_RUN

CHAT = [{"role": "user", "content": "list: 1 2 1"}]


def signal_soon(delay: float = 0.3) -> threading.Timer:
    """SIGTERM to this process after ``delay`` seconds (while the code under test waits)."""
    timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    return timer


def test_a_silent_server_is_reported_after_one_timeout_not_after_every_retry():
    with fake_server("hang") as server:
        client = OpenAIChatModel("tiny", server.url, max_retries=3, retry_backoff=0.01, timeout=0.3)
        started = time.monotonic()
        with pytest.raises(ModelServerError) as error:
            client.reply([CHAT, CHAT], Sampling(4), seed=0)
        elapsed = time.monotonic() - started
        client.close()
        assert server.kinds() == ["chat", "chat"]  # each chat asked once, at once: no retry of a timeout
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"text-model server {server.url} (model tiny) gave no answer within its timeout of 0.3 s")
    assert elapsed < 5.0, elapsed  # a margin for a loaded machine: the requests above are the test


def test_an_empty_batch_asks_nothing():
    with fake_server("hang") as server:
        client = OpenAIChatModel("tiny", server.url, timeout=60)
        assert client.reply([], Sampling(4), seed=0) == []
        client.close()
        assert server.kinds() == []


def test_a_stop_request_ends_the_wait_for_a_silent_server_at_once():
    with fake_server("hang") as server, handle_interrupts():
        client = OpenAIChatModel("tiny", server.url, timeout=60)
        timer = signal_soon()
        started = time.monotonic()
        with pytest.raises(StopNow) as stopped:
            client.reply([CHAT] * 3, Sampling(4), seed=0)
        elapsed = time.monotonic() - started
        timer.cancel()
        client.close()
    assert stopped.value.what == f"an answer from the text-model server at {server.url}"
    assert elapsed < 5.0, elapsed  # the server would hold it 60 s; the margin is for a loaded machine
    # The requests still in flight are daemon threads: they do not hold the process at its exit.
    assert all(thread.daemon for thread in threading.enumerate() if thread.name.startswith("nip_like-request"))


def test_a_stop_request_ends_a_local_generation_and_a_sleep(tmp_path):
    folder = create_model_folder(TINY_MODEL, tmp_path / "tiny", build_chat_tokenizer())
    model = LocalTextModel(folder)
    assert model.reply([CHAT], Sampling(4), seed=0)  # no request: it answers
    with handle_interrupts():
        os.kill(os.getpid(), signal.SIGTERM)
        with pytest.raises(StopNow, match="the text model's replies"):
            model.reply([CHAT], Sampling(4), seed=0)
        started = time.monotonic()
        with pytest.raises(StopNow, match="fine-tune jobs"):
            interrupts.sleep(60, "fine-tune jobs ['x']")
        assert time.monotonic() - started < 1.0


def wait_for_requests(server, kind: str, process, deadline: float = 120) -> None:
    """Wait until ``server`` got a request of ``kind`` (the run is under way, waiting for it)."""
    end = time.monotonic() + deadline
    while kind not in server.kinds():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < end, f"no {kind} request reached the server"
        time.sleep(0.05)
    time.sleep(0.3)


def stopped_within(process, seconds: float) -> tuple[int, str, float]:
    """SIGTERM ``process``; its status, standard error and how long it took to exit."""
    started = time.monotonic()
    process.send_signal(signal.SIGTERM)
    try:
        _, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    elapsed = time.monotonic() - started
    assert elapsed < seconds, (elapsed, stderr)
    return process.returncode, stderr, elapsed


@pytest.mark.slow
def test_sigterm_stops_a_text_run_waiting_for_a_silent_server_in_seconds(tmp_path):
    run_dir = tmp_path / "run"
    with fake_server("chat_hang") as server:
        overrides = [
            *TEXT_RUN, f"scenario.default_model.base_url={server.url}", "scenario.default_model.timeout=120",
            f"scenario.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={run_dir}",
        ]
        process = popen_cli(overrides)
        wait_for_requests(server, "chat", process)
        status, stderr, _ = stopped_within(process, 10)
    assert status == 128 + signal.SIGTERM
    line = stderr.strip().splitlines()[-1]
    assert line.startswith(
        f"interrupted at once during iteration 1, waiting for an answer from the text-model server at {server.url}"
    ), stderr
    assert "python -m nip_like.resume" in line and "Traceback" not in stderr


@pytest.mark.slow
def test_sigterm_stops_lm_agents_sampling_from_a_silent_inference_server_in_seconds(tmp_path, chat_model):
    pytest.importorskip("peft")
    folder = chat_model("qwen2")
    run_dir = tmp_path / "run"
    with fake_server("chat_hang") as server:
        agent = "scenario.default_agent"
        overrides = [
            "preset=none", "scenario=duplicates", "protocol=nip", "protocol.max_rounds=2", "scenario.view=chat",
            f"{agent}.pretrained_path={folder}", f"{agent}.max_new_tokens=12", f"{agent}.lora.r=4",
            f"{agent}.sampler.kind=server", f"{agent}.sampler.base_url={server.url}", f"{agent}.sampler.sync=none",
            f"{agent}.sampler.model=fake", "scenario.num_lists=60", "scenario.length=6", "scenario.num_values=12",
            f"scenario.cache_dir={tmp_path / 'cache'}", "trainer.num_envs=4", "trainer.frames_per_batch=16",
            "trainer.minibatch_size=8", "trainer.num_iterations=1", "logger=csv", "run.progress_bar=false",
            f"hydra.run.dir={run_dir}",
        ]
        process = popen_cli(overrides)
        wait_for_requests(server, "completion", process)
        while all(body.get("max_tokens") == 1 for kind, body in server.requests if kind == "completion"):
            assert process.poll() is None, process.communicate()
            time.sleep(0.05)  # the start-up probe answered: wait for the first sampling request
        status, stderr, _ = stopped_within(process, 10)
    assert status == 128 + signal.SIGTERM
    line = stderr.strip().splitlines()[-1]
    assert f"waiting for an answer from the inference server at {server.url}" in line, stderr
    assert "Traceback" not in stderr
