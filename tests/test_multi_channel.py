"""multi_channel_test: the NIP reference's channel test, rebuilt.

The reference's test (``tests/test_agents.py::test_channel_visibility``) gives
every agent a body that checks that the message history it receives holds
exactly the channels the agent is in, under its ``multi_channel_test``
protocol. Here every agent sends a patch at every step it acts, and each
agent's ``("agents", "messages")`` input must hold exactly the messages of the
channels it is in: those of the (step, sender) pairs that the reference's
tables, written out below, let it read. The policy then runs on those inputs.
"""

import pytest
import torch

from nip_like.errors import ConfigError
from nip_like.experiment import build_trainer, run_experiment
from nip_like.validation import build_scenario
from nip_like.protocols.multi_channel import MultiChannelTestProtocol, message_visibility
from nip_like.registry import PROTOCOLS
from nip_like.scenarios.image_classification.environment import ImageClassificationEnv
from tests.conftest import smoke_config

#: The reference's tables, as it writes them: channels, who is in which, and who speaks when in each.
CHANNEL_NAMES = ["main", "prover0_verifier", "prover_chat"]
AGENT_CHANNEL_VISIBILITY = [
    ("prover0", "main"),
    ("prover1", "main"),
    ("prover2", "main"),
    ("verifier", "main"),
    ("prover0", "prover0_verifier"),
    ("verifier", "prover0_verifier"),
    ("prover0", "prover_chat"),
    ("prover1", "prover_chat"),
    ("prover2", "prover_chat"),
]


def reference_is_agent_active(agent_name: str, round_id: int, channel_name: str) -> bool:
    """The reference's ``MultiChannelTestProtocol.is_agent_active``."""
    if channel_name == "main":
        return agent_name == ("prover1", "prover2", "verifier")[round_id % 3]
    if channel_name == "prover0_verifier":
        return round_id % 3 != 0 and agent_name == ("prover0", "verifier")[round_id % 3 - 1]
    return agent_name == ("prover0", "prover1", "prover2")[round_id % 3]


def reference_reads(reader: str, sender: str, round_id: int) -> bool:
    """Whether ``reader`` sees what ``sender`` says at ``round_id``: they share a channel ``sender`` speaks in then."""
    return any(
        reference_is_agent_active(sender, round_id, channel)
        and (reader, channel) in AGENT_CHANNEL_VISIBILITY
        and (sender, channel) in AGENT_CHANNEL_VISIBILITY
        for channel in CHANNEL_NAMES
    )


def make_protocol(**options) -> MultiChannelTestProtocol:
    return PROTOCOLS.get("multi_channel_test")("multi_channel_test", **options)


def test_the_schedule_is_the_references():
    protocol = make_protocol()
    agents = protocol.agent_names
    assert agents == ("prover0", "prover1", "prover2", "verifier")
    # The reference's limits (2 and 8): the verifier's last turn within 8 steps is step 5.
    assert protocol.num_rounds == 6
    active = protocol.active_agents(torch.arange(protocol.num_rounds))
    for step in range(protocol.num_rounds):
        expected = [any(reference_is_agent_active(a, step, c) for c in CHANNEL_NAMES) for a in agents]
        assert active[step].tolist() == expected, step
    assert protocol.may_decide(torch.arange(6)).tolist() == [False, False, True, False, False, True]
    assert make_protocol(min_rounds=4).may_decide(torch.arange(6)).tolist() == [False] * 5 + [True]
    assert make_protocol(max_rounds=9).num_rounds == 9
    assert protocol.leader_order == (("verifier",), ("prover0", "prover1", "prover2"))
    assert protocol.channels_of("prover0") == CHANNEL_NAMES and protocol.channels_of("verifier") == CHANNEL_NAMES[:2]


def test_only_the_verifier_is_rewarded():
    protocol = make_protocol(verifier_incorrect_penalty=0.5)
    decided = torch.tensor([True, True, False])
    accept = torch.tensor([True, True, False])
    label = torch.tensor([True, False, True])
    rewards = protocol.step_rewards(decided, accept, label, torch.tensor([True, True, True]))
    assert rewards.tolist() == [[0, 0, 0, 1], [0, 0, 0, -0.5], [0, 0, 0, 0]]
    shared = make_protocol(shared_reward=True).step_rewards(decided, accept, label, torch.ones(3, dtype=torch.bool))
    assert shared.tolist() == [[1.0] * 4, [0.0] * 4, [0.0] * 4]


def test_the_visibility_of_each_step_is_the_references():
    protocol = make_protocol()
    visibility = message_visibility(protocol)
    agents = protocol.agent_names
    for step in range(protocol.num_rounds):
        for i, reader in enumerate(agents):
            for j, sender in enumerate(agents):
                assert bool(visibility[step, i, j]) == reference_reads(reader, sender, step), (step, reader, sender)
    # prover0 speaks to the provers at steps 0, 3 and to the verifier at 1, 4.
    assert visibility[:, 3, 0].tolist() == [False, True, False, False, True, False]
    assert visibility[:, 1, 0].tolist() == [True, False, False, True, False, False]
    # A proof protocol's audiences are the same at every step.
    mnip = PROTOCOLS.get("mnip")("mnip", max_rounds=4)
    assert torch.equal(message_visibility(mnip), mnip.visibility().expand(mnip.num_rounds, -1, -1))


def test_each_agent_receives_exactly_the_channels_it_is_in(tmp_path):
    """The reference's test_channel_visibility: each agent's input holds its channels' messages and no others."""
    config = smoke_config(
        "scenario=image_classification", "protocol=multi_channel_test", f"scenario.cache_dir={tmp_path}",
        "scenario.max_images=40", "scenario.default_agent.channels=4", "scenario.default_agent.head_size=8",
    )
    trainer = build_trainer(config, tmp_path / "run")
    env: ImageClassificationEnv = trainer.scenario.make_env(5, "train", 0, "cpu")
    protocol, agents = env.protocol, env.protocol.agent_names
    steps, count = protocol.num_rounds, len(agents)
    # Every agent sends patch 7 * step + agent at every step it acts: each message is told apart by its patch.
    sent = torch.full((5, steps, count), -1)
    active = protocol.active_agents(torch.arange(steps))
    for step in range(steps):
        for agent in range(count):
            if active[step, agent]:
                sent[:, step, agent] = 7 * step + agent
    state = env.new_state(torch.arange(5))
    state["round"] = torch.full((5,), steps - 1)
    state["sent"] = sent
    messages = env._observe_extra(state)["messages"]  # (B, N, T*M, G_h, G_w)
    for i, reader in enumerate(agents):
        received = messages[0, i].flatten(1).sum(-1).view(steps, count) > 0
        expected = torch.tensor(
            [[bool(active[t, j]) and reference_reads(reader, sender, t) for j, sender in enumerate(agents)] for t in range(steps)]
        )
        assert torch.equal(received, expected), f"agent {reader!r} does not receive the channels it is in"
        # And each message it receives is the one sent: its own patch, nowhere else.
        for t, j in expected.nonzero().tolist():
            assert messages[0, i, t * count + j].flatten().nonzero().flatten().tolist() == [7 * t + j]
        # The verifier's pixels are those of the patches it read.
        if reader == "verifier":
            visible = env._observe_extra(state)["visible"][0, i].flatten()
            assert visible.nonzero().flatten().tolist() == sorted(7 * t + j for t, j in expected.nonzero().tolist())
    # The agents' networks take those inputs (the reference runs its combined body on them).
    tensordict = env.reset()
    tensordict["state"] = state.clone()
    tensordict["agents"].update(env._observe_extra(state))
    tensordict["agents", "active"] = torch.ones(5, count, dtype=torch.bool)  # every agent's network runs
    with torch.no_grad():
        out = trainer.policy(tensordict.clone())
    assert out["agents", "logits"].shape == (5, count, env.num_actions)


def test_ppo_trains_on_it(tmp_path, run_probe):
    config = smoke_config(
        "scenario=image_classification", "protocol=multi_channel_test", f"scenario.cache_dir={tmp_path}",
        "scenario.max_images=100", "scenario.default_agent.channels=4", "scenario.default_agent.head_size=8",
        "trainer.num_iterations=1", "trainer.eval.every=0", "trainer.num_test_episodes=16", "trainer.test_batch_episodes=16",
    )
    metrics = run_experiment(config, tmp_path / "run")
    assert run_probe.changed() == {"prover0", "prover1", "prover2", "verifier"}
    assert 3.0 <= metrics["test/episode_length"] <= 6.0  # the verifier decides at step 2 or 5
    assert metrics["test/agents/prover0/reward"] == 0.0


def test_scenarios_that_read_one_visibility_per_sender_refuse_it(tmp_path):
    with pytest.raises(ConfigError, match="needs an interactive-proof protocol .*got 'multi_channel_test'"):
        build_scenario(smoke_config("scenario=graph_isomorphism", "protocol=multi_channel_test", f"scenario.cache_dir={tmp_path}"))
    assert not MultiChannelTestProtocol.has_zero_knowledge_version()
    with pytest.raises(Exception, match="zero_knowledge"):
        smoke_config("scenario=image_classification", "protocol=multi_channel_test", "protocol.zero_knowledge=true")
    with pytest.raises(ConfigError, match="protocol.min_rounds must be between 1 and the episode length 6, got 7"):
        make_protocol(min_rounds=7)
