"""The OpenAI-compatible client against a real server: ``transformers serve`` on 127.0.0.1, started here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nip_like.cli import compose_config
from nip_like.errors import ModelServerError
from nip_like.experiment import run_experiment
from nip_like.text.fine_tune import FineTuneSpec, fine_tune
from nip_like.text.interface import Sampling, TextModelConfig
from nip_like.text.models import LocalTextModel, create_model_folder
from nip_like.text.remote import OpenAIChatModel
from nip_like.text.tokenizer import build_chat_tokenizer
from tests.completions_server import free_port, transformers_serve
from tests.fake_servers import fake_server

pytest.importorskip("fastapi", reason="transformers serve needs the serving extra (installed by the dev extra)")

TINY_MODEL = TextModelConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A ``transformers serve`` process on a free local port; its API root and log."""
    log = tmp_path_factory.mktemp("server") / "serve.log"
    with transformers_serve(log) as url:
        yield {"url": url, "log": log}


@pytest.fixture(scope="module")
def trained_folder(tmp_path_factory) -> Path:
    """A tiny chat model taught to answer ``list: k`` with reject (k = 0) or accept."""
    root = tmp_path_factory.mktemp("trained")
    base = create_model_folder(TINY_MODEL, root / "base", build_chat_tokenizer())
    records = [
        {"messages": [{"role": "user", "content": f"list: {k % 3}"}, {"role": "assistant", "content": "accept" if k % 3 else "reject"}]}
        for k in range(48)
    ]
    data = root / "sft.jsonl"
    data.write_text("".join(json.dumps(record) + "\n" for record in records))
    return fine_tune(FineTuneSpec("t", "sft", str(base), str(data), str(root / "trained"), epochs=80, lr=3e-3, batch_size=16))


@pytest.mark.slow
def test_the_server_answers_like_the_local_model(server, trained_folder):
    chats = [[{"role": "user", "content": f"list: {k}"}] for k in range(3)]
    remote = OpenAIChatModel(str(trained_folder), server["url"], max_concurrency=3)
    greedy = Sampling(max_new_tokens=8, temperature=0.0)
    assert remote.reply(chats, greedy, seed=0) == LocalTextModel(trained_folder).reply(chats, greedy, seed=0)
    assert remote.reply(chats, greedy, seed=0) == ["reject", "accept", "accept"]
    sampled = remote.reply(chats * 4, Sampling(max_new_tokens=8, temperature=1.0), seed=1)
    assert len(sampled) == 12 and all(isinstance(reply, str) for reply in sampled)


def test_an_unreachable_server_is_one_line_after_the_retries():
    client = OpenAIChatModel("any", f"http://127.0.0.1:{free_port()}/v1", max_retries=2, retry_backoff=0.01, timeout=2)
    with pytest.raises(ModelServerError) as error:
        client.reply([[{"role": "user", "content": "hi"}]], Sampling(4), seed=0)
    message = str(error.value)
    assert "\n" not in message and "failed after 3 tries" in message and "APIConnectionError" in message


@pytest.mark.slow
def test_a_refused_model_is_one_line(server, tmp_path):
    client = OpenAIChatModel(str(tmp_path / "no-such-model"), server["url"], max_retries=0)
    with pytest.raises(ModelServerError) as error:
        client.reply([[{"role": "user", "content": "hi"}]], Sampling(4), seed=0)
    assert "\n" not in str(error.value) and "no-such-model" in str(error.value)


TEXT_RUN = (
    "preset=text_quick",
    "run.progress_bar=false",
    "run.num_threads=1",
    "scenario.num_lists=600",
    "scenario.default_model.backend=openai",
    "scenario.default_model.hidden_size=16",
    "scenario.default_model.num_layers=1",
    "scenario.default_model.num_heads=2",
    "scenario.default_model.intermediate_size=32",
    "trainer.num_iterations=2",
    "trainer.episodes=12",
    "trainer.test_episodes=12",
    "trainer.warm_start_episodes=24",
    "trainer.warm_start_epochs=1",
    "trainer.test_scheme=last",
)


@pytest.mark.slow
def test_a_run_samples_through_the_server_and_resumes_after_it_went_away(server, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    # At first a server that answers the preflight but fails every chat: the warm start (scripted play, a
    # local job) runs, then sampling stops the run.
    config = compose_config([*TEXT_RUN, "scenario.default_model.max_retries=1", "scenario.default_model.retry_backoff=0.01"])
    with fake_server("chat_500") as failing:
        monkeypatch.setenv("OPENAI_BASE_URL", failing.url)
        with pytest.raises(ModelServerError, match="failed after 2 tries"):
            run_experiment(config, run_dir)
    state = json.loads((run_dir / "checkpoints" / "state.json").read_text())
    assert state["iteration"] == 0 and state["stage"] == "sample_rollouts"
    assert state["groups"]["verifier"]["model"].endswith("warm-verifier")
    # The server is back: the run resumes at its sampling stage and ends.
    monkeypatch.setenv("OPENAI_BASE_URL", server["url"])
    metrics = run_experiment(config, run_dir, resume=True)
    assert "test/accuracy" in metrics
    served = server["log"].read_text()
    # Iteration 0 sampled the warm-started model, iteration 1 the model its job made, both through the server.
    assert "warm-verifier" in served and "it0000-verifier" in served
