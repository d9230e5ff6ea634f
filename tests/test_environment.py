"""The environment base and the hidden-bits game on hand-built cases."""

import pytest
import torch
from omegaconf import OmegaConf
from tensordict import TensorDict
from torchrl.envs.utils import check_env_specs

from nip_like.errors import ConfigError
from nip_like.protocols import ProverVerifierProtocol, SoloVerifierProtocol
from nip_like.scenarios.hidden_bits import HiddenBitsScenario
from nip_like.scenarios.hidden_bits.scenario import HiddenBitsConfig


def make_scenario(protocol="prover_verifier", **scenario_fields):
    if protocol == "prover_verifier":
        proto = ProverVerifierProtocol()
    else:
        proto = SoloVerifierProtocol("solo_verifier")
    return HiddenBitsScenario(OmegaConf.structured(HiddenBitsConfig(**scenario_fields)), proto)


@pytest.mark.parametrize("protocol", ["prover_verifier", "solo_verifier"])
def test_env_specs_are_clean(protocol):
    env = make_scenario(protocol).make_env(5, "train", 0, "cpu")
    check_env_specs(env)


def test_turn_order():
    protocol = make_scenario().protocol
    active = protocol.active_agents(torch.arange(3))
    # prover, verifier: the prover speaks in rounds 0 and 1, the verifier decides in round 2.
    assert active.tolist() == [[True, False], [True, False], [False, True]]


def step(env, td, prover, verifier):
    td["agents", "action"] = torch.tensor([[prover, verifier]] * env.num_envs)
    out = env.step(td)
    return out, out["next"].clone()


def test_messages_rewards_and_done_on_a_hand_built_episode():
    env = make_scenario(num_bits=2, message_vocab=2).make_env(1, "train", 0, "cpu")
    td = env.reset()
    td["state", "bits"] = torch.tensor([[1, 0]])
    _, nxt = step(env, td, prover=1, verifier=3)
    assert nxt["state", "messages"].tolist() == [[1, 0]]
    assert nxt["agents", "reward"].sum() == 0 and not nxt["done"].any()
    _, nxt = step(env, nxt, prover=0, verifier=3)
    assert nxt["state", "messages"].tolist() == [[1, 0]]
    # The verifier sees the messages but not the bits; the prover sees both.
    observation = nxt["agents", "observation"][0]
    assert observation[0, :2].tolist() == [1.0, 0.0]
    assert observation[1, :2].tolist() == [0.0, 0.0]
    assert torch.equal(observation[0, 2:], observation[1, 2:])
    # Decision round: "10" is answer 2; the verifier's action in earlier rounds was ignored.
    _, nxt = step(env, nxt, prover=1, verifier=2)
    assert nxt["agents", "reward"].squeeze(-1).tolist() == [[1.0, 1.0]]
    assert nxt["done"].all() and nxt["agents", "done"].all()
    assert nxt["agents", "episode_return"].squeeze(-1).tolist() == [[1.0, 1.0]]


def test_wrong_answer_gets_nothing_and_unshared_prover_reward():
    scenario = HiddenBitsScenario(OmegaConf.structured(HiddenBitsConfig()), ProverVerifierProtocol(shared_reward=False))
    env = scenario.make_env(2, "train", 0, "cpu")
    td = env.reset()
    td["state", "bits"] = torch.tensor([[1, 1], [0, 1]])
    for _ in range(2):
        _, td = step(env, td, prover=0, verifier=0)
    td["agents", "action"] = torch.tensor([[0, 3], [0, 3]])
    reward = env.step(td)["next", "agents", "reward"].squeeze(-1)
    assert reward.tolist() == [[0.0, 1.0], [0.0, 0.0]]


def test_action_masks_follow_vocabulary_and_answers():
    env = make_scenario(num_bits=3, message_vocab=2).make_env(1, "train", 0, "cpu")
    mask = env.reset()["agents", "action_mask"][0]
    assert mask[0].tolist() == [True, True] + [False] * 6
    assert mask[1].all()


def test_partial_reset_keeps_running_episodes():
    env = make_scenario().make_env(3, "train", 0, "cpu")
    td = env.reset()
    td["agents", "action"] = torch.zeros(3, 2, dtype=torch.long)
    td = env.step(td)["next"]
    before = td["state"].clone()
    td["_reset"] = torch.tensor([[True], [False], [False]])
    after = env.reset(td)
    assert after["state", "round"].tolist() == [0, 1, 1]
    assert torch.equal(after["state", "bits"][1:], before["bits"][1:])


def test_solo_verifier_decides_at_once_and_optimum():
    scenario = make_scenario("solo_verifier", num_bits=2)
    assert scenario.optimal_rewards() == {"verifier": 0.25}
    env = scenario.make_env(4, "train", 0, "cpu")
    td = env.reset()
    td["agents", "action"] = torch.zeros(4, 1, dtype=torch.long)
    assert env.step(td)["next", "done"].all()


def test_unshared_reward_leaves_the_prover_no_optimum():
    scenario = HiddenBitsScenario(OmegaConf.structured(HiddenBitsConfig()), ProverVerifierProtocol(shared_reward=False))
    assert scenario.optimal_rewards() == {"prover": 0.0, "verifier": 1.0}


def test_optimum_is_capped_by_channel_capacity():
    assert make_scenario(num_bits=2, message_vocab=2).optimal_rewards()["verifier"] == 1.0
    assert make_scenario(num_bits=3, message_vocab=2).optimal_rewards()["verifier"] == 0.5


def test_scenario_rejects_bad_settings():
    with pytest.raises(ConfigError, match="message_vocab"):
        make_scenario(message_vocab=1)
    with pytest.raises(ConfigError, match="agents names"):
        make_scenario(agents={"judge": {"hidden_size": 8}})
    with pytest.raises(ConfigError, match="scenario.agents.prover"):
        make_scenario(agents={"prover": {"width": 8}}).make_agents()


def test_same_seed_same_episodes():
    first = make_scenario().make_env(8, "train", 7, "cpu").reset()["state", "bits"]
    second = make_scenario().make_env(8, "train", 7, "cpu").reset()["state", "bits"]
    assert torch.equal(first, second)


def test_grouped_rollouts_share_datapoints_and_group_ids():
    env = make_scenario(num_bits=8).make_env(12, "train", 3, "cpu", group_size=4)
    check_env_specs(env)
    state = env.reset()["state"]
    bits, ids = state["bits"].view(3, 4, -1), state["group_id"].view(3, 4)
    assert all(torch.equal(bits[g, k], bits[g, 0]) for g in range(3) for k in range(4))
    assert (ids == ids[:, :1]).all() and ids[:, 0].unique().numel() == 3
    # Resetting a whole block gives it a new shared datapoint; a lone member starts a group of one.
    td = env.reset()
    td["_reset"] = torch.tensor([True] * 4 + [True] + [False] * 7).unsqueeze(-1)
    after = env.reset(td)["state"]
    assert (after["group_id"][:4] == after["group_id"][0]).all()
    assert after["group_id"][4] not in after["group_id"][5:8].tolist() + after["group_id"][:4].tolist()
    assert torch.equal(after["bits"][5:], td["state", "bits"][5:])


def test_group_size_must_divide_the_number_of_envs():
    with pytest.raises(ConfigError, match="multiple of the group size"):
        make_scenario().make_env(10, "train", 0, "cpu", group_size=4)
