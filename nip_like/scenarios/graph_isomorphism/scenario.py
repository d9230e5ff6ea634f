"""The graph-isomorphism scenario: data, environments, graph agents and metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from nip_like.agent_modules import AgentModules
from nip_like.allowed import Allowed, checked
from nip_like.errors import ConfigError
from nip_like.folders import check_writable_folder
from nip_like.protocols.zero_knowledge import ADVERSARIAL_KEY
from nip_like.distributions import masked_log_softmax
from nip_like.registry import register_scenario, typed_entry
from nip_like.scenarios.base import Demonstrating, GeneratedData, Labelled, ScenarioConfig, TensorGame
from nip_like.scenarios.messaging import MessageFeatures, Messaging, one_hot_messages
from nip_like.scenarios.decisions import check_proof_scenario, decision_metrics, precision_recall
from nip_like.scenarios.graph_isomorphism.agents import MESSAGE_ENCODINGS, GraphAgentConfig, build_graph_agents
from nip_like.scenarios.graph_isomorphism.data import GraphPairs, GraphPairSpec, cache_path, generate_pairs
from nip_like.scenarios.graph_isomorphism.demonstrations import play_demonstrations
from nip_like.scenarios.graph_isomorphism.environment import GraphIsomorphismEnv
from nip_like.scenarios.graph_isomorphism.isomorphism import are_isomorphic

SPLITS = ("train", "val", "test")


@dataclass
class GraphIsomorphismConfig(ScenarioConfig):
    """The graph-isomorphism scenario (see :mod:`nip_like.scenarios.graph_isomorphism`)."""

    name: str = "graph_isomorphism"  # scenario name
    num_pairs: int = checked(2000, ge=1)  # graph pairs in the dataset, before the splits
    dataset_seed: int = checked(0, ge=0)  # seed of the dataset generator (the run's seed does not change the data)
    min_nodes: int = checked(7, ge=2, le=64)  # fewest nodes of a graph
    max_nodes: int = checked(11, ge=2, le=64)  # most nodes of a graph
    edge_probabilities: list[float] = checked(factory=lambda: [0.2, 0.4, 0.6, 0.8], each=Allowed(gt=0, lt=1))  # Erdos-Renyi edge probabilities
    wl_fractions: list[float] = checked(factory=lambda: [0.1, 0.2, 0.7], length=3, each=Allowed(ge=0, le=1))  # non-isomorphic pairs told apart by 1-WL in 1, 2, >2 rounds
    val_fraction: float = checked(0.1, gt=0, lt=1)  # share of pairs in the validation split (periodic evaluation)
    test_fraction: float = checked(0.2, gt=0, lt=1)  # share of pairs in the held-out test split
    cache_dir: str = "~/.cache/nip_like/datasets"  # where generated datasets are cached
    prover_answers_other_graph: bool = True  # a prover's node must lie in the graph the verifier's last node is not in
    demonstration_episodes: int = checked(2, ge=1)  # honest-play episodes per pair in the warm start's demonstrations (trainer.pretrain)
    agents: dict[str, Any] = field(default_factory=dict)  # per-agent GraphAgentConfig entries; others use default_agent
    default_agent: GraphAgentConfig = field(default_factory=GraphAgentConfig)  # network size of agents not in agents


@register_scenario("graph_isomorphism", GraphIsomorphismConfig)
class GraphIsomorphismScenario(GeneratedData, TensorGame, Demonstrating, Labelled, Messaging):
    """Decide whether two graphs are isomorphic, helped (or misled) by provers.

    The dataset is generated once per generation config and cached
    (:meth:`generate`, :meth:`data_cache_path`), then split into disjoint
    train, validation and test pairs (:meth:`split_fractions`). Periodic
    evaluation plays the validation split; the final test loop the test split.

    A graph task of your own overrides what differs: :meth:`data_spec`,
    :meth:`generate` and :meth:`split_fractions` (the data) and
    :meth:`verifier_accepts` (the decisions the warm start teaches the verifier).
    """

    dataset_class = GraphPairs
    split_names = SPLITS

    eval_split = "val"
    supports_zero_knowledge = True
    #: Version of :meth:`demonstrations` (part of the warm-start cache key).
    pretrain_data_version = 1

    def __init__(self, config, protocol) -> None:
        super().__init__(config, protocol)
        check_proof_scenario("graph_isomorphism", config, protocol)
        self.spec = self.data_spec()
        check_writable_folder(Path(config.cache_dir), "scenario.cache_dir")

    # -------------------------------------------------------------------- data
    def data_spec(self) -> GraphPairSpec:
        """What :meth:`generate` draws, from the config (called once, in ``__init__``, as ``self.spec``); its ``key()`` names the cache file."""
        config = self.config
        return GraphPairSpec(
            num_pairs=int(config.num_pairs),
            seed=int(config.dataset_seed),
            min_nodes=int(config.min_nodes),
            max_nodes=int(config.max_nodes),
            edge_probabilities=tuple(float(p) for p in config.edge_probabilities),
            wl_fractions=tuple(float(f) for f in config.wl_fractions),
        )

    def generate(self, spec: GraphPairSpec) -> GraphPairs:
        """Draw the whole dataset of ``spec`` (before the splits); the same spec must give the same pairs.

        The contract: ``spec.num_pairs`` pairs padded to ``spec.max_nodes``
        nodes, each with its exact ``label`` and the fields of
        :class:`~nip_like.scenarios.graph_isomorphism.data.GraphPairs`, drawn
        from ``spec.seed`` alone. By default
        :func:`~nip_like.scenarios.graph_isomorphism.data.generate_pairs`.
        """
        return generate_pairs(spec)

    def base_cache_path(self) -> Path:
        """The pairs' cache file: ``gi_pairs_<spec key>.pt`` in ``scenario.cache_dir``."""
        return cache_path(self.spec, Path(self.config.cache_dir).expanduser())

    def check_dataset(self, data: GraphPairs, path: Path) -> None:
        if data.adjacency.shape[-1] != int(self.config.max_nodes):
            raise ConfigError(
                f"{path} holds graphs padded to {data.adjacency.shape[-1]} nodes; "
                f"this run's agents take scenario.max_nodes = {self.config.max_nodes}"
            )

    def make_env(
        self, num_envs: int, split: str, seed: int, device: torch.device | str, group_size: int = 1
    ) -> GraphIsomorphismEnv:
        pairs = self.split(split)
        return GraphIsomorphismEnv(
            self.protocol,
            pairs.adjacency,
            pairs.node_mask,
            pairs.label,
            num_envs=num_envs,
            device=device,
            seed=seed,
            group_size=group_size,
            prover_answers_other_graph=bool(self.config.prover_answers_other_graph),
        )

    # ------------------------------------------------------------------ agents
    def agent_sizes(self) -> dict[str, object]:
        """Each agent's network sizes (``scenario.agents.<name>`` or ``scenario.default_agent``)."""
        return {
            name: typed_entry(GraphAgentConfig, self.config.agents[name], f"scenario.agents.{name}")
            if name in self.config.agents
            else self.config.default_agent
            for name in self.agent_names
        }

    def make_agents(self) -> AgentModules:
        sizes = self.agent_sizes()
        for name, size in sizes.items():
            where = f"agents.{name}" if name in self.config.agents else "default_agent"
            if size.attention_heads and size.hidden_size % size.attention_heads:
                raise ConfigError(
                    f"scenario.{where}.hidden_size ({size.hidden_size}) must be a multiple of "
                    f"attention_heads ({size.attention_heads})"
                )
            if size.message_encoding not in MESSAGE_ENCODINGS:
                raise ConfigError(
                    f"scenario.{where}.message_encoding must be one of {list(MESSAGE_ENCODINGS)}, "
                    f"got {size.message_encoding!r}"
                )
        steps = self.protocol.num_rounds
        return build_graph_agents(
            self.agent_names,
            int(self.config.max_nodes),
            steps * len(self.protocol.transcript_agent_names),
            steps + 1,
            sizes,
            verifier=self.protocol.verifier_index,
        )

    # ---------------------------------------------------------------- messages
    def message_features(self, episodes: TensorDictBase, policy: Any) -> list[MessageFeatures]:
        """Each prover's nodes, one-hot per step (``T * 2n``: a node of either graph)."""
        names = self.protocol.transcript_agent_names
        return one_hot_messages(episodes["state", "sent"], names, self.protocol.prover_indices, 2 * int(self.config.max_nodes))

    # -------------------------------------------------------- supervised data
    def supervised_data(self, split: str) -> TensorDict:
        """Labelled first observations of every pair of ``split``, for the solo-agent trainer.

        Returns
        -------
        TensorDict
            Batch ``(pairs,)``: each agent's observation entries at the first
            step (no messages yet), ``"target_action"`` (accept for isomorphic
            pairs, reject otherwise), ``"target_mask"`` (only the two decisions)
            and ``"label"``.
        """
        pairs = self.split(split)
        env = self.make_env(1, split, 0, "cpu")
        count = len(pairs)
        state = TensorDict(
            {
                "round": torch.zeros(count, dtype=torch.int64),
                "pair_index": torch.arange(count),
                "adjacency": pairs.adjacency,
                "node_mask": pairs.node_mask,
                "label": pairs.label,
                "sent": torch.full((count, env.num_steps, env.transcript_agents), -1),
                "decision": torch.full((count,), -1),
                **(env._new_zero_knowledge_state(count) if env.zero_knowledge else {}),
            },
            batch_size=[count],
        )
        observation, _ = env._observe(state)
        # Every agent counts as acting, so that each one's decision can be read off.
        active = torch.ones(count, env.num_agents, dtype=torch.bool)
        agents = TensorDict(
            {**env._observe_extra(state), "observation": observation, "active": active},
            batch_size=[count, env.num_agents],
        )
        target_mask = torch.zeros(count, env.num_actions, dtype=torch.bool)
        target_mask[:, [env.reject_action, env.accept_action]] = True
        target = torch.where(self.verifier_accepts(pairs), env.accept_action, env.reject_action)
        return TensorDict(
            {"agents": agents, "target_mask": target_mask, "target_action": target, "label": pairs.label},
            batch_size=[count],
        )

    # ------------------------------------------------------ demonstrations
    def verifier_accepts(self, pairs: GraphPairs) -> torch.Tensor:
        """``(len(pairs),)`` bool: the decision the warm start teaches the verifier on each pair (and the supervised target).

        The contract: what a sound and complete verifier decides on the
        pair, given all it may ask; by default the label (an isomorphic pair
        is accepted), since the verifier's queries can tell any two graphs apart.
        """
        return pairs.label

    def demonstration_agents(self) -> list[str]:
        """The agents :meth:`demonstrations` has datapoints for: the verifier, and accept-side provers that answer queries.

        A prover answers a query when the verifier speaks before it; in the protocols where a prover
        opens and the verifier then decides (``adp``, ``merlin_arthur``) there is no query to answer.
        """
        verifier = self.protocol.verifier_index
        rounds = torch.arange(self.protocol.num_rounds)
        active = self.protocol.active_agents(rounds)
        queried = active[:, verifier].long().cumsum(0) > 0  # a verifier turn has come before or at this step
        answers = active & torch.cat([torch.tensor([False]), queried[:-1]]).unsqueeze(-1)
        return [
            name
            for index, name in enumerate(self.protocol.transcript_agent_names)
            if index == verifier or (self.protocol.prover_sides.get(name, True) and bool(answers[:, index].any()))
        ]

    def demonstrations(self, split: str, seed: int = 0) -> dict[str, TensorDictBase]:
        """Honest play on every pair of ``split``, as decision datapoints per agent, for a warm start.

        Each pair is played ``scenario.demonstration_episodes`` times through the environment's
        rules (:func:`~nip_like.scenarios.graph_isomorphism.demonstrations.play_demonstrations`):
        the verifier queries uniformly drawn nodes and is shown the right decision at every step
        where it may decide; a prover arguing for *accept* answers each query with its image under
        an isomorphism consistent with its earlier answers (found by the exact search), or, on a
        pair that is not isomorphic, with the node that keeps colour refinement from telling the
        graphs apart the longest. The decision shown is :meth:`verifier_accepts`. With no prover (``solo_verifier``) this is the first-step
        decision of :meth:`supervised_data`.

        Returns
        -------
        dict of str to TensorDict
            Per agent of :meth:`demonstration_agents`: ``"agents"``, ``"target_action"``,
            ``"target_mask"`` and ``"label"``, as :meth:`supervised_data` lays them out.
        """
        generator = torch.Generator().manual_seed(seed)
        env = self.make_env(1, split, 0, "cpu")
        # A verifier that decides at once, with no prover, has nothing random to vary between episodes.
        episodes = int(self.config.demonstration_episodes) if self.protocol.num_rounds > 1 else 1
        pairs = self.split(split)
        return play_demonstrations(env, self.protocol, pairs, episodes, generator, accepts=self.verifier_accepts(pairs))

    def supervised_metrics(self, predicted: torch.Tensor, data: TensorDictBase) -> dict[str, float]:
        """Precision and recall (accept = positive) of supervised predictions."""
        return precision_recall(predicted == data["target_mask"].shape[-1] - 1, data["label"])

    # ----------------------------------------------------------------- metrics
    def optimal_rewards(self) -> dict[str, float] | None:
        return None

    def policy_metrics(self, batch: TensorDictBase) -> dict[str, float]:
        """Decision and message entropies of the collecting policy.

        ``agents/<name>/policy/message_entropy``: entropy of the node an agent
        sends, given that it sends one, over its active steps.
        ``agents/verifier/policy/decision_entropy``: entropy of the verifier's
        three-way choice (reject, accept, continue with any node) over the
        steps where it may decide.
        """
        logits = batch.get(("agents", "logits"))
        mask = batch.get(("agents", "action_mask"))
        active = batch.get(("agents", "active"))
        nodes = logits.shape[-1] - 2
        log_p = masked_log_softmax(logits, mask)
        p = log_p.exp()
        node_mask = mask[..., :nodes]
        sends = node_mask.any(-1) & active
        node_log_p = masked_log_softmax(logits[..., :nodes], node_mask)
        message = -(node_log_p.exp() * torch.where(node_mask, node_log_p, torch.zeros_like(node_log_p))).sum(-1)
        metrics = {}
        for index, name in enumerate(self.agent_names):
            chosen = sends[..., index]
            if chosen.any():
                metrics[f"agents/{name}/policy/message_entropy"] = message[..., index][chosen].mean().item()
        verifier = self.protocol.verifier_index
        deciding = mask[..., verifier, nodes:].any(-1) & active[..., verifier]
        if deciding.any():
            probs = p[..., verifier, :]
            three = torch.stack([probs[..., nodes], probs[..., nodes + 1], probs[..., :nodes].sum(-1)], -1)
            three = three[deciding].clamp_min(1e-12)
            metrics["agents/verifier/policy/decision_entropy"] = (-(three * three.log()).sum(-1)).mean().item()
        return metrics

    def episode_metrics(self, episodes: TensorDictBase) -> dict[str, float]:
        """Verifier accuracy (per episode, per datapoint, worst datapoint), precision, recall, length.

        Precision and recall treat *accept* (isomorphic) as the positive class.
        Under a zero-knowledge protocol the decision metrics count the
        verifier's episodes only, and :func:`zero_knowledge_metrics` are added.
        """
        metrics = super().episode_metrics(episodes)
        state = episodes.get("state")
        metrics["episode_length"] = state["round"].float().mean().item()
        metrics.update(self.faithful_answers(state))
        if self.protocol.zero_knowledge:
            metrics.update(zero_knowledge_metrics(state))
            # The decisions are the verifier's only in its own episodes.
            state = state[~state[ADVERSARIAL_KEY]]
            if not state.batch_size[0]:
                return metrics
        metrics.update(decision_metrics(state["decision"], state["label"], state["pair_index"]))
        return metrics

    #: Isomorphic episodes examined per call of :meth:`faithful_answers` (each answer costs an exact search).
    faithful_answer_episodes = 256

    def faithful_answers(self, state: TensorDictBase) -> dict[str, float]:
        """Per prover, the share of its answers on isomorphic pairs that an isomorphism bears out.

        An answer is a prover's node sent after a verifier's node (the query
        it answers is the verifier's most recent node). It is *faithful* when
        some isomorphism maps the query to the answer and every earlier
        query-answer pair of the same prover onto each other
        (:func:`~nip_like.scenarios.graph_isomorphism.isomorphism.are_isomorphic`
        with ``marks``); an answer in the query's own graph never is. Only
        isomorphic pairs count (there a prover can always be faithful), at
        most :attr:`faithful_answer_episodes` of them. Returns
        ``agents/<prover>/faithful_answers`` for the provers that answered.
        """
        verifier = self.protocol.verifier_index
        provers = [index for index in range(len(self.protocol.transcript_agent_names)) if index != verifier]
        isomorphic = state["label"].nonzero().flatten()[: self.faithful_answer_episodes].tolist()
        sent, adjacency = state["sent"].cpu(), state["adjacency"].cpu()
        n, sizes = adjacency.shape[-1], state["node_mask"][:, 0].sum(-1).cpu()
        answers, faithful = [0] * len(provers), [0] * len(provers)
        for episode in isomorphic:
            size = int(sizes[episode])
            graph_a, graph_b = adjacency[episode, 0, :size, :size].numpy(), adjacency[episode, 1, :size, :size].numpy()
            # Each prover's own query-answer pairs: one prover's answers do not bind another's.
            marks: list[list[tuple[int, int]]] = [[] for _ in provers]
            query = -1
            for step in sent[episode].tolist():
                for position, prover in enumerate(provers):
                    answer = step[prover]
                    if answer < 0 or query < 0:
                        continue
                    answers[position] += 1
                    if (query < n) == (answer < n):
                        continue
                    marks[position].append((query, answer - n) if query < n else (answer, query - n))
                    faithful[position] += are_isomorphic(graph_a, graph_b, marks[position])
                if step[verifier] >= 0:
                    query = step[verifier]
        return {
            f"agents/{self.protocol.agent_names[prover]}/faithful_answers": faithful[position] / answers[position]
            for position, prover in enumerate(provers)
            if answers[position]
        }


def zero_knowledge_metrics(state: TensorDictBase) -> dict[str, float]:
    """How close the simulator came to the second verifier, over the finished episodes of ``state``.

    ``zero_knowledge/simulator_distance``: over the second verifier's
    episodes, the mean per episode of the total-variation distance between
    its action distribution and the simulator's, averaged over its turns
    (0: the simulator reproduces it, 1: never the same action).
    ``zero_knowledge/adversarial_share``: the share of episodes that were
    the second verifier's (alone when there were none).
    """
    adversarial = state[ADVERSARIAL_KEY]
    if not adversarial.any():
        return {"zero_knowledge/adversarial_share": 0.0}
    turns = state["zk_turns"][adversarial].clamp(min=1).float()
    distance = (state["zk_distance"][adversarial] / turns).mean().item()
    return {"zero_knowledge/simulator_distance": distance, "zero_knowledge/adversarial_share": adversarial.float().mean().item()}
