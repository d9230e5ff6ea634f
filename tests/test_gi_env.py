"""Graph-isomorphism protocols and environment on hand-built graphs: turns, visibility, rewards, masks."""

import pytest
import torch
from omegaconf import OmegaConf
from tensordict import TensorDict
from torchrl.envs.utils import check_env_specs

from nip_like.protocols.proof import FixedTurnsProofProtocol
from nip_like.errors import ConfigError
from nip_like.protocols.proofs import (
    AdpProtocol,
    DebateProtocol,
    MerlinArthurProtocol,
    MnipProtocol,
    NipProtocol,
    SoloVerifierProtocol,
)
from nip_like.scenarios.graph_isomorphism.agents import GraphAgentConfig, build_graph_agents
from nip_like.scenarios.graph_isomorphism.environment import GraphIsomorphismEnv

PROTOCOLS = {
    "nip": NipProtocol,
    "adp": AdpProtocol,
    "debate": DebateProtocol,
    "mnip": MnipProtocol,
    "merlin_arthur": MerlinArthurProtocol,
    "solo_verifier": SoloVerifierProtocol,
}
N = 4  # nodes per graph in the hand-built data


def protocol(name, **fields):
    return PROTOCOLS[name](name, **fields)


def graphs():
    """Pair 0: a 4-path and a relabelled 4-path (isomorphic). Pair 1: a 3-path and a triangle (3 nodes)."""
    adjacency = torch.zeros(2, 2, N, N, dtype=torch.bool)
    for g, edges in enumerate([[(0, 1), (1, 2), (2, 3)], [(2, 0), (0, 3), (3, 1)]]):
        for u, v in edges:
            adjacency[0, g, u, v] = adjacency[0, g, v, u] = True
    for g, edges in enumerate([[(0, 1), (1, 2)], [(0, 1), (1, 2), (0, 2)]]):
        for u, v in edges:
            adjacency[1, g, u, v] = adjacency[1, g, v, u] = True
    node_mask = torch.ones(2, 2, N, dtype=torch.bool)
    node_mask[1, :, 3] = False
    return adjacency, node_mask, torch.tensor([True, False])


def make_env(proto, num_envs=2):
    env = GraphIsomorphismEnv(proto, *graphs(), num_envs=num_envs)
    return env


def play(env, td, actions):
    """Step with ``actions`` (one list per agent, same for every episode); return the next root."""
    td = td.clone()
    td["agents", "action"] = torch.tensor(actions).expand(env.num_envs, -1).clone()
    return env.step(td)["next"]


@pytest.mark.parametrize("name", PROTOCOLS)
def test_every_protocol_passes_check_env_specs(name):
    fixed = issubclass(PROTOCOLS[name], FixedTurnsProofProtocol)
    env = make_env(protocol(name) if fixed else protocol(name, max_rounds=6))
    check_env_specs(env)


@pytest.mark.parametrize("name", ["debate", "mnip"])
def test_sequential_provers_play_legal_episodes(name):
    env = make_env(protocol(name, max_rounds=7, sequential=True))
    check_env_specs(env)
    rollout = env.rollout(7, break_when_any_done=False)
    assert rollout.batch_size[-1] == 7


def test_turn_orders():
    def pattern(proto, steps):
        return proto.active_agents(torch.arange(steps)).int().tolist()

    # Agents: (prover, verifier).
    assert pattern(protocol("nip", max_rounds=5), 4) == [[0, 1], [1, 0], [0, 1], [1, 0]]
    assert pattern(protocol("nip", max_rounds=5, first_speaker="prover"), 2) == [[1, 0], [0, 1]]
    assert pattern(protocol("adp"), 2) == [[1, 0], [0, 1]]
    # Agents: (prover0, prover1, verifier); the two provers answer together.
    assert pattern(protocol("debate", max_rounds=4), 3) == [[0, 0, 1], [1, 1, 0], [0, 0, 1]]
    assert pattern(protocol("mnip", max_rounds=4), 2) == [[0, 0, 1], [1, 1, 0]]
    # Sequential provers (the NIP paper's option): one step each, prover0 first unless told otherwise.
    assert pattern(protocol("debate", max_rounds=7, sequential=True), 4) == [[0, 0, 1], [1, 0, 0], [0, 1, 0], [0, 0, 1]]
    assert pattern(protocol("mnip", max_rounds=7, sequential=True, prover0_first=False), 3) == [
        [0, 0, 1], [0, 1, 0], [1, 0, 0]
    ]
    assert protocol("debate", max_rounds=7, sequential=True).num_rounds == 7
    assert protocol("debate", max_rounds=7, sequential=True, first_speaker="prover").num_rounds == 6
    # Episodes end on the verifier's last turn within max_rounds.
    assert protocol("nip", max_rounds=6).num_rounds == 5
    assert protocol("nip", max_rounds=6, first_speaker="prover").num_rounds == 6
    assert protocol("adp").num_rounds == 2 and protocol("merlin_arthur").num_rounds == 2
    assert protocol("solo_verifier").num_rounds == 1


def test_merlin_arthur_draws_one_speaker_per_episode():
    env = make_env(protocol("merlin_arthur"), num_envs=64)
    td = env.reset()
    active = td["agents", "active"]
    speaker = td["state", "speaker"]
    assert (active[:, 2] == False).all()  # noqa: E712 - the provers speak first
    assert (active[:, 0] == (speaker == 0)).all() and (active[:, 1] == (speaker == 1)).all()
    assert 0 < int(speaker.sum()) < 64


def test_bad_round_settings_are_config_errors():
    with pytest.raises(ConfigError, match="min_rounds"):
        protocol("nip", min_rounds=7, max_rounds=5)
    with pytest.raises(ConfigError, match="first_speaker"):
        protocol("nip", first_speaker="judge")
    with pytest.raises(ConfigError, match="leaves the verifier no turn"):
        protocol("nip", max_rounds=1, first_speaker="prover")
    with pytest.raises(ConfigError, match=r"protocol.prover0_first is false but protocol.sequential is false"):
        protocol("debate", prover0_first=False)


def test_action_masks_follow_nodes_and_decision_rules():
    env = make_env(protocol("nip", min_rounds=3, max_rounds=5))
    env = GraphIsomorphismEnv(env.protocol, *graphs(), num_envs=16)
    td = env.reset()
    mask = td["agents", "action_mask"]
    # Step 0 (verifier's turn, before min_rounds): the existing nodes only (pair 1 has no node 3).
    nodes = td["state", "node_mask"].reshape(16, 2 * N)
    assert (mask[:, 1, : 2 * N] == nodes).all() and not mask[:, 1, 2 * N :].any()
    assert (td["state", "pair_index"] == 1).any() and not nodes[td["state", "pair_index"] == 1][:, N - 1].any()
    # Decisions are never the prover's.
    assert not mask[:, 0, 8:].any()
    nxt = play(env, td, [0, 0])
    nxt = play(env, nxt, [1, 0])
    # Step 2: the verifier may decide (min_rounds = 3), and still send nodes.
    assert nxt["agents", "action_mask"][0, 1, -2:].all() and nxt["agents", "action_mask"][0, 1, :8].any()
    nxt = play(env, nxt, [0, 2])
    nxt = play(env, nxt, [3, 0])
    # Step 4 is the verifier's last turn: it must decide.
    assert nxt["agents", "action_mask"][0, 1].tolist() == [False] * 8 + [True, True]


@pytest.mark.parametrize("answers_other_graph", [True, False])
def test_prover_answers_in_the_other_graph_of_the_verifiers_last_node(answers_other_graph):
    proto = protocol("nip", min_rounds=3, max_rounds=8)
    env = GraphIsomorphismEnv(proto, *graphs(), num_envs=16, prover_answers_other_graph=answers_other_graph)
    td = env.reset()
    nodes = td["state", "node_mask"].reshape(16, 2 * N)
    graph1 = torch.arange(2 * N) >= N
    # The verifier sends node 1 of graph 0: the prover may answer only in graph 1.
    nxt = play(env, td, [0, 1])
    prover = nxt["agents", "action_mask"][:, 0, : 2 * N]
    assert (prover == (nodes & graph1 if answers_other_graph else nodes)).all()
    # The prover answers; the verifier sends node 0 of graph 1: the answer must be in graph 0.
    nxt = play(env, play(env, nxt, [N, 0]), [0, N])
    prover = nxt["agents", "action_mask"][:, 0, : 2 * N]
    assert (prover == (nodes & ~graph1 if answers_other_graph else nodes)).all()
    # With the prover speaking first there is no verifier node yet: no restriction.
    first = protocol("nip", min_rounds=3, max_rounds=8, first_speaker="prover")
    env = GraphIsomorphismEnv(first, *graphs(), num_envs=16, prover_answers_other_graph=answers_other_graph)
    td = env.reset()
    assert (td["agents", "action_mask"][:, 0, : 2 * N] == td["state", "node_mask"].reshape(16, 2 * N)).all()


def test_messages_are_recorded_and_private_channels_stay_private():
    env = make_env(protocol("mnip", max_rounds=4))
    td = env.reset()
    # Step 0: the verifier sends node 1 of graph 1 (action N + 1).
    nxt = play(env, td, [0, 0, N + 1])
    # Step 1: prover0 sends node 2 of graph 0, prover1 node 3 of graph 1.
    nxt = play(env, nxt, [2, N + 3, 0])
    messages = nxt["agents", "messages"]  # (B, agents, 2, n, steps * agents)
    steps, agents = env.num_steps, 3
    assert messages.shape == (2, agents, 2, N, steps * agents)

    def seen(agent, graph, node, step, sender):
        return messages[0, agent, graph, node, step * agents + sender].item()

    for agent in range(3):
        assert seen(agent, 1, 1, 0, 2) == 1  # everyone hears the verifier
    assert seen(2, 0, 2, 1, 0) == 1 and seen(2, 1, 3, 1, 1) == 1  # the verifier hears both provers
    assert seen(0, 0, 2, 1, 0) == 1 and seen(0, 1, 3, 1, 1) == 0  # prover0 does not hear prover1
    assert seen(1, 0, 2, 1, 0) == 0 and seen(1, 1, 3, 1, 1) == 1
    assert messages[0].sum() == 3 + 2 + 2  # nothing else was recorded
    assert nxt["state", "sent"][0, :2].tolist() == [[-1, -1, N + 1], [2, N + 3, -1]]

    # Debate: all messages public.
    env = make_env(protocol("debate", max_rounds=4))
    nxt = play(env, play(env, env.reset(), [0, 0, 1]), [2, N + 3, 0])
    assert nxt["agents", "messages"][0, 0, 1, 3, 1 * agents + 1] == 1


@pytest.mark.parametrize(
    "name, shared, decision, label, expected",
    [
        # nip: (prover, verifier). The prover wants acceptance.
        ("nip", False, "accept", True, [1.0, 1.0]),
        ("nip", False, "accept", False, [1.0, -0.5]),
        ("nip", False, "reject", False, [0.0, 1.0]),
        ("nip", True, "accept", False, [-0.5, -0.5]),
        # debate: (prover0 for accept, prover1 for reject, verifier).
        ("debate", False, "reject", True, [0.0, 1.0, -0.5]),
        ("debate", False, "accept", True, [1.0, 0.0, 1.0]),
        # mnip: both provers want acceptance.
        ("mnip", False, "reject", False, [0.0, 0.0, 1.0]),
    ],
)
def test_decision_rewards(name, shared, decision, label, expected):
    proto = protocol(name, shared_reward=shared, verifier_incorrect_penalty=0.5, verifier_continue_reward=-0.1)
    decided = torch.tensor([True])
    accept = torch.tensor([decision == "accept"])
    rewards = proto.step_rewards(decided, accept, torch.tensor([label]), verifier_acted=torch.tensor([True]))
    assert rewards[0].tolist() == pytest.approx(expected)
    # A verifier turn without a decision costs the continue reward; a prover turn costs nothing.
    idle = proto.step_rewards(torch.tensor([False, False]), torch.tensor([False, False]), torch.tensor([True, True]),
                              verifier_acted=torch.tensor([True, False]))
    verifier = proto.verifier_index
    assert idle[0, verifier].item() == pytest.approx(-0.1) and idle[1, verifier].item() == 0.0


def test_episode_ends_when_the_verifier_decides():
    env = make_env(protocol("nip", max_rounds=7))
    td = env.reset()
    td["state", "label"] = torch.tensor([True, False])
    nxt = play(env, td, [0, env.accept_action])
    assert nxt["done"].squeeze(-1).tolist() == [True, True]
    assert nxt["state", "decision"].tolist() == [1, 1]
    # Verifier right on the isomorphic pair only; the prover is paid for acceptance on both.
    assert nxt["agents", "reward"].squeeze(-1).tolist() == [[1.0, 1.0], [1.0, 0.0]]


@pytest.mark.parametrize("shared_body", [False, True])
def test_graph_agents_act_legally_for_any_batch_shape(shared_body):
    proto = protocol("debate", max_rounds=4)
    env = make_env(proto, num_envs=4)
    sizes = {name: OmegaConf.structured(GraphAgentConfig(hidden_size=16, shared_body=shared_body)) for name in proto.agent_names}
    agents = build_graph_agents(
        proto.agent_names, N, env.num_steps * 3, env.num_steps + 1, sizes, verifier=proto.verifier_index
    )
    rollout = env.rollout(6, agents.policy, break_when_any_done=False)
    chosen = rollout["agents", "action"]
    legal = rollout["agents", "action_mask"].gather(-1, chosen.unsqueeze(-1)).squeeze(-1)
    assert legal.all()
    values = agents.value(rollout.clone())["agents", "state_value"]
    assert values.shape == (4, 6, 3, 1)
    names = list(agents.agent_parameters("verifier"))
    assert len(names) == len({id(p) for p in names})  # a shared body is counted once
    flat = agents.value(rollout.reshape(-1).clone())["agents", "state_value"]
    torch.testing.assert_close(flat.reshape(values.shape), values)


def test_agents_see_only_their_own_observation_slices():
    # Changing what prover1 sees must not change prover0's logits.
    proto = protocol("mnip", max_rounds=4)
    env = make_env(proto)
    sizes = {name: OmegaConf.structured(GraphAgentConfig(hidden_size=16)) for name in proto.agent_names}
    agents = build_graph_agents(
        proto.agent_names, N, env.num_steps * 3, env.num_steps + 1, sizes, verifier=proto.verifier_index
    )
    td = env.reset()
    td["agents", "active"] = torch.ones_like(td["agents", "active"])  # compute every agent's logits
    before = agents.policy.get_dist_params(td.clone())["agents", "logits"]
    changed = td.clone()
    changed["agents", "messages"][:, 1] = 1.0
    after = agents.policy.get_dist_params(changed)["agents", "logits"]
    torch.testing.assert_close(after[:, 0], before[:, 0])
    assert not torch.allclose(after[:, 1], before[:, 1])
    assert isinstance(td, TensorDict)


def test_policy_runs_each_agent_only_where_it_acts():
    # The policy computes an agent's logits only on the steps where it acts; there
    # they equal the logits computed for every agent, elsewhere they are zero.
    proto = protocol("mnip", max_rounds=6)
    env = make_env(proto, num_envs=4)
    sizes = {name: OmegaConf.structured(GraphAgentConfig(hidden_size=16)) for name in proto.agent_names}
    agents = build_graph_agents(
        proto.agent_names, N, env.num_steps * 3, env.num_steps + 1, sizes, verifier=proto.verifier_index
    )
    rollout = env.rollout(5, agents.policy, break_when_any_done=False)
    active = rollout["agents", "active"]
    assert active.any() and not active.all()
    logits = agents.policy.get_dist_params(rollout.clone())["agents", "logits"]
    everyone = rollout.clone()
    everyone["agents", "active"] = torch.ones_like(active)
    full = agents.policy.get_dist_params(everyone)["agents", "logits"]
    torch.testing.assert_close(logits[active], full[active])
    assert (logits[~active] == 0).all()
    # The log-probabilities stored while acting match a recomputation on the active steps.
    dist = agents.policy.get_dist(rollout.clone())
    recomputed = dist.log_prob(rollout["agents", "action"])
    torch.testing.assert_close(recomputed[active], rollout["agents", "action_log_prob"][active])
    # An agent that acts nowhere gets an empty batch and zero gradients, not an error.
    idle = rollout[:, :1].clone()
    idle["agents", "active"] = torch.zeros_like(idle["agents", "active"])
    idle["agents", "active"][..., proto.verifier_index] = True
    agents.policy.get_dist_params(idle)["agents", "logits"].sum().backward()
    prover = next(agents.policy.module[0].module.networks["prover0"].parameters())
    assert prover.grad is not None and (prover.grad == 0).all()


def test_pair_tokens_are_pair_invariant_and_zero_apart_for_corresponding_marks():
    # The GIN treats both graphs alike: swapping the graphs leaves the pair tokens
    # unchanged, and isomorphic graphs with corresponding marked nodes differ by 0.
    from nip_like.scenarios.graph_isomorphism.agents import GraphBody

    torch.manual_seed(0)
    n, features = 9, 6
    body = GraphBody(features, 16, 2, 4, 32)
    first = (torch.rand(n, n) < 0.4).triu(1)
    first = first | first.T
    perm = torch.randperm(n)
    second = first[perm][:, perm]
    adjacency = torch.stack([first, second]).unsqueeze(0)
    node_mask = torch.ones(1, 2, n, dtype=torch.bool)
    image = int((perm == 3).nonzero())  # the node of the second graph that node 3 became
    messages = torch.zeros(1, 2, n, features)
    messages[0, 0, 3, 0] = 1.0
    messages[0, 1, image, 0] = 1.0
    _, pair = body.pair_tokens(adjacency, node_mask, messages)
    assert pair[0, 1].abs().max() < 1e-4
    _, swapped = body.pair_tokens(adjacency.flip(1), node_mask, messages.flip(1))
    torch.testing.assert_close(swapped, pair)
    # A mark on a node that does not correspond shows in the difference.
    wrong = messages.clone()
    wrong[0, 1] = 0.0
    wrong[0, 1, (image + 1) % n, 0] = 1.0
    _, apart = body.pair_tokens(adjacency, node_mask, wrong)
    assert apart[0, 1].abs().max() > 1e-3


def test_policy_and_value_treat_the_two_graphs_alike():
    # Swapping the graphs swaps the node logits and changes neither the decision nor the value.
    from nip_like.scenarios.graph_isomorphism.agents import GraphBody, GraphPolicy, GraphValue

    torch.manual_seed(1)
    b, n, steps, agents = 6, 8, 4, 2
    policy = GraphPolicy(GraphBody(steps * agents, 16, 3, 4, 32, 32), steps + 1)
    value = GraphValue(GraphBody(steps * agents, 16, 3, 4, 32, 32), steps + 1)
    adjacency = (torch.rand(b, 2, n, n) < 0.5).triu(1)
    adjacency = adjacency | adjacency.transpose(-1, -2)
    node_mask = torch.ones(b, 2, n, dtype=torch.bool)
    node_mask[:3, :, 6:] = False
    adjacency &= node_mask.unsqueeze(-1) & node_mask.unsqueeze(-2)
    messages = torch.zeros(b, 2, n, steps * agents)
    messages[:, 0, 2, 0] = 1.0  # the verifier's node at step 0
    messages[:, 1, 4, 3] = 1.0  # the prover's answer at step 1
    context = torch.nn.functional.one_hot(torch.full((b,), 2), steps + 1).float()
    inputs = (adjacency, node_mask, messages, context)
    swapped = (adjacency.flip(1), node_mask.flip(1), messages.flip(1), context)
    logits, logits_swapped = policy(*inputs), policy(*swapped)
    torch.testing.assert_close(logits_swapped[:, 2 * n :], logits[:, 2 * n :])
    torch.testing.assert_close(logits_swapped[:, n : 2 * n], logits[:, :n])
    torch.testing.assert_close(value(*swapped), value(*inputs))
    # Joint log-probabilities: they sum to one over the present nodes and the decisions.
    present = torch.cat([node_mask.reshape(b, -1), torch.ones(b, 2, dtype=torch.bool)], -1)
    torch.testing.assert_close(logits.masked_fill(~present, -torch.inf).logsumexp(-1), torch.zeros(b))


def test_cross_graph_attention_lets_nodes_see_only_the_other_graph_and_the_pair_tokens():
    from nip_like.scenarios.graph_isomorphism.agents import cross_graph_attention

    node_mask = torch.tensor([[[True, True, False], [True, True, False]]])
    allowed = cross_graph_attention(node_mask)[0, 0]  # (query, key) over 2 + 2 * 3 tokens
    pair, first, second = [0, 1], [2, 3, 4], [5, 6, 7]
    assert allowed[pair][:, [0, 1, 2, 3, 5, 6]].all()  # pair tokens see every present token
    assert not allowed[:, [4, 7]].any()  # nobody sees an absent node
    assert allowed[first][:, pair].all() and allowed[second][:, pair].all()
    assert not allowed[first][:, first].any() and not allowed[second][:, second].any()
    assert allowed[2, 5] and allowed[6, 3]


def test_grouped_mode_picks_the_most_probable_choice_then_its_best_node():
    from nip_like.distributions import GroupedMaskedCategorical

    # Four nodes of 0.15 each (0.6 in all) against accept at 0.4: the argmax is
    # accept, but sending a node is the more probable choice.
    probs = torch.tensor([[0.15, 0.16, 0.14, 0.15, 0.0, 0.40], [0.1, 0.1, 0.05, 0.05, 0.3, 0.4]])
    mask = torch.tensor([[True] * 6, [True] * 6])
    dist = GroupedMaskedCategorical(probs.log(), mask=mask, group_size=4)
    assert dist.mode.tolist() == [1, 5]
    assert dist.deterministic_sample.tolist() == [1, 5]
    # Masked actions take no part: with the nodes masked out, the best decision wins.
    mask = torch.tensor([[False] * 4 + [True] * 2] * 2)
    dist = GroupedMaskedCategorical(probs.log().clamp_min(-30), mask=mask, group_size=4)
    assert dist.mode.tolist() == [5, 5]


def test_exchange_marks_pair_each_query_with_its_answers():
    from nip_like.scenarios.graph_isomorphism.agents import exchange_marks

    steps, n = 4, 3

    def history(agents, sent):
        """``sent``: (step, agent, graph, node) of every message; returns (1, 2, n, steps * agents)."""
        messages = torch.zeros(1, 2, n, steps * agents)
        for step, agent, graph, node in sent:
            messages[0, graph, node, step * agents + agent] = 1.0
        return messages

    def channels(marks):
        return {(g, v): marks[0, g, v].nonzero().flatten().tolist() for g in range(2) for v in range(n) if marks[0, g, v].any()}

    # nip, verifier (agent 1) first: query, answer, query, answer.
    sent = [(0, 1, 0, 2), (1, 0, 1, 0), (2, 1, 1, 1), (3, 0, 0, 1)]
    assert channels(exchange_marks(history(2, sent), steps, 1)) == {(0, 2): [1], (1, 0): [1], (1, 1): [2], (0, 1): [2]}
    # A prover (agent 0) speaking first: its unprompted node is channel 0.
    sent = [(0, 0, 1, 2), (1, 1, 0, 0), (2, 0, 1, 1)]
    assert channels(exchange_marks(history(2, sent), steps, 1)) == {(1, 2): [0], (0, 0): [1], (1, 1): [1]}
    # debate (verifier = agent 2): both provers answer the same query together.
    sent = [(0, 2, 0, 0), (1, 0, 1, 1), (1, 1, 1, 2)]
    assert channels(exchange_marks(history(3, sent), steps, 2)) == {(0, 0): [1], (1, 1): [1], (1, 2): [1]}


def test_a_faithful_answer_leaves_no_difference_between_the_graphs():
    # In the environment: the verifier marks a node of the first graph and the
    # prover answers with its image in the second. With the exchange encoding the
    # verifier's pair-difference token is then exactly zero; a wrong answer is not.
    proto = protocol("nip", min_rounds=3, max_rounds=8)
    env = make_env(proto, num_envs=2)  # pair 0: two isomorphic 4-paths
    sizes = {name: OmegaConf.structured(GraphAgentConfig(hidden_size=16)) for name in proto.agent_names}
    agents = build_graph_agents(proto.agent_names, N, env.num_steps * 2, env.num_steps + 1, sizes, verifier=1)
    body = agents.policy.module[0].module.networks["verifier"].body
    td = env.reset()
    td["state", "pair_index"] = torch.zeros(2, dtype=torch.long)  # both episodes play pair 0
    for key in ("adjacency", "node_mask", "label"):
        td["state", key] = env.data[key][td["state", "pair_index"]]
    # First graph: path 0-1-2-3. Second graph: path 1-3-0-2, so node 1 of the first is node 3 of the second.
    after_query = play(env, td, [0, 1])  # the verifier sends node 1 of the first graph
    faithful = play(env, after_query, [N + 3, 0])
    wrong = play(env, after_query, [N + 1, 0])  # an end of the path: no image of an inner node

    def difference(step):
        obs = step["agents"][:, 1]
        _, pair = body.pair_tokens(obs["adjacency"], obs["node_mask"], obs["messages"])
        return pair[:, 1].abs().max().item()

    assert difference(faithful) < 1e-5
    assert difference(wrong) > 1e-3


def _two_episodes_on_pair_zero(protocol_name: str):
    """A scenario, an environment and a reset state of two episodes that both play pair 0
    (the isomorphic paths 0-1-2-3 and 1-3-0-2), and a step function taking each episode's
    actions in agent order."""
    from nip_like.scenarios.graph_isomorphism.scenario import GraphIsomorphismConfig, GraphIsomorphismScenario

    proto = protocol(protocol_name, min_rounds=3, max_rounds=8)
    scenario = GraphIsomorphismScenario(OmegaConf.structured(GraphIsomorphismConfig(min_nodes=3, max_nodes=N)), proto)
    env = make_env(proto, num_envs=2)
    td = env.reset()
    td["state", "pair_index"] = torch.zeros(2, dtype=torch.long)
    for key in ("adjacency", "node_mask", "label"):
        td["state", key] = env.data[key][td["state", "pair_index"]]

    def play_each(td, actions):
        """Per episode, the actions of the agents in order; the next state."""
        td = td.clone()
        td["agents", "action"] = torch.tensor(actions)
        return env.step(td)["next"]

    return scenario, env, td, play_each


def test_faithful_answers_count_the_answers_an_isomorphism_bears_out():
    scenario, env, td, play_each = _two_episodes_on_pair_zero("nip")  # actions: (prover, verifier)
    # Episode 0 answers faithfully twice (1 -> 3, then 0 -> 1); episode 1 answers an end of
    # the path for the inner node 1, after which no answer can be borne out.
    td = play_each(td, [[0, 1], [0, 1]])  # the verifier sends node 1 of the first graph
    td = play_each(td, [[N + 3, 0], [N + 1, 0]])
    td = play_each(td, [[0, 0], [0, 0]])  # the verifier sends node 0 of the first graph
    td = play_each(td, [[N + 1, 0], [N + 2, 0]])
    td = play_each(td, [[0, env.accept_action], [0, env.reject_action]])
    assert td["done"].all()
    assert scenario.faithful_answers(td["state"]) == {"agents/prover/faithful_answers": 0.5}
    # Non-isomorphic pairs do not count.
    td["state", "label"] = torch.zeros(2, dtype=torch.bool)
    assert scenario.faithful_answers(td["state"]) == {}


def test_faithful_answers_are_judged_per_prover_and_either_way_round():
    # mnip: two provers answer each query. On the paths 0-1-2-3 and 1-3-0-2, prover0
    # follows the isomorphism 0,1,2,3 -> 1,3,0,2 and prover1 the reversed one
    # 0,1,2,3 -> 2,0,3,1: both are faithful, although their answers differ. The
    # second query is a node of the second graph, answered in the first.
    scenario, env, td, play_each = _two_episodes_on_pair_zero("mnip")  # actions: (prover0, prover1, verifier)
    td = play_each(td, [[0, 0, 1], [0, 0, 1]])  # query: node 1 of the first graph
    td = play_each(td, [[N + 3, N + 0, 0], [N + 3, N + 0, 0]])
    td = play_each(td, [[0, 0, N + 2], [0, 0, N + 2]])  # query: node 2 of the second graph
    # Episode 0: each prover answers by its own isomorphism; episode 1: prover1 answers by prover0's.
    td = play_each(td, [[3, 0, 0], [3, 3, 0]])
    td = play_each(td, [[0, 0, env.accept_action]] * 2)
    assert td["done"].all()
    first = scenario.faithful_answers(td["state"][:1])
    assert first == {"agents/prover0/faithful_answers": 1.0, "agents/prover1/faithful_answers": 1.0}
    both = scenario.faithful_answers(td["state"])
    assert both == {"agents/prover0/faithful_answers": 1.0, "agents/prover1/faithful_answers": 0.75}


def test_most_recent_message_flags_the_nodes_of_the_previous_step_only():
    from nip_like.scenarios.graph_isomorphism.agents import most_recent_message

    env = make_env(protocol("nip", min_rounds=3, max_rounds=8))
    td = env.reset()

    def recent(step_td, agent):
        obs = step_td["agents"][:, agent]
        return most_recent_message(obs["messages"], obs["observation"])[0]

    assert recent(td, 1).sum() == 0  # nothing sent before step 0
    after_query = play(env, td, [0, 1])  # the verifier sends node 1 of the first graph
    flags = recent(after_query, 0)
    assert flags[0, 1] == 1 and flags.sum() == 1
    after_answer = play(env, after_query, [N + 2, 0])  # the prover answers node 2 of the second graph
    flags = recent(after_answer, 1)
    assert flags[1, 2] == 1 and flags.sum() == 1  # the query of step 0 is no longer recent
