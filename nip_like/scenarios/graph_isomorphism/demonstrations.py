"""Honest play of the graph-isomorphism game, recorded as demonstrations for a warm start.

An all-powerful prover arguing that two graphs are isomorphic knows an
isomorphism, and its honest answer to the verifier's query ``q`` is the image
of ``q`` (a node of the other graph) under an isomorphism that also maps its
earlier answers onto their queries. On a pair that is not isomorphic there is
no such image; the prover's most convincing answer is then the node that keeps
joint colour refinement from telling the graphs apart the longest (with its
query-answer pairs individualised). :func:`best_answers` finds both with the
exact search of :mod:`~nip_like.scenarios.graph_isomorphism.isomorphism`.

:func:`play_demonstrations` plays every pair of a split through the
environment's own rules: the verifier queries nodes drawn uniformly and, at
every step where it may decide, is shown the right decision; accept-side
provers answer honestly; reject-side provers (and provers speaking before any
query) send a random legal node and are not demonstrated.
"""

from __future__ import annotations

import numpy as np
import torch
from tensordict import TensorDict

from nip_like.protocols.zero_knowledge import ADVERSARIAL_KEY
from nip_like.scenarios.graph_isomorphism.isomorphism import are_isomorphic, wl_rounds_to_distinguish

#: Score of an answer that an isomorphism bears out (above any refinement round).
FAITHFUL = 10_000
#: Score of an answer that colour refinement never tells apart, short of an isomorphism.
NEVER_TOLD_APART = FAITHFUL - 1


def answer_score(graph_a: np.ndarray, graph_b: np.ndarray, marks: list[tuple[int, int]], is_isomorphic: bool) -> int:
    """How convincing the answer that completes ``marks`` is: :data:`FAITHFUL`, or refinement rounds survived.

    Parameters
    ----------
    graph_a, graph_b : numpy.ndarray
        The two graphs (square boolean adjacency matrices of one size).
    marks : list of (int, int)
        The prover's query-answer pairs so far, oriented (node of ``graph_a``, node of ``graph_b``),
        the candidate answer last.
    is_isomorphic : bool
        Whether the graphs are isomorphic (only then can an answer be faithful).
    """
    rounds = wl_rounds_to_distinguish(graph_a, graph_b, marks=marks)
    if rounds is not None:
        return rounds
    if is_isomorphic and are_isomorphic(graph_a, graph_b, marks):
        return FAITHFUL
    return NEVER_TOLD_APART


def best_answers(
    graph_a: np.ndarray, graph_b: np.ndarray, marks: list[tuple[int, int]], query: int, query_in_a: bool, is_isomorphic: bool
) -> list[int]:
    """The nodes of the graph opposite ``query``'s with the highest :func:`answer_score`.

    Parameters
    ----------
    graph_a, graph_b : numpy.ndarray
        The two graphs, each ``(size, size)``.
    marks : list of (int, int)
        The prover's earlier query-answer pairs, oriented (node of ``graph_a``, node of ``graph_b``).
    query : int
        The verifier's node, numbered within its graph.
    query_in_a : bool
        Whether the query is a node of ``graph_a`` (else of ``graph_b``).
    is_isomorphic : bool
        Whether the pair is isomorphic.

    Returns
    -------
    list of int
        The best answers, numbered within the other graph, in increasing order.
    """
    size = graph_a.shape[0]
    scores = []
    for candidate in range(size):
        pair = (query, candidate) if query_in_a else (candidate, query)
        scores.append(answer_score(graph_a, graph_b, [*marks, pair], is_isomorphic))
    best = max(scores)
    return [node for node, score in enumerate(scores) if score == best]


def _pick(choices: list[int], generator: torch.Generator) -> int:
    """One of ``choices``, drawn uniformly."""
    return choices[int(torch.randint(len(choices), (1,), generator=generator))]


def _random_nodes(mask: torch.Tensor, nodes: int, generator: torch.Generator) -> torch.Tensor:
    """``(B, N)``: a node drawn uniformly among each agent's legal nodes (0 where none is legal)."""
    legal = mask[..., :nodes].float()
    weights = legal.clone()
    weights[..., 0] += (legal.sum(-1) == 0).float()
    flat = weights.reshape(-1, nodes)
    return torch.multinomial(flat, 1, generator=generator).view(mask.shape[:-1])


def play_demonstrations(
    env, protocol, pairs, episodes_per_pair: int, generator: torch.Generator, accepts: torch.Tensor | None = None
) -> dict[str, TensorDict]:
    """Play every pair ``episodes_per_pair`` times honestly; return each demonstrated agent's datapoints.

    Parameters
    ----------
    env : GraphIsomorphismEnv
        An environment of the split (its rules, observations and masks are used; its data are not).
    protocol : ProofProtocol
        The protocol (turns, sides).
    pairs : GraphPairs
        The split's pairs.
    episodes_per_pair : int
        Episodes played on each pair (the verifier's queries differ).
    generator : torch.Generator
        Draws the queries, the undemonstrated agents' nodes and ties between equally good answers.
    accepts : torch.Tensor, optional
        ``(len(pairs),)`` bool: the decision the verifier is shown on each pair; by default its label.

    Returns
    -------
    dict of str to TensorDict
        For the verifier (at every step where it may decide) and each accept-side prover (at every
        step where it answers a query): batch ``(E,)`` with ``"agents"`` (every agent's observation
        entries, ``"active"`` set for the demonstrated agent alone), ``"target_action"``,
        ``"target_mask"`` (the actions it chooses among: reject and accept for a decision, the legal
        nodes for an answer) and ``"label"``. Agents with no datapoint are left out.
    """
    count = len(pairs) * episodes_per_pair
    index = torch.arange(len(pairs)).repeat(episodes_per_pair)
    n, agents, verifier = env.max_nodes, protocol.num_agents, protocol.verifier_index
    state = TensorDict(
        {
            "round": torch.zeros(count, dtype=torch.int64),
            "pair_index": index,
            "adjacency": pairs.adjacency[index].bool(),
            "node_mask": pairs.node_mask[index].bool(),
            "label": pairs.label[index].bool(),
            "sent": torch.full((count, env.num_steps, env.transcript_agents), -1),
            "decision": torch.full((count,), -1),
        },
        batch_size=[count],
    )
    state.update(protocol.initial_state(count, generator))
    if env.zero_knowledge:
        # Honest play is the verifier's: no episode is the second verifier's, and the simulator waits.
        state.update(env._new_zero_knowledge_state(count))
        state[ADVERSARIAL_KEY] = torch.zeros(count, dtype=torch.bool)
    sizes = state["node_mask"][:, 0].sum(-1).tolist()
    graphs = [
        (adjacency[0, :size, :size].numpy(), adjacency[1, :size, :size].numpy())
        for adjacency, size in zip(state["adjacency"], sizes)
    ]
    labels = state["label"].tolist()
    answering = [
        position
        for position, name in enumerate(protocol.transcript_agent_names)
        if position != verifier and protocol.prover_sides.get(name, True)
    ]
    marks = {position: [[] for _ in range(count)] for position in answering}
    last_query = torch.full((count,), -1)  # each episode's latest verifier node, -1 before the first
    accepted = state["label"] if accepts is None else accepts.bool()[index]
    decision = torch.where(accepted, env.accept_action, env.reject_action)
    collected: dict[int, list[TensorDict]] = {position: [] for position in range(agents)}

    def record(position: int, rows: torch.Tensor, target: torch.Tensor, target_mask: torch.Tensor) -> None:
        active = torch.zeros(len(rows), agents, dtype=torch.bool)
        active[:, position] = True
        entries = {key: value[rows] for key, value in extra.items()}
        collected[position].append(
            TensorDict(
                {
                    "agents": TensorDict(
                        {**entries, "observation": observation[rows], "active": active}, batch_size=[len(rows), agents]
                    ),
                    "target_action": target,
                    "target_mask": target_mask,
                    "label": state["label"][rows],
                },
                batch_size=[len(rows)],
            )
        )

    for _ in range(protocol.num_rounds):
        active = protocol.active_agents_in(state)
        observation, mask = env._observe(state)
        extra = env._observe_extra(state)
        action = _random_nodes(mask, 2 * n, generator)
        # The verifier: shown the right decision wherever it may decide; it decides only when it must.
        acting = active[:, verifier]
        may = acting & mask[:, verifier, 2 * n :].any(-1)
        rows = may.nonzero().flatten()
        if len(rows):
            choices = torch.zeros(len(rows), env.num_actions, dtype=torch.bool)
            choices[:, [env.reject_action, env.accept_action]] = True
            record(verifier, rows, decision[rows], choices)
        must = acting & ~mask[:, verifier, : 2 * n].any(-1)
        action[:, verifier] = torch.where(must, decision, action[:, verifier])
        # Accept-side provers: the honest answer to the verifier's latest query.
        queries = last_query.tolist()
        for position in answering:
            rows = (active[:, position] & (last_query >= 0)).nonzero().flatten()
            for row in rows.tolist():
                query = queries[row]
                query_in_a = query < n
                own = query if query_in_a else query - n
                graph_a, graph_b = graphs[row]
                answer = _pick(best_answers(graph_a, graph_b, marks[position][row], own, query_in_a, labels[row]), generator)
                marks[position][row].append((own, answer) if query_in_a else (answer, own))
                action[row, position] = answer + n if query_in_a else answer
            if len(rows):
                record(position, rows, action[rows, position], mask[rows, position])
        sent_query = acting & (action[:, verifier] < 2 * n)
        last_query = torch.where(sent_query, action[:, verifier], last_query)
        state, _, _ = env._advance(state.clone(), action, active)
        state["round"] = state["round"] + 1
    return {
        protocol.agent_names[position]: torch.cat(parts)
        for position, parts in collected.items()
        if parts
    }
