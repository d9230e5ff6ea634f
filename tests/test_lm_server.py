"""LM agents that sample from an inference server: the trainer rescores the server's tokens, logs the log-prob gap,
weights tokens by truncated importance weights, and gives the server each update (a LoRA adapter, a folder from
disk, a restart); a server that re-tokenizes, one without log-probs, one that cannot be reached and one lost mid-run.

The server is tests/completions_server.py (vLLM's protocol on transformers), started on 127.0.0.1 by each test;
transformers serve is the real server without log-probs."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import nip_like.resume
from nip_like import experiment, keys
from nip_like.checkpoint import load_checked
from nip_like.errors import CheckpointError, ConfigError, ModelServerError
from nip_like.logging import read_csv_metric
from nip_like.lm.completions import read_choice as _read_choice
from tests.completions_server import command, completions_server, free_port, transformers_serve
from tests.conftest import popen_cli, run_cli
from tests.lm_folders import chat_model  # noqa: F401 - the fixture
from tests.test_lm_chat import chat_config

pytest.importorskip("peft")


def served(url: str, sync: str = "lora", *overrides: str, agent: str = "scenario.default_agent") -> list[str]:
    """Overrides that make the agents of ``agent`` sample from the server at ``url``."""
    return [
        f"{agent}.sampler.kind=server", f"{agent}.sampler.base_url={url}", f"{agent}.sampler.sync={sync}",
        f"{agent}.sampler.retry_backoff=0.05", f"{agent}.sampler.max_retries=1", *overrides,
    ]


def verifier_alone(folder: Path, url: str, sync: str, *overrides: str) -> list[str]:
    """The verifier samples from the server at ``url`` (its whole entry); the prover samples here."""
    entry = "+scenario.agents.verifier"
    return [
        f"{entry}.pretrained_path={folder}", f"{entry}.max_new_tokens=12", f"{entry}.lora.r=4",
        *served(url, sync, *overrides, agent=entry),
    ]


def iterate(trainer, count: int) -> list[dict[str, float]]:
    rows = []
    for _ in range(count):
        rows.append(trainer.train_iteration())
        trainer.state.iteration += 1
    return rows


@pytest.mark.slow
@pytest.mark.parametrize("sync", ["lora", "disk", "none"])
def test_the_trainer_rescores_the_servers_tokens_and_the_server_follows_each_update(chat_model, tmp_path, sync):
    folder = chat_model("qwen2")
    with completions_server(folder, tmp_path / "server.log") as url:
        config = chat_config(folder, tmp_path, "scenario.default_agent.lora.r=4", *verifier_alone(folder, url, sync))
        experiment.preflight(config)
        trainer = experiment.build_trainer(config, tmp_path / "run")
        try:
            batch = next(trainer._collector_iterator)
            # The stored log-probabilities are the trainer's own scores of the server's tokens.
            scores = trainer.policy.score_actions(batch)
            mask = batch[keys.TOKEN_MASK_KEY]
            torch.testing.assert_close(scores.token_log_probs[mask], batch[keys.TOKEN_LOG_PROBS_KEY][mask], atol=1e-4, rtol=1e-4)
            verifier = trainer.policy.policy("verifier")
            before = [p.detach().clone() for p in verifier.parameters() if p.requires_grad]
            rows = iterate(trainer, 3)
            assert any(not torch.equal(a, b) for a, b in zip(before, (p for p in verifier.parameters() if p.requires_grad)))
            gaps = [row["sampler/logprob_gap_max/verifier"] for row in rows]
            assert "sampler/logprob_gap_max/prover" not in rows[0]  # the prover samples here
            assert gaps[0] < 1e-4  # the same weights on both sides before any update
            if sync == "none":
                assert max(gaps[1:]) > 1e-3  # the server kept the initial weights
            else:
                assert max(gaps) < 1e-4 and rows[-1]["timers/sampler_sync/verifier"] > 0
                # Only the weights the server holds now are kept.
                assert [path.name for path in (tmp_path / "run" / "sampler" / "verifier").iterdir()] == ["v3"]
        finally:
            trainer.close()


@pytest.mark.slow
def test_a_server_restarted_by_the_run_after_each_update_serves_the_new_weights(chat_model, tmp_path):
    folder = chat_model("qwen2")
    port = free_port()
    config = chat_config(
        folder, tmp_path, "scenario.default_agent.lora.r=4",
        *verifier_alone(folder, f"http://127.0.0.1:{port}/v1", "restart", f"+scenario.agents.verifier.sampler.command='{command()}'"),
    )
    experiment.preflight(config)  # nothing answers yet: the run starts the server itself
    trainer = experiment.build_trainer(config, tmp_path / "run")
    try:
        rows = iterate(trainer, 2)
        assert max(row["sampler/logprob_gap_max/verifier"] for row in rows) < 1e-4
        assert (tmp_path / "run" / "sampler" / "verifier" / "v2" / "model.safetensors").is_file()  # merged, standalone
        process = trainer.policy.servers["verifier"]._process
        assert process is not None and process.poll() is None
    finally:
        trainer.close()
    assert process.poll() is not None  # the run's server stops with the run


@pytest.mark.slow
def test_truncated_importance_weights_are_stored_and_scale_each_tokens_loss_term(chat_model, tmp_path):
    folder = chat_model("qwen2")
    with completions_server(folder, tmp_path / "server.log") as url:
        config = chat_config(
            folder, tmp_path, "scenario.default_agent.lora.r=4", "trainer.num_iterations=3",
            *verifier_alone(folder, url, "none", "+scenario.agents.verifier.sampler.max_importance_weight=1.0"),
        )
        trainer = experiment.build_trainer(config, tmp_path / "run")
        try:
            iterate(trainer, 1)
            batch = next(trainer._collector_iterator)  # sampled by a server one update behind
        finally:
            trainer.close()
    weights, mask = batch[keys.SAMPLER_WEIGHT_KEY], batch[keys.TOKEN_MASK_KEY]
    verifier = weights[..., 1, :][mask[..., 1, :]]
    assert bool((verifier > 0).all() and (verifier <= 1).all()) and bool((verifier < 0.999).any())
    assert bool((weights[..., 0, :] == 1).all())  # the prover samples here: weight 1
    # The policy term is linear in the weights: halving every weight halves it.
    trainer.advantage_module(batch)
    loss = trainer.loss_module
    halved = batch.clone().set(keys.SAMPLER_WEIGHT_KEY, batch[keys.SAMPLER_WEIGHT_KEY] * 0.5)
    torch.testing.assert_close(loss(halved)["loss_objective"], 0.5 * loss(batch)["loss_objective"], atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_a_server_that_names_tokens_by_their_text_has_its_replies_retokenized(chat_model, tmp_path):
    folder = chat_model("qwen2")
    with completions_server(folder, tmp_path / "server.log", "--text-tokens") as url:
        config = chat_config(folder, tmp_path, "scenario.default_agent.lora.r=4", *verifier_alone(folder, url, "lora"))
        trainer = experiment.build_trainer(config, tmp_path / "run")
        try:
            row = iterate(trainer, 1)[0]
        finally:
            trainer.close()
    assert row["sampler/retokenized/verifier"] == 1.0 and 0 <= row["sampler/retokenized_mismatch/verifier"] <= 1


def test_reading_a_reply_keeps_the_servers_log_probs_only_where_the_tokens_agree(chat_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_model("qwen2"))
    ids = tokenizer("accept the list", add_special_tokens=False)["input_ids"]
    by_id = SimpleNamespace(text="", finish_reason="stop", logprobs=SimpleNamespace(tokens=[f"token_id:{i}" for i in ids], token_logprobs=[-1.0] * len(ids)))
    assert _read_choice(by_id, tokenizer) == (ids, [-1.0] * len(ids), "stop", False, False)
    agreeing = SimpleNamespace(
        text="accept the list", finish_reason="length",
        logprobs=SimpleNamespace(tokens=[tokenizer.decode([i]) for i in ids], token_logprobs=[-0.5] * len(ids)),
    )
    assert _read_choice(agreeing, tokenizer) == (ids, [-0.5] * len(ids), "length", True, False)
    differing = SimpleNamespace(text="accept the list", finish_reason="length", logprobs=SimpleNamespace(tokens=["accept the list"], token_logprobs=[-2.0]))
    read = _read_choice(differing, tokenizer)
    assert read[0] == ids and read[3:] == (True, True) and all(value != value for value in read[1])  # NaN: unknown


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["sampler.kind=server"], "sampler.base_url is needed with kind=server"),
        (["sampler.kind=server", "sampler.base_url=ftp://x"], "must be an http:// or https:// URL"),
        (["sampler.kind=server", "sampler.base_url=http://127.0.0.1:9/v1", "lora.r=0"], "sync=lora needs LoRA adapters"),
        (["sampler.kind=server", "sampler.base_url=http://127.0.0.1:9/v1", "lora.r=4", "lora.warm_start=full"], "sync=lora needs scenario.default_agent.lora.warm_start=lora"),
        (["sampler.kind=server", "sampler.base_url=http://127.0.0.1:9/v1", "sampler.sync=restart"], "sync=restart needs scenario.default_agent.sampler.command"),
        (["sampler.kind=server", "sampler.base_url=http://127.0.0.1:9/v1", "sampler.sync=restart", "sampler.command='no-such-server {model}'"], "'no-such-server' is not a program on PATH"),
        (["sampler.kind=server", "sampler.base_url=http://127.0.0.1:9/v1", "sampler.sync=disk"], "replaces the weights of the server at http://127.0.0.1:9/v1, from which agents prover and verifier both sample"),
        (["sampler.kind=server", "sampler.sync=bogus"], "sync"),
    ],
)
def test_a_server_sampler_that_cannot_work_is_one_line(chat_model, tmp_path, overrides, message):
    config = chat_config(chat_model("qwen2"), tmp_path, *(f"scenario.default_agent.{o}" for o in overrides))
    with pytest.raises(ConfigError) as error:
        experiment.preflight(config)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_several_ranks_and_a_trainer_of_its_own_loop_are_refused(chat_model, tmp_path, monkeypatch):
    config = chat_config(chat_model("qwen2"), tmp_path, "scenario.default_agent.lora.r=4", *served("http://127.0.0.1:9/v1"))
    with monkeypatch.context() as patched:
        patched.setenv("WORLD_SIZE", "2")
        with pytest.raises(ConfigError, match="kind=server runs with one rank"):
            experiment.preflight(config)
    config = chat_config(
        chat_model("qwen2"), tmp_path, "scenario.default_agent.lora.r=4", "trainer=solo_agent", *served("http://127.0.0.1:9/v1")
    )
    with pytest.raises(ConfigError, match="sampler.kind=server: trainer solo_agent samples with its own models; allowed: local"):
        experiment.preflight(config)


@pytest.mark.slow
def test_an_unreachable_server_stops_the_command_before_any_work(chat_model, tmp_path):
    url = f"http://127.0.0.1:{free_port()}/v1"
    folder = chat_model("qwen2")
    args = [
        "preset=none", "scenario=duplicates", "protocol=nip", "scenario.view=chat", f"scenario.default_agent.pretrained_path={folder}",
        "scenario.default_agent.lora.r=4", *served(url), f"hydra.run.dir={tmp_path / 'run'}", "logger=none",
    ]
    result = run_cli(args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "scenario.default_agent.sampler" in lines[0] and url in lines[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_server_without_log_probs_is_one_line_naming_what_is_needed(chat_model, tmp_path):
    pytest.importorskip("fastapi", reason="transformers serve needs the serving extra (installed by the dev extra)")
    folder = chat_model("qwen2")
    with transformers_serve(tmp_path / "serve.log") as url:
        config = chat_config(folder, tmp_path, "scenario.default_agent.lora.r=4", *served(url))
        with pytest.raises(ModelServerError) as error:
            experiment.preflight(config)
    message = str(error.value)
    assert "\n" not in message and "scenario.default_agent.sampler" in message and "log-probabilit" in message and "vLLM" in message


@pytest.mark.slow
def test_a_server_lost_mid_run_stops_it_in_one_line_and_the_resume_completes_it(chat_model, tmp_path):
    folder = chat_model("qwen2")
    port = free_port()
    run = tmp_path / "run"
    args = [
        "preset=none", "scenario=duplicates", "protocol=nip", "protocol.first_speaker=prover", "protocol.max_rounds=2", "scenario.view=chat",
        f"scenario.default_agent.pretrained_path={folder}", "scenario.default_agent.max_new_tokens=12", "scenario.num_lists=60",
        "scenario.length=6", "scenario.num_values=12", f"scenario.cache_dir={tmp_path / 'cache'}", "trainer.num_envs=4",
        "trainer.frames_per_batch=16", "trainer.minibatch_size=8", "trainer.num_iterations=4", "trainer.eval.every=0",
        "trainer.num_test_episodes=4", "trainer.test_batch_episodes=4", "run.checkpoint_every=1", "run.num_threads=1",
        "run.progress_bar=false", "logger=csv", "scenario.default_agent.lora.r=4",
        *served(f"http://127.0.0.1:{port}/v1"), f"hydra.run.dir={run}",
    ]
    checkpoint = run / "checkpoints" / "last.pt"
    with completions_server(folder, tmp_path / "server.log", port=port):
        process = popen_cli(args)
        deadline = time.monotonic() + 240
        while not (checkpoint.is_file() and iteration_of(checkpoint) >= 2):
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                pytest.fail(f"the run did not reach its second checkpoint: {process.communicate()[1][-2000:]}")
            time.sleep(0.05)
    # The server is gone: the run stops in one line that names the checkpoint of its last whole iteration.
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 2, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0] == stderr.strip().splitlines()[-1], stderr
    assert "scenario.default_agent.sampler" in errors[0] and stderr.count("FutureWarning") <= 1  # each warning at most once
    assert str(checkpoint) in errors[0] and f"python -m nip_like.resume {run}" in errors[0]
    stopped_at = iteration_of(checkpoint)
    assert 2 <= stopped_at < 4 and not (run / "summary.json").exists()
    # The resume in this process, through nip_like.resume's entry function (the one-line stop above is the claim
    # about the command; this saves an interpreter start-up).
    with completions_server(folder, tmp_path / "server2.log", port=port):
        assert nip_like.resume.main([str(run)]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed"] and iteration_of(checkpoint) == 4
    steps = [step for step, _ in read_csv_metric(run, "sampler/logprob_gap_max/verifier")]
    assert steps == list(range(1, 5))  # every iteration once: the rows after the checkpoint were dropped and redone


def iteration_of(checkpoint: Path) -> int:
    try:
        return int(load_checked(checkpoint)["trainer"]["train_state"]["iteration"])
    except CheckpointError:  # not written yet
        return -1
