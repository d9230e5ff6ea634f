"""Opponent pools (``trainer.opponent_pool``): training episodes meet earlier versions of an agent."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from nip_like import experiment, keys
from nip_like.errors import ConfigError
from nip_like.experiment import run_experiment
from nip_like.trainers.opponent_pool import LIVE, OpponentPool
from tests.conftest import stopped_and_resumed
from tests.lm_folders import chat_model  # noqa: F401 - the fixture
from tests.test_lm_chat import chat_config


def pooled(folder, tmp_path, *overrides: str):
    """The tiny chat game, LoRA agents, the verifier's seat played by its snapshots in half of the episodes."""
    return chat_config(
        folder, tmp_path, "scenario.default_agent.lora.r=4", "trainer.opponent_pool.agent=verifier",
        "trainer.opponent_pool.live_fraction=0.5", "trainer.opponent_pool.size=2", *overrides,
    )


def episodes(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "opponent_pool.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_snapshots_play_the_seat_with_their_own_weights_and_the_agent_trains_on_its_own_episodes(chat_model, tmp_path):
    trainer = experiment.build_trainer(pooled(chat_model("qwen2"), tmp_path, "trainer.num_iterations=3"), tmp_path / "run")
    pool = trainer.opponent_pool
    assert list(pool.snapshots) == [0] and all("lora_" in name for name in pool.names)  # adapters only
    trainer.train()
    assert list(pool.snapshots) == [2, 3]  # one after each update, at most two kept, the initial one gone

    # One more collection: the verifier's messages in a snapshot's episodes are that snapshot's samples.
    with pool.in_play():
        batch = next(trainer._collector_iterator)
    versions = batch.get(keys.OPPONENT_VERSION_KEY)
    index = trainer.agent_names.index("verifier")
    acted = batch.get(keys.ACTIVE_KEY)[..., index]
    assert bool(((versions == LIVE) & acted).any()) and bool(((versions != LIVE) & acted).any())
    for version in versions.unique().tolist():
        rows = acted & (versions == version)
        if not bool(rows.any()):
            continue
        with pool.playing(version):
            scores = trainer.policy.score_actions(batch[rows])
        stored = batch[rows].get(keys.TOKEN_LOG_PROBS_KEY)[..., index, :]
        mask = scores.token_mask[..., index, :]
        torch.testing.assert_close(scores.token_log_probs[..., index, :][mask], stored[mask], atol=1e-5, rtol=1e-5)
    # The live weights are back after each snapshot played.
    with pool.playing(versions.max().item()):
        pass
    live = trainer.policy.score_actions(batch[acted & (versions == LIVE)])
    stored = batch[acted & (versions == LIVE)].get(keys.TOKEN_LOG_PROBS_KEY)[..., index, :]
    torch.testing.assert_close(live.token_log_probs[..., index, :][live.token_mask[..., index, :]], stored[live.token_mask[..., index, :]], atol=1e-5, rtol=1e-5)

    # The update sees the verifier active only where it played itself.
    pool.record(batch, 3)
    assert not bool((batch.get(keys.ACTIVE_KEY)[..., index] & (versions != LIVE)).any())


@pytest.mark.slow
def test_every_finished_episode_is_logged_with_its_opponent_and_the_learners_score(chat_model, tmp_path):
    run_experiment(pooled(chat_model("qwen2"), tmp_path, "trainer.num_iterations=3", "logger=csv"), tmp_path / "run")
    logged = episodes(tmp_path / "run")
    assert {entry["iteration"] for entry in logged} == {1, 2, 3}
    assert {entry["opponent"] for entry in logged} <= {LIVE, 0, 1, 2}
    assert {entry["opponent"] for entry in logged if entry["iteration"] == 1} <= {LIVE, 0}  # only the initial snapshot yet
    met = [entry for entry in logged if entry["opponent"] == 0]
    expected = sum(1.0 if e["learner_return"] > e["opponent_return"] else 0.5 if e["learner_return"] == e["opponent_return"] else 0.0 for e in met)
    from nip_like.logging import read_csv_metric

    assert read_csv_metric(tmp_path / "run", "pool/0/score")[-1][1] == pytest.approx(expected / len(met))
    counts = [value for _, value in read_csv_metric(tmp_path / "run", "pool/live_episodes")]
    assert sum(counts) == sum(1 for entry in logged if entry["opponent"] == LIVE)


@pytest.mark.slow
def test_episodes_started_in_one_iteration_meet_one_draw_with_per_iteration(chat_model, tmp_path):
    config = pooled(chat_model("qwen2"), tmp_path, "trainer.opponent_pool.per=iteration", "trainer.opponent_pool.live_fraction=0.3")
    trainer = experiment.build_trainer(config, tmp_path / "run")
    pool, draws, seen = trainer.opponent_pool, set(), []
    after_update = pool.after_update

    def noting(*args):  # the assignments of the iteration's episodes, before those that ended are forgotten
        seen.append(dict(pool.assignments))
        after_update(*args)

    pool.after_update = noting
    for _ in range(4):
        before = dict(pool.assignments)
        trainer.train_iteration()
        trainer.state.iteration += 1
        started = {group: version for group, version in seen[-1].items() if group not in before}
        assert started and set(started.values()) == {pool.iteration_draw}
        draws.add(pool.iteration_draw)
    assert len(draws) > 1  # the draw changes from one iteration to the next


@pytest.mark.slow
def test_a_run_with_a_pool_resumes_to_the_same_draws(chat_model, tmp_path, monkeypatch):
    folder = chat_model("qwen2")
    overrides = ("trainer.num_iterations=4", "run.checkpoint_every=1", "logger=csv", "trainer.opponent_pool.draw=win_rate")
    reference = run_experiment(pooled(folder, tmp_path / "a", *overrides), tmp_path / "reference")
    assert stopped_and_resumed(monkeypatch, pooled(folder, tmp_path / "a", *overrides), tmp_path / "resumed", 2) == reference
    assert episodes(tmp_path / "resumed") == episodes(tmp_path / "reference")


def _pool(draw: str, live_fraction: float = 0.0, size: int = 3) -> OpponentPool:
    model = torch.nn.Linear(2, 1)
    actor = SimpleNamespace(policy=lambda name: SimpleNamespace(model=model))
    options = SimpleNamespace(agent="verifier", learner=None, size=size, every=1, draw=draw, per="episode", live_fraction=live_fraction)
    pool = OpponentPool(options, ("prover", "verifier"), actor, seed=0, run_dir=__import__("pathlib").Path("."))
    for version in (1, 2):
        with torch.no_grad():
            model.weight.add_(1.0)
        pool.add_snapshot(version)
    return pool


def test_the_draw_rules():
    draws = lambda pool, n=3000: [pool._draw() for _ in range(n)]  # noqa: E731
    assert set(draws(_pool("latest"))) == {2}
    uniform = draws(_pool("uniform"))
    assert {version: uniform.count(version) / len(uniform) for version in (0, 1, 2)} == pytest.approx({0: 1 / 3, 1: 1 / 3, 2: 1 / 3}, abs=0.04)
    live = draws(_pool("uniform", live_fraction=0.25))
    assert live.count(LIVE) / len(live) == pytest.approx(0.25, abs=0.03)
    # win_rate: the learner beat snapshot 0 in 9 of 10 episodes, snapshot 1 in 1 of 10, never met snapshot 2.
    pool = _pool("win_rate")
    pool.scores = {0: [9.0, 10], 1: [1.0, 10]}
    shares = {version: share for version, share in zip((0, 1, 2), torch.tensor([(1 - pool.score(v)) ** 2 for v in (0, 1, 2)]).div_(sum((1 - pool.score(v)) ** 2 for v in (0, 1, 2))).tolist())}
    drawn = draws(pool)
    assert {version: drawn.count(version) / len(drawn) for version in (0, 1, 2)} == pytest.approx(shares, abs=0.04)
    assert drawn.count(1) > drawn.count(2) > drawn.count(0)
    # The oldest snapshot leaves a full pool; one that an episode in flight still meets is kept until it ends.
    pool = _pool("uniform", size=2)
    assert list(pool.snapshots) == [1, 2] and list(pool.retired) == [0]
    pool.assignments = {7: 0}
    pool.after_update(3, torch.tensor([7]))
    assert list(pool.snapshots) == [2, 3] and sorted(pool.retired) == [0]
    pool.after_update(4, torch.tensor([8]))
    assert pool.retired == {} and pool.assignments == {}


@pytest.mark.parametrize(
    "overrides,message",
    [
        (("trainer.opponent_pool.agent=judge",), r"trainer.opponent_pool.agent=judge is not an agent of this game; allowed: \['prover', 'verifier'\]$"),
        (("trainer.opponent_pool.agent=verifier", "trainer.opponent_pool.learner=verifier"), r"learner=verifier must be another agent of the game: one of \['prover'\]$"),
        (("trainer.opponent_pool.agent=verifier", "trainer=lola"), r"^trainer lola differentiates through the other agents' updates"),
    ],
    ids=["unknown", "learner", "learning-aware"],
)
def test_a_pool_that_cannot_apply_is_refused_in_one_line(chat_model, tmp_path, overrides, message):
    config = chat_config(chat_model("qwen2"), tmp_path, "scenario.default_agent.lora.r=4", *overrides)
    with pytest.raises(ConfigError, match=message):
        experiment.preflight(config)  # before any run folder
    with pytest.raises(ConfigError, match=message):
        experiment.build_trainer(config, tmp_path / "run")
