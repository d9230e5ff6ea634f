"""Quiet runs: a run shows each warning at most once (docs: guarantees).

Every warning is recorded (``simplefilter("always")``, so no filter of Python's or pytest's hides
a repeat) over a whole in-process run: a graph run, a language-model run in the token view with a
warm start, and one in the chat view with LoRA adapters on a GPT-2 folder (peft's Conv1D layers,
and peft's read of a property transformers deprecated, at each of the two agents' models).
"""

from __future__ import annotations

import warnings
from collections import Counter
from pathlib import Path

import pytest

from nip_like.dependency_warnings import ONCE, dependency_warnings_once
from nip_like.experiment import build_trainer, run_experiment
from tests.conftest import make_config, smoke_config
from tests.lm_folders import chat_model  # noqa: F401 - the fixture

QUIET = ("run.progress_bar=false", "run.num_threads=1", "logger=csv")


def warnings_of(run) -> Counter:
    """Run ``run()`` and count the warnings it raised by category and message."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return Counter(f"{warning.category.__name__}: {warning.message}" for warning in caught)


def assert_none_repeated(counts: Counter) -> None:
    repeated = {message: count for message, count in counts.items() if count > 1}
    assert not repeated, f"warnings shown more than once: {repeated}"


@pytest.mark.slow  # about a second or more: the fast tier keeps tests under ~0.8 s
def test_a_graph_run_shows_no_warning_twice(tmp_path):
    config = smoke_config(
        "scenario=graph_isomorphism",
        "protocol=nip",
        "scenario.num_pairs=80",
        "scenario.min_nodes=7",
        "scenario.max_nodes=8",
        f"scenario.cache_dir={tmp_path / 'data'}",
        "scenario.default_agent.hidden_size=16",
        "trainer.num_iterations=2",
        "trainer.eval.every=1",
        "trainer.num_test_episodes=32",
        "logger=csv",
    )
    assert_none_repeated(warnings_of(lambda: run_experiment(config, tmp_path / "run")))


def test_a_token_view_lm_run_with_a_warm_start_shows_no_warning_twice(tmp_path):
    config = make_config(
        "preset=lm_quick",
        *QUIET,
        "scenario.num_lists=600",
        f"scenario.cache_dir={tmp_path / 'data'}",
        "scenario.default_agent.hidden_size=16",
        "scenario.default_agent.num_layers=1",
        "scenario.default_agent.intermediate_size=32",
        "trainer.pretrain.epochs=1",
        "trainer.pretrain.agent_epochs.verifier=1",
        "trainer.pretrain.warmup_steps=1",
        f"trainer.pretrain.cache_dir={tmp_path / 'warm'}",
        "trainer.num_iterations=2",
        "trainer.num_envs=8",
        "trainer.frames_per_batch=32",
        "trainer.minibatch_size=16",
        "trainer.eval.every=1",
        "trainer.eval.num_episodes=8",
        "trainer.num_test_episodes=8",
        "trainer.test_batch_episodes=8",
    )
    assert_none_repeated(warnings_of(lambda: run_experiment(config, tmp_path / "run")))


@pytest.mark.slow
def test_a_chat_view_lora_run_shows_no_warning_twice(chat_model, tmp_path):
    config = make_config(
        "scenario=duplicates",
        "protocol=nip",
        "protocol.first_speaker=prover",
        "protocol.max_rounds=2",
        "scenario.view=chat",
        f"scenario.default_agent.pretrained_path={chat_model('gpt2')}",
        "scenario.default_agent.max_new_tokens=12",
        "scenario.default_agent.lora.r=4",
        "scenario.num_lists=60",
        "scenario.length=6",
        "scenario.num_values=12",
        f"scenario.cache_dir={tmp_path / 'data'}",
        "trainer.num_envs=4",
        "trainer.frames_per_batch=16",
        "trainer.minibatch_size=8",
        "trainer.num_iterations=2",
        "trainer.eval.every=1",
        "trainer.eval.num_episodes=4",
        "trainer.num_test_episodes=4",
        "trainer.test_batch_episodes=4",
        *QUIET,
    )
    counts = warnings_of(lambda: run_experiment(config, tmp_path / "run"))
    assert_none_repeated(counts)
    # GPT-2's Conv1D layers are declared to peft (fan_in_fan_out), so it has nothing to correct.
    assert not [message for message in counts if "fan_in_fan_out" in message]


def test_a_warning_raised_at_every_iteration_is_shown_once_under_pythons_own_filter(tmp_path, monkeypatch):
    # Python shows a warning once per place ("default"), unless a catch_warnings block in between resets its record:
    # the loop must not enter one at every iteration.
    trainer = build_trainer(smoke_config("trainer.num_iterations=3"), tmp_path / "run")
    fill_buffer = type(trainer).fill_buffer

    def warning_fill_buffer(self, data):
        warnings.warn("raised at every iteration", UserWarning)
        return fill_buffer(self, data)

    monkeypatch.setattr(type(trainer), "fill_buffer", warning_fill_buffer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        trainer.train()
    assert [str(warning.message) for warning in caught].count("raised at every iteration") == 1


def test_a_dependency_warning_is_shown_the_first_time_only_and_others_pass_through():
    category, message = ONCE[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            with dependency_warnings_once():
                warnings.warn(message, category)
                warnings.warn("another warning", UserWarning)
    shown = Counter(str(warning.message) for warning in caught)
    # The first time may have been in an earlier test of this process: at most once, never dropped otherwise.
    assert shown[message] <= 1 and shown["another warning"] == 3
    assert all(warning.filename == __file__ for warning in caught)  # shown where it was raised


def test_a_dependency_warning_raised_by_a_failing_call_is_still_shown():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError):
            with dependency_warnings_once():
                warnings.warn("before the failure", UserWarning)
                raise ValueError("failed")
    assert [str(warning.message) for warning in caught] == ["before the failure"]
    assert Path(caught[0].filename) == Path(__file__)
