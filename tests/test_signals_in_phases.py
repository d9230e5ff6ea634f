"""A stop request (SIGTERM, SIGINT) ends every long phase of a run within seconds, not at its end.

Each test sends the signal in the middle of one phase (a warm start, an update, an evaluation, the test
loop, a language model's decoding, a dataset's generation) and measures how long the run or the call takes
to stop. The grace that lets an iteration that ends soon end and be saved
(:data:`nip_like.interrupts.GRACE_SECONDS`) is shortened in process; the command-line test keeps it. On
the code before these phases polled for the request, each phase ran to its end: a watchdog's second
signal stops those runs after :data:`WATCHDOG_SECONDS`, and the tests fail on the time and the line.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

import nip_like.warm_start as pretrain
import nip_like.scenarios.duplicates.demonstrations as duplicate_demonstrations
from nip_like import interrupts
from nip_like.errors import RunInterrupted
from nip_like.experiment import run_experiment
from nip_like.interrupts import StopNow, handle_interrupts
from nip_like.lm import LMAgentConfig, build_lm_policy
from nip_like.lm.sharding import decoder_layers
from nip_like.lm.static_decoding import Decoder
from nip_like.run_lock import LOCK_FILE
from nip_like.scenarios.environment import InteractionEnv
from nip_like.scenarios.graph_isomorphism.data import GraphPairSpec, cache_path, load_or_generate
from nip_like.supervised import supervised_epoch
from nip_like.trainers import update
from nip_like.trainers.data_parallel import LossPasses
from nip_like.trainers.evaluation import RlEvaluator
from tests.conftest import popen_cli, smoke_config
from tests.test_reliability import assert_one_row_per_step, iteration_of, metric_steps
from tests.test_reliability import default_sigint  # noqa: F401 - the autouse fixture: SIGINT as a terminal gives it
from tests.test_duplicates_scenario import lm_smoke_config
from tests.test_static_decoding import EOS, add_logit_bias, prompts
from tests.test_static_decoding import tokenizer  # noqa: F401 - the fixture

#: The grace in process: short, so that the tests measure the phase's own delay.
GRACE = 0.2
#: How long after the first signal a second one stops a run that did not stop (the code before this change).
WATCHDOG_SECONDS = 8.0
#: The longest stop accepted in process, from the first signal (the grace, one step of the phase, the close).
PROMPT_STOP_SECONDS = 3.0

#: A small graph-isomorphism game whose verifier fits its labels (a tensor agent, fast epochs).
GI_GAME = (
    "scenario=graph_isomorphism", "scenario.num_pairs=80", "scenario.min_nodes=7", "scenario.max_nodes=8",
    "scenario.default_agent.hidden_size=16", "protocol=nip", "protocol.max_rounds=2",
)


@pytest.fixture(autouse=True)
def short_grace(monkeypatch):
    monkeypatch.setattr(interrupts, "GRACE_SECONDS", GRACE)


class Signals:
    """A signal to this process at a chosen moment, and a watchdog's second one if it does not stop."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        self.signum = signum
        self.sent_at: float | None = None
        self.watchdog: threading.Timer | None = None

    def send(self) -> None:
        """Send the first signal now (from inside the phase) and start the watchdog."""
        if self.sent_at is not None:
            return
        self.sent_at = time.monotonic()
        os.kill(os.getpid(), self.signum)
        self.watchdog = threading.Timer(WATCHDOG_SECONDS, os.kill, (os.getpid(), self.signum))
        self.watchdog.daemon = True
        self.watchdog.start()

    def seconds_since(self) -> float:
        """Seconds since the first signal; the watchdog is called off."""
        if self.watchdog is not None:
            self.watchdog.cancel()
        assert self.sent_at is not None, "the phase was never reached: no signal was sent"
        return time.monotonic() - self.sent_at


@pytest.fixture
def signals(request):
    """A :class:`Signals` of the test's ``signum`` parameter (SIGTERM without one); its watchdog ends with the test."""
    callspec = getattr(request.node, "callspec", None)
    sender = Signals(callspec.params.get("signum", signal.SIGTERM) if callspec is not None else signal.SIGTERM)
    yield sender
    if sender.watchdog is not None:
        sender.watchdog.cancel()


def interrupted(config, run_dir: Path, signals: Signals) -> tuple[RunInterrupted, float]:
    """Run ``config`` into ``run_dir``, stopped by the signal: the error and the seconds it took after the signal."""
    with pytest.raises(RunInterrupted) as error:
        run_experiment(config, run_dir)
    return error.value, signals.seconds_since()


def slowed(monkeypatch, owner, name: str, seconds: float, when: dict, signals: Signals) -> None:
    """``owner.name`` sleeps ``seconds`` first while ``when["slow"]`` is true (a phase made long without more work).

    The first slow call sends the signal: the run is then in the middle of the phase.
    """
    original = getattr(owner, name)

    def slow(*args, **kwargs):
        if when["slow"]:
            signals.send()
            time.sleep(seconds)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, slow)


def on_call(monkeypatch, owner, name: str, action, call: int = 1) -> None:
    """``owner.name`` runs ``action()`` first on its ``call``-th call."""
    original = getattr(owner, name)
    calls = []

    def acting(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            action()
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, acting)


# ------------------------------------------------------------------ runs, in process


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_in_the_warm_start_stops_it_and_leaves_a_run_that_starts_again(tmp_path, monkeypatch, signals, signum):
    # About 30 ms an epoch: 100,000 epochs would hold the run for most of an hour.
    config = smoke_config(
        *GI_GAME, f"scenario.cache_dir={tmp_path / 'data'}", "trainer.pretrain.agents=[verifier]",
        "trainer.pretrain.epochs=100000", f"trainer.pretrain.cache_dir={tmp_path / 'warm'}",
    )
    on_call(monkeypatch, pretrain, "supervised_epoch", signals.send, call=3)
    run_dir = tmp_path / "run"
    error, seconds = interrupted(config, run_dir, signals)
    assert seconds < PROMPT_STOP_SECONDS, seconds
    assert str(error) == (
        "interrupted at once while setting up, in the warm start of verifier, before the first checkpoint; "
        f"start it again with: python -m nip_like.resume {run_dir}"
    )
    assert error.exit_status == 128 + signum
    # What a resume needs to start the run again (tests/test_reliability.py resumes such a folder); no half fit cached.
    assert (run_dir / "config.yaml").is_file() and not (run_dir / "checkpoints" / "last.pt").exists()
    assert not (run_dir / LOCK_FILE).exists() and not (run_dir / "summary.json").exists()
    assert not list((tmp_path / "warm").glob("*.pt"))


@pytest.mark.slow
def test_a_signal_in_the_scripted_play_of_a_warm_starts_demonstrations_stops_it(tmp_path, monkeypatch, signals):
    # The duplicates game's language-model agents: their demonstrations are scripted play, round by round.
    config = lm_smoke_config(
        tmp_path, "trainer.pretrain.agents=[verifier]", "trainer.pretrain.epochs=50",
        f"trainer.pretrain.cache_dir={tmp_path / 'warm'}",
    )
    when = {"slow": False}
    slowed(monkeypatch, InteractionEnv, "advance", 1.0, when, signals)  # each round's step takes a second
    on_call(monkeypatch, duplicate_demonstrations, "record_scripted_play", lambda: when.update(slow=True))
    run_dir = tmp_path / "run"
    error, seconds = interrupted(config, run_dir, signals)
    assert seconds < PROMPT_STOP_SECONDS, seconds
    assert str(error) == (
        "interrupted at once while setting up, in the scripted play of the demonstrations, before the first "
        f"checkpoint; start it again with: python -m nip_like.resume {run_dir}"
    )
    assert not (tmp_path / "warm").exists() or not list((tmp_path / "warm").glob("*.pt"))


@pytest.mark.slow
def test_a_signal_in_a_long_update_drops_it_and_the_run_resumes_from_the_last_checkpoint(
    tmp_path, monkeypatch, signals
):
    overrides = ("trainer.num_iterations=3", "run.checkpoint_every=1", "trainer.eval.every=0", "logger=csv")
    reference = run_experiment(smoke_config(*overrides), tmp_path / "reference")
    # The second iteration's update is long: each minibatch takes a second (six of them).
    when = {"slow": False}
    slowed(monkeypatch, LossPasses, "forward", 1.0, when, signals)
    on_call(monkeypatch, update, "optimize", lambda: when.update(slow=True), call=2)
    run_dir = tmp_path / "run"
    error, seconds = interrupted(smoke_config(*overrides), run_dir, signals)
    assert seconds < PROMPT_STOP_SECONDS, seconds
    assert str(error) == (
        "interrupted at once during iteration 2, in the update; resume from the last checkpoint with: "
        f"python -m nip_like.resume {run_dir}"
    )
    assert iteration_of(run_dir / "checkpoints" / "last.pt") == 1  # the update of iteration 2 was dropped
    monkeypatch.undo()
    assert run_experiment(smoke_config(*overrides), run_dir, resume=True) == reference


@pytest.mark.slow
def test_a_run_stopped_before_its_first_checkpoint_runs_again_in_its_folder_with_one_row_per_step(
    tmp_path, monkeypatch, signals, capsys
):
    overrides = ("trainer.num_iterations=3", "run.checkpoint_every=0", "trainer.eval.every=0", "logger=csv")
    reference = run_experiment(smoke_config(*overrides), tmp_path / "reference")
    when = {"slow": False}
    slowed(monkeypatch, LossPasses, "forward", 1.0, when, signals)
    on_call(monkeypatch, update, "optimize", lambda: when.update(slow=True), call=2)
    run_dir = tmp_path / "run"
    error, _ = interrupted(smoke_config(*overrides), run_dir, signals)
    assert "during iteration 2, in the update, before the first checkpoint; start it again with" in str(error)
    assert metric_steps(run_dir)["train/iteration.csv"] == [1]
    monkeypatch.undo()
    capsys.readouterr()
    # The same command again (a scheduler's requeue): the folder's rows of the stopped run do not stay.
    assert run_experiment(smoke_config(*overrides), run_dir) == reference
    assert f"No checkpoint in {run_dir} yet: starting the run again from the beginning" in capsys.readouterr().out
    assert metric_steps(run_dir) == metric_steps(tmp_path / "reference")
    assert_one_row_per_step(run_dir, 3)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("call", "where"),
    [(1, "during iteration 1"), (2, "in the evaluation after iteration 1")],
    ids=["before-the-first-iteration", "after-iteration-1"],
)
def test_a_signal_in_an_evaluation_stops_it_within_a_step_and_names_it(tmp_path, monkeypatch, signals, call, where):
    # The first evaluation checks the metric before the first step; the second follows iteration 1's update, when
    # the train loop has counted that iteration: the line names it so, not "during iteration 2".
    when = {"slow": False}
    slowed(monkeypatch, InteractionEnv, "_step", 1.0, when, signals)  # each step of every episode takes a second
    on_call(monkeypatch, RlEvaluator, "evaluate", lambda: when.update(slow=True), call=call)
    run_dir = tmp_path / "run"
    error, seconds = interrupted(smoke_config("trainer.eval.every=1"), run_dir, signals)
    assert seconds < PROMPT_STOP_SECONDS, seconds
    assert str(error) == (
        f"interrupted at once {where}, in the episodes of an evaluation or test, before the first "
        f"checkpoint; start it again with: python -m nip_like.resume {run_dir}"
    )


@pytest.mark.slow
def test_a_signal_in_a_long_test_batch_stops_it_and_resume_tests_again(tmp_path, monkeypatch, signals):
    # One batch of test episodes: the test loop's check between batches never comes.
    overrides = ("trainer.num_iterations=2", "trainer.eval.every=0", "logger=csv", "trainer.test_batch_episodes=64")
    reference = run_experiment(smoke_config(*overrides), tmp_path / "reference")
    when = {"slow": False}
    slowed(monkeypatch, InteractionEnv, "_step", 1.0, when, signals)
    on_call(monkeypatch, RlEvaluator, "test_env", lambda: when.update(slow=True))
    run_dir = tmp_path / "run"
    error, seconds = interrupted(smoke_config(*overrides), run_dir, signals)
    assert seconds < PROMPT_STOP_SECONDS, seconds
    assert str(error) == (
        "interrupted in the test loop (training finished at iteration 2); "
        f"resume with: python -m nip_like.resume {run_dir}"
    )
    assert not (run_dir / "summary.json").exists()
    monkeypatch.undo()
    assert run_experiment(smoke_config(*overrides), run_dir, resume=True) == reference


# ------------------------------------------------------------------ phases, called directly


@contextmanager
def stopped_soon(signals: Signals, delay: float = 0.3):
    """Expect :class:`StopNow` from the block, under a signal sent ``delay`` seconds in (from another thread).

    Yields pytest's record of the exception. A block still running when the
    watchdog's second signal comes (its ``KeyboardInterrupt``) fails the test.
    """
    timer = threading.Timer(delay, signals.send)
    try:
        with handle_interrupts():
            timer.start()
            with pytest.raises(StopNow) as stopped:
                yield stopped
    except KeyboardInterrupt:
        pytest.fail(f"still running {WATCHDOG_SECONDS} s after the signal (a second signal stopped it)")
    finally:
        timer.cancel()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["eager", "static"])
def test_a_signal_ends_a_long_decoding_before_its_next_token_and_returns_nothing(tokenizer, signals, mode):
    torch.manual_seed(0)
    # 1500 tokens of each of six rows: about 10 s on one free core, and no row ends early.
    policy = build_lm_policy(LMAgentConfig(max_new_tokens=1500, decoding=mode), tokenizer)
    add_logit_bias(policy, {EOS: -1e4})
    ids, mask = prompts(tokenizer)
    with stopped_soon(signals) as stopped:
        policy.sample(ids, mask, torch.Generator().manual_seed(0))
    seconds = signals.seconds_since()
    assert policy.decoder.last_passes == 0  # no call of the decoder finished
    assert stopped.value.where == "in a language model's decoding"
    assert seconds < PROMPT_STOP_SECONDS, seconds


def test_a_signal_cuts_the_prompts_pass_between_two_decoder_layers(tokenizer, monkeypatch):
    # A pass cannot be cut inside a layer, but it is not waited for to its end either: a 256-row evaluation's pass
    # over the prompts of a 262,144-token model took 57 s on one CPU thread (tests/test_real_model.py).
    monkeypatch.setattr(interrupts, "GRACE_SECONDS", 0.0)
    torch.manual_seed(0)
    policy = build_lm_policy(LMAgentConfig(max_new_tokens=4, decoding="eager"), tokenizer)
    layers = decoder_layers(policy.model)
    assert len(layers) >= 2, layers
    ran: list[int] = []
    # The signal comes while the first layer works on the prompts (a forward hook: its output is made).
    hooks = [
        layers[0].register_forward_hook(lambda *args: (ran.append(0), os.kill(os.getpid(), signal.SIGTERM))),
        layers[1].register_forward_hook(lambda *args: ran.append(1)),
    ]
    ids, mask = prompts(tokenizer)
    with handle_interrupts(), pytest.raises(StopNow) as stopped:
        policy.sample(ids, mask, torch.Generator().manual_seed(0))
    assert stopped.value.where == "in a language model's decoding"
    assert ran == [0]  # the second layer never ran: the prompts' pass was cut, not finished
    assert not any(layer._forward_pre_hooks for layer in layers)  # the stop points went with the decoding
    for hook in hooks:
        hook.remove()
    assert policy.sample(ids, mask, torch.Generator().manual_seed(0))["tokens"].shape[0] == ids.shape[0]  # no request


@pytest.mark.slow
def test_a_signal_ends_a_long_dataset_generation_and_caches_nothing(tmp_path, signals):
    spec = GraphPairSpec(num_pairs=3000, seed=3, min_nodes=7, max_nodes=11)  # 15 s or more of drawing
    with stopped_soon(signals) as stopped:
        load_or_generate(spec, tmp_path)
    seconds = signals.seconds_since()
    assert stopped.value.where == "in the generation of the graph pairs"
    assert seconds < PROMPT_STOP_SECONDS, seconds
    assert not cache_path(spec, tmp_path).exists() and not list(tmp_path.iterdir())


def test_a_signal_during_a_supervised_steps_forward_pass_stops_it_before_its_backward_pass(monkeypatch):
    monkeypatch.setattr(interrupts, "GRACE_SECONDS", 0.0)
    network = torch.nn.Linear(2, 1)
    before = [parameter.detach().clone() for parameter in network.parameters()]
    data = TensorDict({"x": torch.ones(8, 2)}, batch_size=[8])

    def step_loss(batch):  # a forward pass during which the signal comes
        os.kill(os.getpid(), signal.SIGTERM)
        loss = network(batch["x"]).square().mean()
        return loss, torch.ones(batch.batch_size[0])

    optimizer = torch.optim.SGD(network.parameters(), lr=0.1)
    with handle_interrupts(), pytest.raises(StopNow) as stopped:
        supervised_epoch(data, step_loss, optimizer, 4, torch.Generator().manual_seed(0), phase="the warm start of x")
    assert stopped.value.where == "in the warm start of x"
    assert all(torch.equal(old, new) for old, new in zip(before, network.parameters()))  # no step was taken


def test_stop_point_waits_for_the_grace_and_then_raises(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(interrupts.time, "monotonic", lambda: clock[0])
    with handle_interrupts():
        interrupts.stop_point("nothing")  # no request: nothing happens
        os.kill(os.getpid(), signal.SIGTERM)
        clock[0] += GRACE / 2
        interrupts.stop_point("the update")  # within the grace: a safe point may still come
        clock[0] += GRACE
        with pytest.raises(StopNow) as stopped:
            interrupts.stop_point("the update")
    assert stopped.value.where == "in the update" and str(stopped.value) == "stopped while in the update"
    interrupts.stop_point("the update")  # the request ends with the block


# ------------------------------------------------------------------ the command line


def wait_for_text(process, text: str, seconds: float = 240) -> str:
    """Read the process's standard error until ``text`` shows; what was read."""
    read = ""
    deadline = time.monotonic() + seconds
    while text not in read:
        assert time.monotonic() < deadline, read
        chunk = process.stderr.read(1)
        assert chunk, (read, process.wait())
        read += chunk
    return read


@pytest.mark.slow
def test_sigterm_in_the_warm_start_of_the_command_ends_it_in_seconds_with_its_line_and_status(tmp_path):
    run_dir = tmp_path / "run"
    args = [
        "preset=smoke", *GI_GAME, f"scenario.cache_dir={tmp_path / 'data'}", "trainer.pretrain.agents=[verifier]",
        "trainer.pretrain.epochs=100000", f"trainer.pretrain.cache_dir={tmp_path / 'warm'}",
        "run.progress_bar=true", f"hydra.run.dir={run_dir}",
    ]
    process = popen_cli(args)
    try:
        wait_for_text(process, "Warm start of verifier")
        time.sleep(0.5)
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    seconds = time.monotonic() - started
    assert seconds < 10, seconds  # the grace of two seconds, an epoch and the close
    assert process.returncode == 128 + signal.SIGTERM
    line = stderr.replace("\r", "\n").strip().splitlines()[-1]
    assert line == (
        "interrupted at once while setting up, in the warm start of verifier, before the first checkpoint; "
        f"start it again with: python -m nip_like.resume {run_dir}"
    ), stderr
    assert "Traceback" not in stderr
    assert not (run_dir / LOCK_FILE).exists() and not (run_dir / "checkpoints" / "last.pt").exists()
