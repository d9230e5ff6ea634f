"""Honest-play demonstrations of the graph-isomorphism game (the warm start of trainer.pretrain)."""

import numpy as np
import pytest
import torch

from nip_like.experiment import build_trainer
from nip_like.validation import build_scenario
from nip_like.protocols.proof import ProofProtocol
from nip_like.registry import PROTOCOLS as REGISTERED_PROTOCOLS
from nip_like.scenarios.graph_isomorphism.demonstrations import FAITHFUL, answer_score, best_answers
from nip_like.scenarios.graph_isomorphism.isomorphism import are_isomorphic, permute, wl_rounds_to_distinguish
from tests.test_gi_scenario import gi_config

PROTOCOLS = REGISTERED_PROTOCOLS.names(subclass_of=ProofProtocol)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gi_cache")


def random_graph(size: int, seed: int, p: float = 0.4) -> np.ndarray:
    rng = np.random.default_rng(seed)
    upper = np.triu(rng.random((size, size)) < p, 1)
    return upper | upper.T


@pytest.mark.parametrize("seed", range(6))
def test_honest_answers_on_an_isomorphic_pair_are_images_under_an_isomorphism(seed):
    graph_a = random_graph(9, seed)
    order = np.random.default_rng(100 + seed).permutation(9)
    graph_b = permute(graph_a, order)  # node i of graph_b is node order[i] of graph_a
    image = {int(order[i]): i for i in range(9)}
    marks = []
    for query in (seed % 9, (seed + 4) % 9):
        answers = best_answers(graph_a, graph_b, marks, query, True, True)
        assert image[query] in answers  # the isomorphism the pair was built with is found
        for answer in answers:
            assert are_isomorphic(graph_a, graph_b, [*marks, (query, answer)])
        marks.append((query, image[query]))
    # Asked from the other graph's side, the answer is the preimage.
    assert order[0] in best_answers(graph_a, graph_b, marks, 0, False, True)


def test_answers_on_a_non_isomorphic_pair_survive_refinement_the_longest():
    # A 6-cycle against two triangles: 1-WL never tells them apart; with a pair individualised it does.
    cycle = np.zeros((6, 6), dtype=bool)
    for i in range(6):
        cycle[i, (i + 1) % 6] = cycle[(i + 1) % 6, i] = True
    triangles = np.zeros((6, 6), dtype=bool)
    for a, b in ((0, 1), (1, 2), (0, 2), (3, 4), (4, 5), (3, 5)):
        triangles[a, b] = triangles[b, a] = True
    scores = [answer_score(cycle, triangles, [(0, node)], False) for node in range(6)]
    assert max(scores) < FAITHFUL
    assert best_answers(cycle, triangles, [], 0, True, False) == [n for n, s in enumerate(scores) if s == max(scores)]
    for node in range(6):
        assert scores[node] == wl_rounds_to_distinguish(cycle, triangles, marks=[(0, node)])


#: The agents each protocol demonstrates: the verifier and the accept-side provers that answer a query.
DEMONSTRATED = {
    "nip": ["prover", "verifier"],
    "debate": ["prover0", "verifier"],
    "mnip": ["prover0", "prover1", "verifier"],
    "adp": ["verifier"],
    "merlin_arthur": ["verifier"],
    "solo_verifier": ["verifier"],
    "solo_opening": ["verifier"],
}


def test_every_protocol_is_covered():
    assert set(DEMONSTRATED) == set(PROTOCOLS)


@pytest.mark.parametrize("protocol", sorted(DEMONSTRATED))
def test_demonstrated_agents_are_the_verifier_and_the_accept_side_provers_that_answer_queries(cache_dir, protocol):
    scenario = build_scenario(gi_config(cache_dir, f"protocol={protocol}"))
    assert scenario.demonstration_agents() == DEMONSTRATED[protocol]
    assert sorted(scenario.demonstrations("train", seed=0)) == sorted(DEMONSTRATED[protocol])


def transcript(messages: torch.Tensor, agents: int, steps: int, n: int) -> list[tuple[int, int]]:
    """``(step, agent, node)`` of every message an agent saw, in step order (environment numbering)."""
    sent = []
    for step in range(steps):
        for agent in range(agents):
            nodes = messages[..., step * agents + agent].flatten().nonzero().flatten().tolist()
            sent += [(step, agent, node) for node in nodes]
    return sent


@pytest.mark.parametrize("protocol", ["nip", "mnip"])
def test_played_demonstrations_follow_the_rules_and_answer_faithfully(cache_dir, protocol):
    scenario = build_scenario(gi_config(cache_dir, f"protocol={protocol}", "protocol.min_rounds=3", "protocol.max_rounds=6"))
    data = scenario.demonstrations("train", seed=3)
    env = scenario.make_env(1, "train", 0, "cpu")
    n, names, steps = env.max_nodes, scenario.agent_names, env.num_steps
    verifier = scenario.protocol.verifier_index
    decisions = data["verifier"]
    step = decisions["agents", "observation"][:, verifier].argmax(-1)
    assert (step >= 2).all() and set(step.tolist()) == {2, 4}  # every step where it may decide, none other
    expected = torch.where(decisions["label"], env.accept_action, env.reject_action)
    assert torch.equal(decisions["target_action"], expected)
    assert decisions["target_mask"].sum(-1).eq(2).all()
    assert torch.equal(decisions["agents", "active"][:, verifier], torch.ones(len(decisions), dtype=torch.bool))
    for name in ("prover", "prover0", "prover1"):
        if name not in data:
            continue
        answers, index = data[name], names.index(name)
        assert answers["agents", "active"].sum(-1).eq(1).all() and answers["agents", "active"][:, index].all()
        assert answers["target_mask"].gather(1, answers["target_action"].unsqueeze(1)).all()  # legal
        faithful = 0
        for point in range(len(answers)):
            if not answers["label"][point]:
                continue
            seen = transcript(answers["agents", "messages"][point, index], len(names), steps, n)
            size = int(answers["agents", "node_mask"][point, index, 0].sum())
            adjacency = answers["agents", "adjacency"][point, index]
            graph_a, graph_b = adjacency[0, :size, :size].numpy(), adjacency[1, :size, :size].numpy()
            marks, query = [], None
            for _, agent, node in seen:
                if agent == verifier:
                    query = node
                elif agent == index and query is not None:
                    marks.append((query, node - n) if query < n else (node, query - n))
            answer = int(answers["target_action"][point])
            assert (query < n) != (answer < n)  # in the other graph than the latest query
            marks.append((query, answer - n) if query < n else (answer, query - n))
            faithful += are_isomorphic(graph_a, graph_b, marks)
            assert are_isomorphic(graph_a, graph_b, marks)
        assert faithful > 0


def test_solo_verifier_demonstrations_are_the_supervised_labels(cache_dir):
    scenario = build_scenario(gi_config(cache_dir, "protocol=solo_verifier"))
    demonstrated = scenario.demonstrations("val", seed=0)["verifier"]
    supervised = scenario.supervised_data("val")
    for key in ("target_action", "target_mask", "label", ("agents", "observation"), ("agents", "adjacency")):
        assert torch.equal(demonstrated[key], supervised[key])


def test_demonstrations_depend_on_the_seed_only_through_the_queries(cache_dir):
    scenario = build_scenario(gi_config(cache_dir, "protocol=nip", "protocol.max_rounds=4"))
    first, again = scenario.demonstrations("val", seed=1), scenario.demonstrations("val", seed=1)
    other = scenario.demonstrations("val", seed=2)
    assert torch.equal(first["prover"]["target_action"], again["prover"]["target_action"])
    assert not torch.equal(first["prover"]["agents", "messages"], other["prover"]["agents", "messages"])
    assert torch.equal(first["verifier"]["label"], other["verifier"]["label"])


def test_warm_start_of_every_agent_fits_the_prover_and_the_verifier(tmp_path, cache_dir):
    config = gi_config(
        cache_dir, "protocol=nip", "protocol.max_rounds=4", "trainer.pretrain.agents=[\"*\"]",
        "trainer.pretrain.epochs=2", f"trainer.pretrain.cache_dir={tmp_path / 'p'}",
    )
    trainer = build_trainer(config, tmp_path / "run")
    metrics = trainer.pretrain_metrics
    assert metrics["pretrain/prover/from_cache"] == 0.0 and metrics["pretrain/verifier/from_cache"] == 0.0
    assert 0.0 <= metrics["pretrain/prover/train_accuracy"] <= 1.0
