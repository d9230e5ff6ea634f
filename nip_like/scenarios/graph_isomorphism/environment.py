"""The graph-isomorphism environment: provers and a verifier exchange nodes.

Each episode draws a pair of graphs (same number of nodes, at most ``n``)
from a dataset. Every agent sees both graphs. An action is one of ``2 n + 2``:
a node of graph 0 (``0 .. n-1``), a node of graph 1 (``n .. 2n-1``), *reject*
(``2n``) or *accept* (``2n + 1``). Provers send nodes; the verifier sends a
node (and so lets the turn pass) or decides, when the protocol allows
(:class:`~nip_like.protocols.proof.ProofProtocol`). Absent nodes are never
legal; on its last turn the verifier must decide.

Per-agent entries (``B`` episodes, ``N`` agents, ``T`` steps per episode):

====================================  ====================  ==========================================
key                                   shape                 meaning
====================================  ====================  ==========================================
``("agents", "adjacency")``           ``B, N, 2, n, n``     the two graphs (bool, symmetric)
``("agents", "node_mask")``           ``B, N, 2, n``        which nodes exist
``("agents", "messages")``            ``B, N, 2, n, T*N``   message history the agent can see: entry
                                                            ``[g, v, t*N + j]`` is 1 if agent ``j``
                                                            sent node ``v`` of graph ``g`` in step ``t``
                                                            and the agent shares a channel with ``j``
``("agents", "observation")``         ``B, N, T + 1``       one-hot step number (``T``: finished)
====================================  ====================  ==========================================

State (under ``"state"``): ``pair_index``, ``adjacency``, ``node_mask``,
``label`` (True: isomorphic, the verifier should accept), ``sent`` (``B, T,
N`` node actions, -1 for none) and ``decision`` (-1 none, 0 reject, 1 accept).

Zero-knowledge protocols (``protocol.zero_knowledge=true``,
:mod:`nip_like.protocols.zero_knowledge`): the transcript holds the ``M``
agents of the base protocol (``sent`` is ``B, T, M`` and the message history
``T*M`` channels wide). In an episode of the second verifier its nodes and
decision take the verifier's place, so the provers see them as the verifier's
and the second verifier sees the verifier's view. The simulator's nodes are
kept apart (``simulated``, ``B, T``); its view is the verifier's view of a
transcript holding its own nodes in the verifier's place and nothing else.
Each step of the second verifier adds the total-variation distance between
its action distribution and the simulator's (read from the policy's
``("agents", "logits")`` in the step's input) to ``zk_distance`` and one to
``zk_turns``, and the protocol turns it into rewards.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from tensordict import TensorDict, TensorDictBase
from torchrl.data import Binary, Unbounded

from nip_like.keys import ACTION_MASK_KEY, LOGITS_KEY
from nip_like.protocols.proof import ProofProtocol
from nip_like.protocols.zero_knowledge import ADVERSARIAL_KEY
from nip_like.scenarios.environment import InteractionEnv


class GraphIsomorphismEnv(InteractionEnv):
    """Vectorised graph-isomorphism interactive proof (see the module docstring).

    Parameters
    ----------
    protocol : ProofProtocol
        Turns, channels and rewards.
    adjacency : torch.Tensor
        ``(P, 2, n, n)`` bool: the dataset's graph pairs.
    node_mask : torch.Tensor
        ``(P, 2, n)`` bool.
    label : torch.Tensor
        ``(P,)`` bool: True for isomorphic pairs.
    num_envs : int
        Parallel episodes.
    device : torch.device or str
        Where the tensors live (the dataset is moved there).
    seed : int
        Seed of the environment's generator.
    group_size : int
        Consecutive environments that play the same pair.
    prover_answers_other_graph : bool
        Restrict a prover's node to the graph that the verifier's most recent
        node is not in (as in the NIP paper), so that each prover message
        answers "this node corresponds to that one". No restriction before the
        verifier has sent a node.
    """

    def __init__(
        self,
        protocol: ProofProtocol,
        adjacency: torch.Tensor,
        node_mask: torch.Tensor,
        label: torch.Tensor,
        num_envs: int,
        device: torch.device | str = "cpu",
        seed: int = 0,
        group_size: int = 1,
        prover_answers_other_graph: bool = False,
    ) -> None:
        self.prover_answers_other_graph = prover_answers_other_graph
        self.max_nodes = int(adjacency.shape[-1])
        self.num_pairs = int(adjacency.shape[0])
        self.data = {"adjacency": adjacency.bool(), "node_mask": node_mask.bool(), "label": label.bool()}
        self.verifier_index = protocol.verifier_index
        self.num_steps = protocol.num_rounds
        self.visibility = protocol.visibility()
        self.zero_knowledge = protocol.zero_knowledge
        #: Agents whose messages make up the transcript (the base protocol's).
        self.transcript_agents = len(protocol.transcript_agent_names)
        self._step_policy: tuple[torch.Tensor | None, torch.Tensor] | None = None
        super().__init__(
            protocol,
            num_envs=num_envs,
            num_actions=2 * self.max_nodes + 2,
            observation_size=protocol.num_rounds + 1,
            device=device,
            seed=seed,
            group_size=group_size,
        )
        self.data = {key: value.to(self.device) for key, value in self.data.items()}
        self.visibility = self.visibility.to(self.device)

    @property
    def reject_action(self) -> int:
        """The verifier's *reject* action."""
        return 2 * self.max_nodes

    @property
    def accept_action(self) -> int:
        """The verifier's *accept* action."""
        return 2 * self.max_nodes + 1

    # ----------------------------------------------------------------- specs
    def _state_spec(self) -> dict[str, object]:
        b, n, device = self.batch_size, self.max_nodes, self.device
        return {
            "pair_index": Unbounded(shape=b, dtype=torch.int64, device=device),
            "adjacency": Binary(shape=(*b, 2, n, n), dtype=torch.bool, device=device),
            "node_mask": Binary(shape=(*b, 2, n), dtype=torch.bool, device=device),
            "label": Binary(shape=b, dtype=torch.bool, device=device),
            "sent": Unbounded(shape=(*b, self.num_steps, self.transcript_agents), dtype=torch.int64, device=device),
            "decision": Unbounded(shape=b, dtype=torch.int64, device=device),
            **(
                {
                    "simulated": Unbounded(shape=(*b, self.num_steps), dtype=torch.int64, device=device),
                    "zk_distance": Unbounded(shape=b, device=device),
                    "zk_turns": Unbounded(shape=b, dtype=torch.int64, device=device),
                }
                if self.zero_knowledge
                else {}
            ),
        }

    def _agent_observation_spec(self) -> dict[str, object]:
        agents, n, device = (*self.batch_size, self.num_agents), self.max_nodes, self.device
        return {
            "adjacency": Binary(shape=(*agents, 2, n, n), dtype=torch.bool, device=device),
            "node_mask": Binary(shape=(*agents, 2, n), dtype=torch.bool, device=device),
            "messages": Unbounded(shape=(*agents, 2, n, self.num_steps * self.transcript_agents), device=device),
        }

    # ------------------------------------------------------------ the game
    def _new_state(self, num_episodes: int) -> TensorDict:
        index = torch.randint(0, self.num_pairs, (num_episodes,), generator=self.rng).to(self.device)
        return TensorDict(
            {
                "pair_index": index,
                "adjacency": self.data["adjacency"][index],
                "node_mask": self.data["node_mask"][index],
                "label": self.data["label"][index],
                "sent": torch.full((num_episodes, self.num_steps, self.transcript_agents), -1, device=self.device),
                "decision": torch.full((num_episodes,), -1, device=self.device),
                **(self._new_zero_knowledge_state(num_episodes) if self.zero_knowledge else {}),
            },
            batch_size=[num_episodes],
            device=self.device,
        )

    def _new_zero_knowledge_state(self, num_episodes: int) -> dict[str, torch.Tensor]:
        return {
            "simulated": torch.full((num_episodes, self.num_steps), -1, device=self.device),
            "zk_distance": torch.zeros(num_episodes, device=self.device),
            "zk_turns": torch.zeros(num_episodes, dtype=torch.int64, device=self.device),
        }

    def _observe(self, state: TensorDictBase) -> tuple[torch.Tensor, torch.Tensor]:
        round_index = state["round"]
        batch = round_index.shape[0]
        observation = F.one_hot(round_index.clamp(max=self.num_steps), self.num_steps + 1).float()
        observation = observation.unsqueeze(1).expand(batch, self.num_agents, -1)
        nodes = state["node_mask"].reshape(batch, 2 * self.max_nodes)
        may_decide = self.protocol.may_decide(round_index)
        must_decide = round_index >= self.num_steps - 1
        mask = torch.zeros(batch, self.transcript_agents, self.num_actions, dtype=torch.bool, device=self.device)
        mask[..., : 2 * self.max_nodes] = nodes.unsqueeze(1)
        verifier = self.verifier_index
        mask[:, verifier, : 2 * self.max_nodes] &= ~must_decide.unsqueeze(-1)
        mask[:, verifier, 2 * self.max_nodes :] = (may_decide | must_decide).unsqueeze(-1)
        if self.prover_answers_other_graph:
            provers = [index for index in range(self.transcript_agents) if index != verifier]
            mask[:, provers, : 2 * self.max_nodes] &= self._answer_graph(state["sent"][..., verifier]).unsqueeze(1)
        if self.zero_knowledge:
            # The second verifier and the simulator choose as the verifier does.
            mask = torch.cat([mask, mask[:, [verifier, verifier]]], dim=1)
        return observation.contiguous(), mask

    def _answer_graph(self, verifier_sent: torch.Tensor) -> torch.Tensor:
        """``(B, 2n)``: the nodes outside the graph of the verifier's last node (all before its first)."""
        n = self.max_nodes
        steps = torch.arange(self.num_steps, device=self.device)
        last_step = torch.where(verifier_sent >= 0, steps, -1).amax(-1)
        last_node = verifier_sent.gather(1, last_step.clamp(min=0).unsqueeze(1))  # (B, 1)
        node_graph = torch.arange(2 * n, device=self.device) >= n
        return (node_graph != (last_node >= n)) | (last_step < 0).unsqueeze(1)

    def _observe_extra(self, state: TensorDictBase) -> dict[str, torch.Tensor]:
        batch, n = state.batch_size[0], self.max_nodes
        messages = self._message_history(state["sent"])
        if self.zero_knowledge:
            # The second verifier sees the verifier's view; the simulator the verifier's view of its own nodes alone.
            alone = torch.full_like(state["sent"], -1)
            alone[..., self.verifier_index] = state["simulated"]
            simulated = self._message_history(alone)[:, self.verifier_index]
            messages = torch.cat([messages, messages[:, self.verifier_index].unsqueeze(1), simulated.unsqueeze(1)], dim=1)
        expand = (batch, self.num_agents)
        return {
            "adjacency": state["adjacency"].unsqueeze(1).expand(*expand, 2, n, n),
            "node_mask": state["node_mask"].unsqueeze(1).expand(*expand, 2, n),
            "messages": messages,
        }

    def _message_history(self, sent: torch.Tensor) -> torch.Tensor:
        """``(B, M, 2, n, T*M)``: each transcript agent's visible message history from ``sent`` ``(B, T, M)``."""
        batch, agents, n = sent.shape[0], self.transcript_agents, self.max_nodes
        one_hot = F.one_hot((sent + 1).clamp(min=0), 2 * n + 1)[..., 1:].float()  # (B, T, M_sender, 2n)
        # visible[i, j]: agent i sees agent j's messages.
        seen = one_hot.unsqueeze(1) * self.visibility.view(1, agents, 1, agents, 1).float()  # (B, M, T, M, 2n)
        return seen.permute(0, 1, 4, 2, 3).reshape(batch, agents, 2, n, self.num_steps * agents)

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        # A zero-knowledge protocol rewards the distance between two agents' action distributions:
        # keep the policy's logits and masks of the step for _advance.
        if self.zero_knowledge:
            self._step_policy = (tensordict.get(LOGITS_KEY, None), tensordict.get(ACTION_MASK_KEY))
        try:
            return super()._step(tensordict)
        finally:
            self._step_policy = None

    def _zero_knowledge_step(
        self, state: TensorDictBase, action: torch.Tensor, active: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Put the second verifier in the verifier's place, record the simulator; return transcript actions,
        transcript active flags and the step's simulator distance (0 where the second verifier did not act)."""
        verifier, adversary, simulator = self.verifier_index, self.protocol.adversarial_index, self.protocol.simulator_index
        adversarial = state[ADVERSARIAL_KEY]
        transcript_action = action[:, : self.transcript_agents].clone()
        transcript_active = active[:, : self.transcript_agents].clone()
        transcript_action[:, verifier] = torch.where(adversarial, action[:, adversary], action[:, verifier])
        transcript_active[:, verifier] = active[:, verifier] | active[:, adversary]
        step = state["round"].clamp(max=self.num_steps - 1)
        simulated = torch.where(active[:, simulator] & (action[:, simulator] < 2 * self.max_nodes), action[:, simulator], -1)
        state["simulated"] = state["simulated"].scatter(1, step.view(-1, 1), simulated.unsqueeze(1))
        acted = active[:, adversary]
        distance = torch.zeros(action.shape[0], device=self.device)
        if acted.any():
            logits, mask = self._step_policy if self._step_policy is not None else (None, None)
            if logits is None:
                raise RuntimeError(
                    "a zero-knowledge protocol needs the policy's ('agents', 'logits') in each step's input "
                    "to measure the simulator's distance; step the environment with the agents' policy"
                )
            distance = torch.where(acted, self.protocol.simulator_distance(logits, mask), distance)
        state["zk_distance"] = state["zk_distance"] + distance
        state["zk_turns"] = state["zk_turns"] + acted.long()
        return transcript_action, transcript_active, distance

    def _advance(
        self, state: TensorDictBase, action: torch.Tensor, active: torch.Tensor
    ) -> tuple[TensorDictBase, torch.Tensor, torch.Tensor]:
        if self.zero_knowledge:
            action, active, distance = self._zero_knowledge_step(state, action, active)
        round_index = state["round"]
        node_action = action < 2 * self.max_nodes
        verifier_acted = active[:, self.verifier_index]
        decided = verifier_acted & ~node_action[:, self.verifier_index]
        accept = action[:, self.verifier_index] == self.accept_action
        # Record each active agent's node; a decision is not a message.
        step = round_index.clamp(max=self.num_steps - 1)
        sent = torch.where(active & node_action, action, torch.full_like(action, -1))
        state["sent"] = state["sent"].scatter(1, step.view(-1, 1, 1).expand(-1, 1, self.transcript_agents), sent.unsqueeze(1))
        state["decision"] = torch.where(decided, accept.long(), state["decision"])
        reward = self.protocol.step_rewards(decided, accept, state["label"], verifier_acted)
        if self.zero_knowledge:
            reward = self.protocol.zero_knowledge_rewards(reward, state[ADVERSARIAL_KEY], distance)
        return state, reward, decided
