"""Frozen agents of a chat-view scenario played by a chat server (``scenario.agents.<name>.served``), on a stand-in server."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

import nip_like.experiment as experiment
from nip_like import keys
from nip_like.cli import report_errors
from nip_like.errors import ConfigError, ModelServerError
from nip_like.interrupts import StopNow, handle_interrupts
from nip_like.lm.served_config import ServedConfig
from nip_like.text.served import ServedAgent
from nip_like.lm.models import load_tokenizer
from nip_like.scenarios.chat_prompts import ChatSpeaker
from nip_like.validation import build_scenario
from tests.fake_servers import fake_server, refusing_url
from tests.lm_folders import FAMILIES, chat_model  # noqa: F401 - the fixture
from tests.test_lm_chat import chat_config
from tests.test_signals_in_waits import signal_soon

SYSTEM = "You check lists."


def served_verifier(folder: Path, url: str, *extra: str) -> str:
    """The override that makes the verifier a frozen co-player from ``folder`` played by the server at ``url``."""
    fields = ", ".join([f"frozen_from: {folder}", "max_new_tokens: 6", f"served: {{base_url: '{url}', model: fake, max_retries: 1, retry_backoff: 0.05}}", *extra])
    return f"+scenario.agents.verifier={{{fields}}}"


# ------------------------------------------------------------------ the actor's side
@pytest.mark.parametrize("template", [None, "gemma", "llama3"])  # the folder's own, and named ones (Gemma's folds the system message in)
@pytest.mark.parametrize("family", FAMILIES)
def test_a_prompt_reads_back_into_the_chat_its_template_rendered(chat_model, family, template):
    tokenizer = load_tokenizer(chat_model(family), chat_template=template)
    speaker = ChatSpeaker("verifier", tokenizer, SYSTEM)
    quoted = speaker.encode(["4 2"])["4 2"]
    ids = speaker.render("list: 0=3 1=5 2=3", [("prover", quoted)])
    agent = ServedAgent(ServedConfig(base_url="http://127.0.0.1:9/v1", model="m"), "scenario.agents.verifier.served", tokenizer, 6)
    assert agent.chat(ids) == [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "list: 0=3 1=5 2=3\nprover: 4 2"}]
    with pytest.raises(ModelServerError) as error:
        agent.chat(speaker.encode(["no template here"])["no template here"])
    assert str(error.value).startswith("scenario.agents.verifier.served: a prompt of the agent is not its chat template")


@pytest.mark.slow
def test_a_served_agents_message_is_the_answer_in_its_tokens_with_eos_and_no_log_probs(chat_model):
    tokenizer = load_tokenizer(chat_model("qwen2"))
    speaker = ChatSpeaker("verifier", tokenizer, SYSTEM)
    rows = [speaker.render("list: 0=1", []), speaker.render("list: 0=2 1=2", [])]
    width = max(len(row) for row in rows)
    ids = torch.tensor([[speaker.pad_id] * (width - len(row)) + row for row in rows])
    mask = torch.tensor([[False] * (width - len(row)) + [True] * len(row) for row in rows])
    answers = {"list: 0=1": "reject", "list: 0=2 1=2": "accept because 1 and 2 are equal"}
    with fake_server("ok", reply=lambda body: answers[body["messages"][-1]["content"]]) as server:
        agent = ServedAgent(ServedConfig(base_url=server.url, model="fake"), "where", tokenizer, 4, temperature=0.7, top_p=0.9)
        sample = agent.sample(ids, mask, greedy=True)
        agent.close()
    bodies = [body for kind, body in server.requests if kind == "chat"]
    assert sorted(body["messages"][-1]["content"] for body in bodies) == sorted(answers)
    assert all(body["messages"][0] == {"role": "system", "content": SYSTEM} for body in bodies)
    assert all(body["max_tokens"] == 4 and body["temperature"] == 0 and body["top_p"] == 0.9 for body in bodies)
    short = tokenizer("reject", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    long = (tokenizer("accept because 1 and 2 are equal", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])[:4]
    assert len(short) < 4 and sample["tokens"][0, : len(short)].tolist() == short and sample["tokens"][1].tolist() == long
    assert sample["token_mask"].sum(-1).tolist() == [len(short), 4]
    assert not sample["token_log_probs"].any() and not sample["token_entropy"].any()


@pytest.mark.slow
def test_a_stop_request_ends_the_wait_for_a_silent_served_agent_at_once(chat_model):
    tokenizer = load_tokenizer(chat_model("qwen2"))
    ids = torch.tensor([ChatSpeaker("verifier", tokenizer, SYSTEM).render("list: 0=1", [])])
    with fake_server("hang") as server, handle_interrupts():
        agent = ServedAgent(ServedConfig(base_url=server.url, model="fake", timeout=60), "where", tokenizer, 4)
        timer = signal_soon()
        started = time.monotonic()
        with pytest.raises(StopNow) as stopped:
            agent.sample(ids.repeat(3, 1), torch.ones_like(ids, dtype=torch.bool).repeat(3, 1))
        elapsed = time.monotonic() - started
        timer.cancel()
        agent.close()
    assert stopped.value.what == f"an answer from the text-model server at {server.url}"
    assert elapsed < 5.0, elapsed  # the server would hold it 60 s; the margin is for a loaded machine


# ------------------------------------------------------------------ preflight
@pytest.mark.slow
@pytest.mark.parametrize(
    ("override", "message"),
    [
        (lambda folder, url: [served_verifier(folder, url), "scenario.view=token"], "scenario.agents.verifier.served: a served agent plays in the chat view only"),
        (lambda folder, url: [served_verifier(folder, url).replace(f"frozen_from: {folder}", f"pretrained_path: {folder}")], "scenario.agents.verifier.served: a served agent is a frozen co-player"),
        (lambda folder, url: [served_verifier(folder, url, "value_head: true")], "scenario.agents.verifier.served: a served agent has no value head"),
        (lambda folder, url: [served_verifier(folder, url.replace("fake", "x")).replace("model: fake", "model: other")], "scenario.agents.verifier.served.model: the server"),
        (lambda folder, url: [served_verifier(folder, refusing_url())], "scenario.agents.verifier.served: text-model server"),
    ],
    ids=["token_view", "not_frozen", "value_head", "missing_model", "dead_server"],
)
def test_a_served_agent_that_cannot_play_is_refused_before_the_run_in_one_line(chat_model, tmp_path, override, message):
    folder = chat_model("qwen2")
    with fake_server("ok") as server:
        config = chat_config(folder, tmp_path, *override(folder, server.url))
        with pytest.raises((ConfigError, ModelServerError)) as error:
            experiment.preflight(config)
    assert str(error.value).startswith(message) and "\n" not in str(error.value), str(error.value)


@pytest.mark.slow
def test_a_served_agent_with_lora_is_refused_in_one_line(chat_model, tmp_path):
    folder = chat_model("qwen2")
    scenario = build_scenario(chat_config(folder, tmp_path, served_verifier(folder, refusing_url(), "lora: {r: 4}")))
    with pytest.raises(ConfigError) as error:
        scenario.preflight()
    assert "lora.r=0" in str(error.value) and "\n" not in str(error.value)


# ------------------------------------------------------------------ runs against the stand-in server
def decision(body: dict) -> str:
    """The stand-in verifier: accepts a list whose user message names cells, rejects the others."""
    return "accept" if "prover:" in body["messages"][-1]["content"] else "reject"


@pytest.mark.slow
def test_a_duplicates_run_plays_the_served_verifier_and_trains_only_the_prover(chat_model, tmp_path):
    folder = chat_model("qwen2")
    with fake_server("ok", reply=decision) as server:
        config = chat_config(folder, tmp_path, served_verifier(folder, server.url), "scenario.default_agent.lora.r=4")
        experiment.preflight(config)
        trainer = experiment.build_trainer(config, tmp_path / "run")
        verifier = trainer.policy.policy("verifier")
        before = {name: param.detach().clone() for name, param in verifier.named_parameters()}
        batch = next(trainer._collector_iterator)
        metrics = trainer.train_iteration()
        trainer.close()
    index = trainer.agent_names.index("verifier")
    speaker = trainer.scenario.chat_speakers[index]
    tokenizer = speaker.tokenizer
    acted = batch[keys.ACTIVE_KEY][..., index]
    assert bool(acted.any())
    # Each request is the chat the verifier's prompt renders: the template over it gives one of its prompts.
    prompts = batch[keys.PROMPT_IDS_KEY][..., index, :][acted]
    masks = batch[keys.PROMPT_MASK_KEY][..., index, :][acted]
    rendered = {tokenizer.decode(row[mask].tolist(), skip_special_tokens=False) for row, mask in zip(prompts, masks)}
    bodies = [body for kind, body in server.requests if kind == "chat"]
    assert bodies and all(body["messages"][0] == {"role": "system", "content": speaker.system_prompt} for body in bodies)
    asked = {tokenizer.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True) for body in bodies}
    assert rendered <= asked
    assert any("prover:" in body["messages"][-1]["content"] for body in bodies)
    # Its messages are the answers in its tokens, with eos; no log-probs; the update scores none of them.
    texts = tokenizer.batch_decode(batch[keys.ACTION_KEY][..., index, :][acted], skip_special_tokens=True)
    assert set(texts) <= {"accept", "reject"}
    assert not batch[keys.TOKEN_LOG_PROBS_KEY][..., index, :].any()
    scores = trainer.policy.score_actions(batch)
    assert not scores.token_mask[..., index, :].any() and scores.token_mask[..., 1 - index, :].any()
    assert not any(name.startswith("agents/verifier/loss") for name in metrics)
    assert all(torch.equal(param, before[name]) for name, param in verifier.named_parameters())


@pytest.mark.slow
def test_a_run_whose_served_verifier_dies_stops_in_one_line_and_resumes(chat_model, tmp_path, capsys):
    folder = chat_model("qwen2")
    overrides = ("trainer.num_iterations=2", "run.checkpoint_every=1")
    with fake_server("ok", reply=decision) as server:
        reference = experiment.run_experiment(chat_config(folder, tmp_path, served_verifier(folder, server.url), *overrides), tmp_path / "reference")
        per_iteration = server.kinds().count("chat") // 3  # two training iterations and the test: about a third each
    with fake_server("ok", reply=decision, dies_after=per_iteration + 2) as server:
        config = chat_config(folder, tmp_path, served_verifier(folder, server.url), *overrides)
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info, report_errors():
            experiment.run_experiment(config, tmp_path / "run")
        port = server.server_port
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: scenario.agents.verifier.served: text-model server {server.url} (model fake) failed after 2 tries"), err
    assert "the last checkpoint is" in err and "resume with" in err
    with fake_server("ok", reply=decision, port=port):
        resumed = experiment.run_experiment(config, tmp_path / "run", resume=True)
    assert resumed == reference
