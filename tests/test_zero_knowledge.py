"""Zero-knowledge protocols: the added agents and their views, the reward formulas, a smoke run, bad inputs."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from nip_like.cli import report_errors
from nip_like.experiment import build_trainer, run_experiment
from nip_like.validation import build_scenario
from nip_like.logging import read_csv_metric
from nip_like.protocols.base import zero_knowledge_protocols
from nip_like.protocols.proof import ProofProtocol
from nip_like.protocols.zero_knowledge import (
    ADVERSARIAL_KEY,
    ADVERSARIAL_VERIFIER,
    SIMULATOR,
    simulator_distance,
    zero_knowledge_rewards,
)
from nip_like.registry import SCENARIOS, PROTOCOLS
from nip_like.scenarios.graph_isomorphism.scenario import zero_knowledge_metrics
from tests.conftest import smoke_config, stop_at
from tests.test_gi_scenario import gi_config as small_gi_config

#: The protocols with a zero-knowledge version, from the registry (no list of names here).
ZK_PROTOCOLS = zero_knowledge_protocols()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("zk_gi_cache")


def gi_config(cache_dir, *overrides):
    """The graph-isomorphism test config (:func:`tests.test_gi_scenario.gi_config`), zk NIP of four steps."""
    return small_gi_config(cache_dir, "protocol=nip", "protocol.max_rounds=4", "protocol.zero_knowledge=true", *overrides)


# ----------------------------------------------------------------- the agents
def test_zero_knowledge_versions_are_the_protocols_with_provers():
    proof = PROTOCOLS.names(subclass_of=ProofProtocol)
    assert ZK_PROTOCOLS == [name for name in proof if any(a != "verifier" for a in PROTOCOLS.get(name).agent_names)]
    assert len(ZK_PROTOCOLS) >= 5
    assert "solo_verifier" not in ZK_PROTOCOLS


@pytest.mark.parametrize("name", ZK_PROTOCOLS)
def test_two_agents_are_added_and_take_the_verifiers_turns(name):
    cls = PROTOCOLS.get(name)
    plain, zk = cls(name), cls(name, zero_knowledge=True)
    assert zk.agent_names == (*plain.agent_names, ADVERSARIAL_VERIFIER, SIMULATOR)
    assert zk.transcript_agent_names == plain.agent_names == cls.agent_names  # the class is left as it was
    assert not plain.zero_knowledge and zk.zero_knowledge
    verifier, adversary, simulator = zk.verifier_index, zk.adversarial_index, zk.simulator_index
    episodes = 6
    generator = torch.Generator().manual_seed(0)
    state = {"round": torch.arange(episodes) % zk.num_rounds, **zk.initial_state(episodes, generator)}
    state[ADVERSARIAL_KEY] = torch.tensor([True, False] * (episodes // 2))
    plain_state = {key: value for key, value in state.items() if key != ADVERSARIAL_KEY}
    base = plain.active_agents_in(plain_state)
    active = zk.active_agents_in(state)
    adversarial = state[ADVERSARIAL_KEY]
    # The provers keep their turns; the verifier's go to the second verifier and the simulator in its episodes.
    assert torch.equal(active[:, : plain.num_agents][:, plain.prover_indices], base[:, plain.prover_indices])
    assert torch.equal(active[:, verifier], base[:, verifier] & ~adversarial)
    assert torch.equal(active[:, adversary], base[:, verifier] & adversarial)
    assert torch.equal(active[:, simulator], base[:, verifier] & adversarial)
    # Verifier first, provers, then the second verifier, then the simulator.
    order = zk.leader_order
    assert order[0] == ("verifier",) and order[-2:] == ((ADVERSARIAL_VERIFIER,), (SIMULATOR,))
    assert sorted(a for group in order for a in group) == sorted(zk.agent_names)


def test_the_share_of_second_verifier_episodes_is_the_option():
    zk = PROTOCOLS.get("nip")("nip", zero_knowledge=True, zk_adversarial_share=0.25)
    drawn = zk.initial_state(20_000, torch.Generator().manual_seed(1))[ADVERSARIAL_KEY]
    assert drawn.float().mean().item() == pytest.approx(0.25, abs=0.01)


# ----------------------------------------------------------------- the views
def _step(env, td, actions: dict[int, list[int]], logits: torch.Tensor | None = None):
    """Step ``env`` from ``td`` with the given actions per agent (others: 0) and logits (default zeros)."""
    td = td.clone()
    action = torch.zeros(env.num_envs, env.num_agents, dtype=torch.int64)
    for agent, values in actions.items():
        action[:, agent] = torch.tensor(values)
    td["agents", "action"] = action
    td["agents", "logits"] = torch.zeros(env.num_envs, env.num_agents, env.num_actions) if logits is None else logits
    return env.step(td)["next"]


def test_views_the_simulator_sees_only_its_own_messages_and_the_second_verifier_is_the_verifiers_peer(cache_dir):
    scenario = build_scenario(gi_config(cache_dir))
    env = scenario.make_env(2, "train", seed=0, device="cpu")
    protocol = env.protocol
    prover, verifier, adversary, simulator = (protocol.agent_index(a) for a in ("prover", "verifier", ADVERSARIAL_VERIFIER, SIMULATOR))
    n, m, steps = env.max_nodes, env.transcript_agents, env.num_steps
    assert m == 2 and env.num_agents == 4
    # The networks read the transcript of the base protocol's agents, for every agent.
    assert env.observation_spec["agents", "messages"].shape[-1] == steps * m
    td = env.reset()
    td["state", ADVERSARIAL_KEY] = torch.tensor([False, True])  # episode 0 the verifier's, episode 1 the second verifier's
    # Both episodes play one pair, so that views can be compared across them.
    for key in ("adjacency", "node_mask", "label", "pair_index"):
        td["state", key] = td["state", key][:1].expand_as(td["state", key]).clone()
    td["agents", "active"] = protocol.active_agents_in(td["state"])
    assert td["agents", "active"].tolist() == [[False, True, False, False], [False, False, True, True]]
    # Step 0: the verifier (episode 0) and the second verifier (episode 1) query node 0; the simulator sends node 3.
    after_query = _step(env, td, {verifier: [0, 5], adversary: [1, 0], simulator: [2, 3]})
    state = after_query["state"]
    assert state["sent"][:, 0].tolist() == [[-1, 0], [-1, 0]]  # the second verifier's node in the verifier's place
    assert state["simulated"][:, 0].tolist() == [-1, 3]
    messages = after_query["agents", "messages"]
    # The prover cannot tell the second verifier from the verifier; the second verifier sees the verifier's view.
    assert torch.equal(messages[0, prover], messages[1, prover])
    assert torch.equal(messages[1, adversary], messages[0, verifier])
    # The simulator sees its node, as the verifier sees its own, and nothing else.
    seen = messages[1, simulator].nonzero().tolist()
    assert seen == [[0, 3, 0 * m + verifier]]
    # Step 1: the prover answers; what it answers reaches the second verifier, never the simulator.
    answers = [_step(env, after_query, {prover: [n + a, n + a]}) for a in (1, 2)]
    views = [step["agents", "messages"] for step in answers]
    assert not torch.equal(views[0][1, adversary], views[1][1, adversary])
    assert torch.equal(views[0][1, simulator], views[1][1, simulator])
    assert torch.equal(views[0][1, simulator], messages[1, simulator])
    # Nor does the simulator see anything a prover sent in any episode: its view has the verifier's channels alone.
    for view in views:
        channels = view[:, simulator].sum((1, 2)).view(2, steps, m)
        assert channels[..., prover].sum() == 0


def test_a_step_needs_the_policys_logits_when_the_second_verifier_acts(cache_dir):
    scenario = build_scenario(gi_config(cache_dir))
    env = scenario.make_env(2, "train", seed=0, device="cpu")
    td = env.reset()
    td["state", ADVERSARIAL_KEY] = torch.tensor([True, True])
    td["agents", "active"] = env.protocol.active_agents_in(td["state"])
    td["agents", "action"] = torch.zeros(2, env.num_agents, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="logits"):
        env.step(td)


# ----------------------------------------------------------------- the rewards
def test_simulator_distance_is_the_total_variation_over_legal_actions():
    # Agents: 0 = second verifier, 1 = simulator; four actions, the last illegal.
    mask = torch.tensor([[[True, True, True, False]] * 2] * 2)
    logits = torch.tensor(
        [
            [[0.0, 0.0, 0.0, 5.0], [0.0, 0.0, 0.0, -5.0]],  # the same over the legal three: distance 0
            [[2.0, 0.0, 0.0, 0.0], [0.0, 2.0, 0.0, 0.0]],
        ]
    )
    distance = simulator_distance(logits, mask, adversarial_index=0, simulator_index=1)
    e = torch.tensor(2.0).exp().item()
    p = torch.tensor([e, 1.0, 1.0]) / (e + 2)
    q = torch.tensor([1.0, e, 1.0]) / (e + 2)
    assert distance[0].item() == pytest.approx(0.0, abs=1e-7)
    assert distance[1].item() == pytest.approx(0.5 * (p - q).abs().sum().item())


def test_rewards_follow_the_formulas_on_a_hand_made_step():
    # Debate's agents: prover0, prover1, verifier, then the second verifier and the simulator.
    protocol = PROTOCOLS.get("debate")("debate", zero_knowledge=True, zk_simulator_reward=2.0, zk_prover_reward=0.5)
    step = TensorDict(
        {
            "decided": torch.tensor([True, True, False]),
            "accept": torch.tensor([True, True, False]),
            "label": torch.tensor([True, True, True]),
            "adversarial": torch.tensor([False, True, True]),
            "distance": torch.tensor([0.0, 0.4, 0.1]),
        },
        batch_size=[3],
    )
    base = protocol.step_rewards(step["decided"], step["accept"], step["label"], torch.tensor([True, True, True]))
    assert base.tolist()[0] == [1.0, 0.0, 1.0, 0.0, 0.0]  # the added agents get nothing from the decision
    rewards = protocol.zero_knowledge_rewards(base, step["adversarial"], step["distance"])
    assert rewards[0].tolist() == base[0].tolist()  # the verifier's episode: the base rewards
    # The second verifier's episodes: v' gets c_z d, the simulator -c_z d, each prover -c_p d, the verifier 0.
    assert rewards[1].tolist() == pytest.approx([-0.2, -0.2, 0.0, 0.8, -0.8])
    assert rewards[2].tolist() == pytest.approx([-0.05, -0.05, 0.0, 0.2, -0.2])
    # The function the protocol calls, with its arguments spelled out.
    direct = zero_knowledge_rewards(base, step["adversarial"], step["distance"], 3, 4, [0, 1], 2.0, 0.5)
    assert torch.equal(direct, rewards)


def test_environment_step_rewards_the_distance_of_the_policies(cache_dir):
    scenario = build_scenario(gi_config(cache_dir, "protocol.zk_simulator_reward=3.0", "protocol.zk_prover_reward=0.5"))
    env = scenario.make_env(2, "train", seed=0, device="cpu")
    protocol = env.protocol
    adversary, simulator = protocol.adversarial_index, protocol.simulator_index
    td = env.reset()
    td["state", ADVERSARIAL_KEY] = torch.tensor([False, True])
    td["agents", "active"] = protocol.active_agents_in(td["state"])
    legal = td["agents", "action_mask"][1, adversary]
    assert torch.equal(legal, td["agents", "action_mask"][1, simulator])  # both choose among the verifier's actions
    logits = torch.zeros(2, env.num_agents, env.num_actions)
    logits[:, adversary] = -1e4
    logits[:, adversary, 0] = 0.0  # the second verifier sends node 0; the simulator is uniform over the legal actions
    nxt = _step(env, td, {protocol.verifier_index: [0, 0], adversary: [0, 0], simulator: [0, 0]}, logits)
    distance = 1 - 1 / legal.sum().item()
    reward = nxt["agents", "reward"].squeeze(-1)
    assert reward[0].tolist() == [0.0, 0.0, 0.0, 0.0]  # the verifier let the turn pass; no zero-knowledge reward
    assert reward[1].tolist() == pytest.approx([-0.5 * distance, 0.0, 3.0 * distance, -3.0 * distance], abs=1e-5)
    assert nxt["state", "zk_distance"].tolist() == pytest.approx([0.0, distance], abs=1e-5)
    assert nxt["state", "zk_turns"].tolist() == [0, 1]


def test_zero_knowledge_metrics_closed_form():
    state = TensorDict(
        {
            ADVERSARIAL_KEY: torch.tensor([True, False, True]),
            "zk_distance": torch.tensor([0.6, 0.0, 0.2]),
            "zk_turns": torch.tensor([2, 0, 1]),
        },
        batch_size=[3],
    )
    metrics = zero_knowledge_metrics(state)
    assert metrics["zero_knowledge/simulator_distance"] == pytest.approx((0.3 + 0.2) / 2)
    assert metrics["zero_knowledge/adversarial_share"] == pytest.approx(2 / 3)


# ----------------------------------------------------------------- training
@pytest.mark.slow  # about a second or more: the fast tier keeps tests under ~0.8 s
def test_zk_nip_trains_on_graph_isomorphism_under_ppo(tmp_path, cache_dir, run_probe):
    metrics = run_experiment(gi_config(cache_dir, "logger=csv"), tmp_path)
    assert run_probe.changed() == {"prover", "verifier", ADVERSARIAL_VERIFIER, SIMULATOR}  # PPO updated every agent
    distance = metrics["test/zero_knowledge/simulator_distance"]
    assert 0.0 < distance < 1.0
    assert 0.0 < metrics["test/zero_knowledge/adversarial_share"] < 1.0
    # The second verifier's and the simulator's returns are opposite: c_z times the summed distances.
    adversary = metrics["test/agents/adversarial_verifier/reward"]
    assert adversary > 0 and metrics["test/agents/simulator/reward"] == pytest.approx(-adversary)
    assert 0.0 <= metrics["test/accuracy"] <= 1.0
    assert [step for step, _ in read_csv_metric(tmp_path, "eval/zero_knowledge/simulator_distance")] == [2, 3]


# ----------------------------------------------------------------- bad inputs
BAD = [
    ("scenario=graph_isomorphism protocol=solo_verifier protocol.zero_knowledge=true", "protocol solo_verifier cannot be made zero-knowledge"),
    ("scenario=graph_isomorphism protocol=solo_opening protocol.zero_knowledge=true", "protocol solo_opening cannot be made zero-knowledge"),
    ("protocol.zero_knowledge=true", "protocol prover_verifier cannot be made zero-knowledge"),
    ("scenario=matrix_game protocol=matrix_game protocol.zero_knowledge=true", "protocol matrix_game cannot be made zero-knowledge"),
    ("scenario=duplicates protocol=nip protocol.zero_knowledge=true", "scenario duplicates cannot play a zero-knowledge protocol"),
    ("scenario=graph_isomorphism protocol=nip protocol.zk_prover_reward=2", "protocol.zk_prover_reward is set but protocol.zero_knowledge is false"),
]


@pytest.mark.parametrize("overrides, fragment", BAD, ids=[overrides for overrides, _ in BAD])
def test_a_zero_knowledge_request_that_cannot_be_met_is_one_line_exit_2(tmp_path, cache_dir, capsys, overrides, fragment):
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info, report_errors():
        build_trainer(smoke_config(*overrides.split(), f"scenario.cache_dir={cache_dir}" if "graph" in overrides else "seed=0"), tmp_path / "run")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert fragment in err, err
    if "cannot" in fragment:  # the message names what can
        able = [name for name in SCENARIOS.names() if SCENARIOS.get(name).supports_zero_knowledge]
        assert str(ZK_PROTOCOLS) in err or str(able) in err, err
    assert not (tmp_path / "run").exists()  # before any work


class Interrupted(Exception):
    """Stops a run mid-way."""


@pytest.mark.slow
def test_an_interrupted_zk_run_resumes_to_the_same_final_metrics(tmp_path, cache_dir, monkeypatch):
    # The episodes' zero-knowledge state (who plays, the simulator's messages, the distances) resumes exactly.
    overrides = ("trainer.num_iterations=4", "run.checkpoint_every=1", "logger=csv", "trainer.eval.every=3")
    reference = run_experiment(gi_config(cache_dir, *overrides), tmp_path / "reference")
    stop_at(monkeypatch, 3, Interrupted)
    with pytest.raises(Interrupted):
        run_experiment(gi_config(cache_dir, *overrides), tmp_path / "resumed")
    monkeypatch.undo()
    resumed = run_experiment(gi_config(cache_dir, *overrides), tmp_path / "resumed", resume=True)
    assert resumed == reference
    assert "test/zero_knowledge/simulator_distance" in resumed
