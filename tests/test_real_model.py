"""A real pretrained model through the language-model paths: Gemma 3 270M from its GGUF file (tests/real_model.py).

Every test here plays the duplicates game (or code validation) in the chat view
with the real model at small batch sizes: a 268M-parameter model with a
262,144-token vocabulary, a base model given Gemma's chat template, LoRA
adapters. They are slow (tens of seconds to minutes each on two cores); the
first one on a machine also assembles and converts the model (minutes, once).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from nip_like.evaluate import main as evaluate_main
from nip_like.experiment import run_experiment
from nip_like.export import main as export_main
from nip_like.logging import read_csv_metric
from nip_like.resume import main as resume_main
from tests.conftest import built_once, make_config, popen_cli, run_cli
from tests.real_model import TEMPLATE, gemma_folder, gemma_gguf  # noqa: F401 - fixtures

pytestmark = pytest.mark.slow


#: Torch threads of a real-model run: two alone, one beside another pytest-xdist worker. Two threads on each of two
#: workers oversubscribe two cores, and torch's spinning threads then wait on each other: a one-iteration GRPO run
#: took 458 s so in CI against 28 s alone.
THREADS = "1" if os.environ.get("PYTEST_XDIST_WORKER") else "2"

#: The loop of every real-model run: one iteration of one epoch, no evaluation, two test episodes, quiet, CSV metrics.
SMALL_LOOP = (
    "trainer.num_epochs=1",
    "trainer.num_iterations=1",
    "trainer.eval.every=0",
    "trainer.num_test_episodes=2",
    "trainer.test_batch_episodes=2",
    "run.progress_bar=false",
    f"run.num_threads={THREADS}",
    "logger=csv",
    "logger.diagnostics_every=0",  # objective/kl and objective/entropy: two more scoring passes an iteration
)


def real_overrides(gguf: Path, tmp_path: Path) -> list[str]:
    """The duplicates chat game at its smallest, every agent Gemma 3 270M (from the GGUF file) through rank-4 adapters."""
    return [
        "preset=none",
        "scenario=duplicates",
        "protocol=nip",
        "protocol.first_speaker=prover",
        "protocol.max_rounds=2",
        "scenario.view=chat",
        f"scenario.default_agent.pretrained_path={gguf}",
        f"scenario.default_agent.chat_template={TEMPLATE}",
        "scenario.default_agent.lora.r=4",
        "scenario.default_agent.max_new_tokens=4",
        "scenario.num_lists=60",
        "scenario.length=4",
        "scenario.num_values=8",
        f"scenario.cache_dir={tmp_path / 'cache'}",
        "trainer.num_envs=2",
        "trainer.frames_per_batch=8",
        "trainer.minibatch_size=8",
        *SMALL_LOOP,
    ]


def real_config(gguf: Path, tmp_path: Path, *overrides: str):
    """:func:`real_overrides` and ``overrides``, composed."""
    return make_config(*real_overrides(gguf, tmp_path), *overrides)


#: What the finished run adds to :func:`real_overrides` (the killed run repeats it through the command line).
FINISHED = (
    "scenario.shared_base=true",
    "trainer.num_iterations=2",
    "run.checkpoint_every=1",
    "trainer.opponent_pool.agent=prover",
    "trainer.opponent_pool.size=2",
    "trainer.opponent_pool.live_fraction=0.5",
)


def saved_agent(run: Path, agent: str, checkpoint: str = "last") -> Path:
    return run / "checkpoints" / checkpoint / agent


def assert_template_saved(folder: Path) -> None:
    """The agent folder holds Gemma's template, and its eos is the template's turn end."""
    assert "<start_of_turn>" in (folder / "chat_template.jinja").read_text()
    assert json.loads((folder / "tokenizer_config.json").read_text())["eos_token"] == "<end_of_turn>"


def test_the_gguf_converts_to_a_gemma_folder_that_the_cache_serves_again(gemma_gguf, gemma_folder):
    from nip_like.lm.gguf import converted_folder
    from nip_like.lm.models import load_tokenizer

    config = json.loads((gemma_folder / "config.json").read_text())
    assert (config["model_type"], config["vocab_size"], config["num_hidden_layers"], config["hidden_size"]) == (
        "gemma3_text", 262144, 18, 640
    )
    assert json.loads((gemma_folder / "gguf_source.json").read_text())["architecture"] == "gemma3"
    started = time.monotonic()
    assert converted_folder(gemma_gguf) == gemma_folder  # served from the cache: checked, not converted
    assert time.monotonic() - started < 60
    tokenizer = load_tokenizer(gemma_gguf, chat_template=TEMPLATE)
    assert tokenizer.eos_token == "<end_of_turn>" and len(tokenizer) == 262144


def test_a_truncated_copy_of_the_real_file_is_refused_before_any_work(gemma_gguf, tmp_path):
    cut = tmp_path / "cut.gguf"
    with gemma_gguf.open("rb") as source, cut.open("wb") as target:
        target.write(source.read(gemma_gguf.stat().st_size // 2))
    result = run_cli([
        "preset=none", "scenario=duplicates", "protocol=nip", "scenario.view=chat", f"scenario.default_agent.pretrained_path={cut}",
        f"scenario.default_agent.chat_template={TEMPLATE}", f"hydra.run.dir={tmp_path / 'run'}",
    ])
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "is truncated: its tensors need 253113024 bytes" in lines[0], lines
    assert not (tmp_path / "run").exists()


def assert_trained(run: Path, agents: tuple[str, ...] = ("prover", "verifier")) -> None:
    """The run logged finite losses and saved each of ``agents`` as an adapter folder with Gemma's template."""
    logged = sorted((run / "metrics" / "scalars" / "loss").glob("*.csv"))
    losses = [value for path in logged for _, value in read_csv_metric(run, f"loss/{path.stem}")]
    assert losses and all(torch.isfinite(torch.tensor(losses))), f"no finite loss was logged: {logged}"
    for agent in agents:
        folder = saved_agent(run, agent)
        assert (folder / "adapter_model.safetensors").is_file()
        assert_template_saved(folder)


# Each objective runs once on the real model, in the test of the path it shares a run with: PPO (on one shared
# base) in the finished run, GRPO with the frozen co-player, REINFORCE with share_policy_with, DPO on the stress
# test; LOLA, the learning-aware trainer, here.
def test_lola_trains_the_real_model_in_the_chat_view(gemma_gguf, gemma_folder, tmp_path):
    metrics = run_experiment(real_config(gemma_gguf, tmp_path, "trainer=lola", "scenario.shared_base=true"), tmp_path / "run")
    assert metrics["test/episodes"] == 2
    assert_trained(tmp_path / "run")


def test_dpo_trains_an_auditor_against_the_real_model_as_its_own_target(gemma_gguf, gemma_folder, tmp_path):
    """DPO needs rewards that differ between siblings; in the duplicates game an untrained base model never decides
    (every reward 0, no pair). In the stress test the target's likelihood of each utterance differs, so pairs form:
    the real model is the auditor (LoRA) and, with its adapters off, the frozen target (one base in memory)."""
    config = make_config(
        "preset=stress_test_quick",
        "trainer=dpo",
        "trainer.group_size=2",
        f"scenario.default_agent.pretrained_path={gemma_gguf}",
        f"scenario.default_agent.chat_template={TEMPLATE}",
        "scenario.default_agent.max_new_tokens=4",
        "scenario.default_agent.temperature=1.0",
        "scenario.target.auditor_base=true",
        "scenario.target.max_new_tokens=4",
        "scenario.response_tokens=4",
        f"scenario.cache_dir={tmp_path / 'cache'}",
        "trainer.num_envs=2",
        "trainer.frames_per_batch=4",
        "trainer.minibatch_size=4",
        *SMALL_LOOP,
    )
    metrics = run_experiment(config, tmp_path / "run")
    assert "test/attack_success_rate" in metrics
    assert read_csv_metric(tmp_path / "run", "train/gradient_steps")[-1][1] >= 1  # pairs formed and the adapters stepped
    assert_template_saved(saved_agent(tmp_path / "run", "auditor"))


@pytest.fixture(scope="session")
def finished_run(gemma_gguf, gemma_folder, tmp_path_factory) -> Path:
    """A finished two-iteration PPO run of the real model (agents on one base, an opponent pool of prover snapshots),
    checkpointed after each iteration: made once for the whole session, pytest-xdist workers included."""

    def build(folder: Path) -> None:
        run_experiment(real_config(gemma_gguf, folder, *FINISHED), folder / "run")

    return built_once(tmp_path_factory, "real_finished", "run/summary.json", build) / "run"


def test_ppo_trains_two_agents_on_one_shared_base(finished_run):
    assert_trained(finished_run)
    summary = json.loads((finished_run / "summary.json").read_text())
    assert summary["test_metrics"]["test/episodes"] == 2


def test_an_export_loads_with_plain_transformers_and_generates(finished_run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert export_main([str(finished_run), "--out", str(tmp_path / "exported")]) == 0
    folder = tmp_path / "exported" / "verifier"
    assert_template_saved(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert model.config.vocab_size == 262144
    chat = [{"role": "user", "content": "Is 3 equal to 3? Answer accept or reject."}]
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > ids["input_ids"].shape[1]
    assert tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def test_evaluate_reproduces_the_final_test_of_the_run(finished_run, tmp_path):
    out = tmp_path / "evaluated.json"
    assert evaluate_main([str(finished_run), "--checkpoint", "last", "--out", str(out)]) == 0
    summary = json.loads((finished_run / "summary.json").read_text())["test_metrics"]
    metrics = json.loads(out.read_text())["metrics"]
    assert {key: metrics[key] for key in summary} == pytest.approx(summary)


def test_a_frozen_co_player_from_the_finished_run_against_a_prover_trained_with_grpo(finished_run, gemma_gguf, tmp_path):
    config = real_config(
        gemma_gguf, tmp_path, "trainer=grpo", "trainer.group_size=2",
        f"+scenario.agents.verifier={{frozen_from: {finished_run}, max_new_tokens: 4}}",
    )
    metrics = run_experiment(config, tmp_path / "run")
    assert metrics["test/episodes"] == 2
    assert (saved_agent(tmp_path / "run", "prover") / "adapter_model.safetensors").is_file()
    assert not (saved_agent(tmp_path / "run", "verifier") / "adapter_model.safetensors").exists()  # frozen: nothing trained
    assert_trained(tmp_path / "run", agents=("prover",))


def test_an_opponent_pool_of_prover_snapshots(finished_run):
    assert (finished_run / "opponent_pool.jsonl").is_file()  # the games against snapshots, with their returns


def test_share_policy_with_trains_one_adapter_for_both_roles_with_reinforce(gemma_gguf, tmp_path):
    verifier = f"{{pretrained_path: {gemma_gguf}, chat_template: {TEMPLATE}, lora: {{r: 4}}, max_new_tokens: 4, share_policy_with: prover}}"
    config = real_config(gemma_gguf, tmp_path, "trainer=reinforce", f"+scenario.agents.verifier={verifier}")
    run_experiment(config, tmp_path / "run")
    assert_trained(tmp_path / "run", agents=("prover",))


def test_killed_with_sigkill_and_resumed_gives_the_uninterrupted_runs_test_metrics(finished_run, gemma_gguf, tmp_path):
    """The same run as ``finished_run``, killed by SIGKILL after its first checkpoint, then resumed by the CLI."""
    run = tmp_path / "killed"
    overrides = [*real_overrides(gemma_gguf, finished_run.parent), *FINISHED, f"hydra.run.dir={run}"]
    process = popen_cli(overrides)
    last = run / "checkpoints" / "last.pt"
    deadline = time.monotonic() + 1200
    while not last.is_file() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert last.is_file(), process.communicate()[1][-2000:] if process.poll() is not None else "no checkpoint in time"
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    # Resumed in this process (the kill above hit a real one): a second process would load the model and check its
    # 1 GB of weights against their checksums again.
    assert resume_main([str(run)]) == 0
    expected = json.loads((finished_run / "summary.json").read_text())["test_metrics"]
    assert json.loads((run / "summary.json").read_text())["test_metrics"] == expected


# ------------------------------------------------------------------ signals while the real model works


def _signal_when(monkeypatch, owner, name: str, signals, condition=lambda: True) -> None:
    """Send the signal from inside ``owner.name`` the first time it is called while ``condition()`` holds."""
    original = getattr(owner, name)

    def sending(*args, **kwargs):
        if condition():
            signals.send()
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, sending)


def _inside(monkeypatch, owner, name: str, flag: dict, when=lambda *args: True) -> None:
    """``flag["on"]`` is true while ``owner.name`` runs on arguments for which ``when`` holds."""
    original = getattr(owner, name)

    def flagged(*args, **kwargs):
        flag["on"] = when(*args)
        try:
            return original(*args, **kwargs)
        finally:
            flag["on"] = False

    monkeypatch.setattr(owner, name, flagged)


@pytest.mark.parametrize("phase", ["sampling", "evaluation", "update"])
def test_sigterm_while_the_real_model_works_stops_the_run_in_seconds_and_leaves_it_resumable(
    gemma_gguf, gemma_folder, tmp_path, monkeypatch, phase
):
    """SIGTERM in the middle of a phase of iteration 1: the run ends within 10 s with its one line, named by the phase."""
    import nip_like.lm.decoding as decoding
    from nip_like import interrupts
    from nip_like.errors import RunInterrupted
    from nip_like.run_lock import LOCK_FILE
    from nip_like.trainers import collection, update
    from nip_like.trainers.evaluation import RlEvaluator
    from tests.test_signals_in_phases import Signals

    signals, inside = Signals(signal.SIGTERM), {"on": False}
    # The grace shortened as in tests/test_signals_in_phases.py, so that the phase outlasts it on any machine: with
    # the 2 s default, a fast machine ended two evaluation episodes or the update's last minibatch within it and
    # stopped at the next safe point instead (the command-line tests keep the default grace). The update's stop
    # points are between its optimiser steps: none at all there, and the signal comes with the first step, so that
    # the stop does not wait for a whole minibatch of the real model (over the watchdog's 8 s on a loaded machine).
    monkeypatch.setattr(interrupts, "GRACE_SECONDS", 0.0 if phase == "update" else 0.2)
    # The evaluation comes after iteration 1's update: REINFORCE's is the cheapest on this model, and one step an
    # environment (2 frames) the cheapest collection that still ends in an update. Two evaluation episodes, as two
    # test episodes: at the default 256 the prompt pass took 57 s and each token step 6 s (one CPU thread, 256 rows
    # of 262,144 logits), and a step is the smallest piece a stop can cut, so the stop came 5.6 s after the signal
    # (12.4 s on a loaded CI machine): that measured the batch, not the signal handling.
    evaluation = [
        "trainer.eval.every=1", "trainer.eval.num_episodes=2", "trainer=reinforce", "trainer.frames_per_batch=2",
        "trainer.minibatch_size=2",
    ]
    overrides = {"evaluation": evaluation, "update": ["trainer.minibatch_size=4"]}.get(phase, [])
    if phase == "update":  # the first minibatch's optimiser step; the second minibatch is then not run
        _signal_when(monkeypatch, update, "optimizer_step", signals)
    elif phase == "sampling":  # a token sampled inside the collection
        _inside(monkeypatch, collection, "collect", inside)
        _signal_when(monkeypatch, decoding, "entropy", signals, lambda: inside["on"])
    else:  # a token sampled inside the evaluation after iteration 1 (not the one that checks the metric before it)
        _inside(monkeypatch, RlEvaluator, "evaluate", inside, when=lambda evaluator, iteration: iteration == 1)
        _signal_when(monkeypatch, decoding, "entropy", signals, lambda: inside["on"])
    run_dir = tmp_path / "run"
    try:
        with pytest.raises(RunInterrupted) as error:
            run_experiment(real_config(gemma_gguf, tmp_path, *overrides), run_dir)
        seconds = signals.seconds_since()
    finally:
        if signals.watchdog is not None:
            signals.watchdog.cancel()
    assert seconds < 10, seconds
    message = str(error.value)
    assert "\n" not in message and f"python -m nip_like.resume {run_dir}" in message, message
    # The line names the part of the run and what it stopped in: the evaluation after iteration 1 runs when the
    # iteration is counted, and is named as that evaluation (not as the next iteration).
    assert {
        "sampling": "at once during iteration 1, in a language model's decoding",
        "evaluation": "at once in the evaluation after iteration 1, in ",  # its decoding, or between its steps
        "update": "at once during iteration 1, in the update",
    }[phase] in message, message
    assert not (run_dir / LOCK_FILE).exists()


# ------------------------------------------------------------------ the other LM paths


def test_code_validation_in_the_chat_view_with_the_real_model(gemma_gguf, tmp_path):
    config = make_config(
        "scenario=code_validation",
        "protocol=nip",
        f"scenario.default_agent.pretrained_path={gemma_gguf}",
        f"scenario.default_agent.chat_template={TEMPLATE}",
        "scenario.default_agent.lora.r=4",
        "scenario.default_agent.max_new_tokens=6",
        "scenario.num_problems=12",
        "scenario.shared_base=true",
        f"scenario.cache_dir={tmp_path / 'cache'}",
        "trainer=reinforce",  # one pass over the long prompts (code and its problem) a step: PPO's took 52 s here
        "trainer.num_envs=2",
        "trainer.frames_per_batch=2",
        "trainer.minibatch_size=2",
        *SMALL_LOOP,
    )
    metrics = run_experiment(config, tmp_path / "run")
    assert metrics["test/episodes"] == 2
    assert_template_saved(saved_agent(tmp_path / "run", "verifier"))


def test_expert_iteration_fine_tunes_the_real_model_as_a_local_text_model(gemma_gguf, tmp_path):
    config = make_config(
        "scenario=duplicates_chat",
        "protocol=nip",
        "trainer=expert_iteration",
        f"scenario.default_model.path={gemma_gguf}",
        f"scenario.default_model.chat_template={TEMPLATE}",
        "scenario.default_model.max_new_tokens=4",
        "scenario.num_lists=200",
        "scenario.scripted_provers=true",
        f"scenario.cache_dir={tmp_path / 'cache'}",
        "trainer.num_iterations=2",  # the models of iteration 1 are fine-tuned when iteration 2 starts
        "trainer.episodes=8",
        "trainer.test_episodes=4",
        "trainer.fine_tune.epochs=1",
        "run.progress_bar=false",
        f"run.num_threads={THREADS}",
        "logger=csv",
    )
    run = tmp_path / "run"
    metrics = run_experiment(config, run)
    assert "test/accuracy" in metrics
    initial = run / "models" / "verifier" / "initial"
    assert (initial / "model.safetensors").is_symlink()  # the converted weights, linked, not copied
    assert_template_saved(initial)
    tuned = [path.parent for path in (run / "models").rglob("model.safetensors") if not path.is_symlink()]
    assert tuned, "no fine-tuned model folder was written"
    for folder in tuned:
        assert_template_saved(folder)
