"""Graph neural network agents for the graph-isomorphism scenario.

The architecture follows the NIP paper's agents (Hammond and Adam-Day):

1. **GIN** message passing on each graph's dense adjacency. A node's input is
   the message history the agent can see, encoded by *exchange* by default: a
   node the verifier sent as its ``k``-th query and a node a prover sent in
   answer to it share input channel ``k`` (:func:`exchange_marks`), so that a
   query and a faithful answer look alike and the refinement compares the
   graphs with the pair individualised (the ``steps`` encoding keeps one
   channel per step and sender, as the environment reports them).
2. **Pair tokens**: each graph is sum-pooled, and the two graph vectors
   become two pair-invariant tokens, their mean and half their absolute
   difference (the same whichever graph comes first, and a difference of
   zero, up to float rounding, for isomorphic graphs whose marked nodes
   correspond).
3. **Cross-graph transformer**: one post-norm encoder layer over the two pair
   tokens and the ``2n`` node tokens, each with flags for which pair token it
   is and whether its node was in the most recent message. A node attends only
   to the nodes of the other graph and to the pair tokens (so that it can look
   for its counterpart), a pair token to everything (attention pooling).
4. **Heads**: a node head on each node token; a decision head (continue,
   reject, accept) and a value head on the two pair tokens and the step number.

Pure torch; any leading batch shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nip_like.allowed import checked
from nip_like.agent_modules import AgentModules, PerAgent, actor_critic_from_networks
from nip_like.keys import OBSERVATION_KEY
from nip_like.distributions import GroupedMaskedCategorical, masked_log_softmax

IN_KEYS = [("agents", "adjacency"), ("agents", "node_mask"), ("agents", "messages"), OBSERVATION_KEY]
#: Where the agent dimension of each of :data:`IN_KEYS` is.
AGENT_DIMS = (-4, -3, -4, -2)
#: Pair tokens (mean, half difference) before the node tokens.
PAIR_TOKENS = 2
#: Node-input encodings of the message history (:func:`exchange_marks`).
MESSAGE_ENCODINGS = ("exchanges", "steps")


@dataclass
class GraphAgentConfig:
    """Size of one graph-isomorphism agent's networks (:func:`build_graph_agents`)."""

    hidden_size: int = checked(32, ge=1)  # width of the node embeddings
    gin_layers: int = checked(2, ge=1)  # rounds of GIN message passing
    gin_mlp_size: int = checked(0, ge=0)  # hidden width of each GIN layer's two-layer MLP; 0 means hidden_size
    attention_heads: int = checked(2, ge=0)  # heads of the cross-graph transformer layer; 0 leaves the layer out
    transformer_mlp_size: int = checked(0, ge=0)  # hidden width of the transformer's feed-forward block; 0 means 4 * hidden_size
    message_encoding: str = checked("exchanges", choices=MESSAGE_ENCODINGS)  # node inputs: "exchanges" (a query and its answers share a channel) or "steps"
    shared_body: bool = False  # the policy and value heads share one body


class CrossGraphEncoderLayer(nn.Module):
    """A post-norm transformer encoder layer with an attention mask.

    Self-attention (``heads`` heads, :func:`torch.nn.functional.scaled_dot_product_attention`),
    residual and layer norm, then a ReLU feed-forward block of width
    ``mlp_size``, residual and layer norm.

    Parameters
    ----------
    hidden_size : int
        Token width; a multiple of ``heads``.
    heads : int
        Attention heads.
    mlp_size : int
        Hidden width of the feed-forward block.
    """

    def __init__(self, hidden_size: int, heads: int, mlp_size: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size)
        self.out = nn.Linear(hidden_size, hidden_size)
        self.attention_norm = nn.LayerNorm(hidden_size)
        self.feed_forward = nn.Sequential(nn.Linear(hidden_size, mlp_size), nn.ReLU(), nn.Linear(mlp_size, hidden_size))
        self.feed_forward_norm = nn.LayerNorm(hidden_size)

    def forward(self, tokens: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """Encode ``tokens`` ``(b, t, d)``; a token attends to the keys that ``allowed`` ``(b, 1, t, t)`` marks."""
        b, t, d = tokens.shape
        h = self.heads
        flat = tokens.reshape(b * t, d)
        q, k, v = self.qkv(flat).view(b, t, 3, h, d // h).permute(2, 0, 3, 1, 4)
        mixed = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        x = self.attention_norm(flat + self.out(mixed.transpose(1, 2).reshape(b * t, d)))
        x = self.feed_forward_norm(x + self.feed_forward(x))
        return x.view(b, t, d)


def cross_graph_attention(node_mask: torch.Tensor) -> torch.Tensor:
    """Which keys each of :class:`GraphBody`'s tokens attends to: ``(b, 1, 2 + 2n, 2 + 2n)`` bool.

    No token attends to an absent node, and a node token does not attend to
    the nodes of its own graph (itself included). Pair tokens attend to every
    present token, and every token to the pair tokens, so no row is empty.

    Parameters
    ----------
    node_mask : torch.Tensor
        ``(b, 2, n)`` bool: which nodes exist.
    """
    b, _, n = node_mask.shape
    device = node_mask.device
    # Graph of each token: -1 for the pair tokens, 0 or 1 for the nodes.
    graph = torch.cat([torch.full((PAIR_TOKENS,), -1, device=device), torch.arange(2, device=device).repeat_interleave(n)])
    same_graph = (graph.unsqueeze(1) == graph.unsqueeze(0)) & (graph >= 0).unsqueeze(1)
    present = torch.cat([node_mask.new_ones(b, PAIR_TOKENS), node_mask.reshape(b, 2 * n)], dim=1)
    return (~same_graph & present.unsqueeze(1)).unsqueeze(1)  # query, key


def exchange_marks(messages: torch.Tensor, steps: int, verifier: int) -> torch.Tensor:
    """Re-encode a message history by exchange: ``(b, 2, n, steps * agents) -> (b, 2, n, steps + 1)``.

    An exchange is a verifier's node and the provers' nodes that follow it
    until its next one. The exchange of a message sent at step ``t`` is the
    number of nodes the verifier has sent at steps up to and including ``t``:
    the verifier's ``k``-th node (``k`` from 1) and the answers to it share
    channel ``k``; channel 0 holds prover nodes sent before any verifier node
    (a prover that speaks first). Only the messages the agent can see count.

    Parameters
    ----------
    messages : torch.Tensor
        ``(b, 2, n, steps * agents)``: entry ``t * agents + j`` of a node is 1
        if agent ``j`` sent it at step ``t`` (the environment's encoding).
    steps : int
        Steps per episode.
    verifier : int
        Index of the verifier in the agent dimension.
    """
    b, _, n, channels = messages.shape
    history = messages.view(b, 2, n, steps, channels // steps)
    verifier_sent = history[..., verifier].sum((1, 2)) > 0  # (b, steps)
    exchange = F.one_hot(verifier_sent.long().cumsum(-1), steps + 1).to(messages.dtype)  # (b, steps, steps + 1)
    return torch.einsum("bgnta,btk->bgnk", history, exchange)


def most_recent_message(messages: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
    """``(b, 2, n)``: 1 for the nodes that the agent saw sent at the step before the current one.

    Parameters
    ----------
    messages : torch.Tensor
        ``(b, 2, n, steps * agents)`` in the environment's encoding.
    context : torch.Tensor
        ``(b, steps + 1)``: the one-hot current step; shifted by one, it picks
        the channels of the step before (none at step 0).
    """
    b, _, n, features = messages.shape
    steps = context.shape[-1] - 1
    return torch.einsum("bgnta,bt->bgn", messages.view(b, 2, n, steps, features // steps), context[:, 1:])


class GraphBody(nn.Module):
    """Node tokens and pair tokens of a graph pair (see the module docstring).

    Parameters
    ----------
    message_features : int
        Features per node from the message history (steps x agents).
    hidden_size : int
        Width of the node embeddings and tokens.
    gin_layers : int
        Rounds of message passing.
    attention_heads : int
        Heads of the cross-graph transformer layer (``hidden_size`` must
        divide by it); 0 leaves the layer out (the pair tokens are then the
        pooled vectors themselves).
    gin_mlp_size : int, optional
        Hidden width of each round's two-layer MLP (default ``hidden_size``).
    transformer_mlp_size : int, optional
        Hidden width of the transformer's feed-forward block (default ``4 * hidden_size``).
    exchanges_of : tuple of int, optional
        ``(steps, verifier)``: encode the message history by exchange
        (:func:`exchange_marks`) for an episode of ``steps`` steps and the
        verifier at this index. None keeps the environment's encoding.
    """

    def __init__(
        self,
        message_features: int,
        hidden_size: int,
        gin_layers: int,
        attention_heads: int,
        gin_mlp_size: int | None = None,
        transformer_mlp_size: int | None = None,
        exchanges_of: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        self.exchanges_of = exchanges_of
        node_features = message_features if exchanges_of is None else exchanges_of[0] + 1
        self.embed = nn.Linear(node_features, hidden_size)
        self.eps = nn.Parameter(torch.zeros(gin_layers))
        inner = gin_mlp_size or hidden_size
        self.gin = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden_size, inner), nn.ReLU(), nn.Linear(inner, hidden_size))
            for _ in range(gin_layers)
        )
        self.norms = nn.ModuleList(nn.LayerNorm(hidden_size) for _ in range(gin_layers))
        self.transformer = None
        if attention_heads > 0:
            # Token flags: which pair token (two), and whether the node was in the most recent message.
            self.token_encoder = nn.Linear(hidden_size + PAIR_TOKENS + 1, hidden_size)
            self.transformer = CrossGraphEncoderLayer(
                hidden_size, attention_heads, transformer_mlp_size or 4 * hidden_size
            )
        self.hidden_size = hidden_size

    def message_passing(self, adjacency: torch.Tensor, node_mask: torch.Tensor, messages: torch.Tensor) -> torch.Tensor:
        """Return the GIN node embeddings ``(b, 2, n, d)``.

        Inputs have one leading batch dimension ``b``; ``messages`` in the
        environment's encoding. Absent nodes' embeddings are zero.
        """
        b, _, n, _ = adjacency.shape
        d, rows = self.hidden_size, 2 * b * n
        if self.exchanges_of is not None:
            messages = exchange_marks(messages, *self.exchanges_of)
        x = self.embed(messages.reshape(rows, messages.shape[-1]))
        # Absent nodes have no edges, so nothing flows from them into present
        # nodes: they are masked once, at the end, not after every layer.
        adjacency = adjacency.reshape(2 * b, n, n).to(x.dtype)
        scales = 1 + self.eps
        for index, (layer, norm) in enumerate(zip(self.gin, self.norms)):
            aggregate = torch.bmm(adjacency, x.view(2 * b, n, d)).view(rows, d)
            x = norm(x + layer(torch.addcmul(aggregate, x, scales[index])))
        return x.view(b, 2, n, d) * node_mask.unsqueeze(-1).to(x.dtype)

    def pair_tokens(
        self, adjacency: torch.Tensor, node_mask: torch.Tensor, messages: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the GIN node embeddings ``(b, 2n, d)`` and the two pair tokens ``(b, 2, d)``.

        The pair tokens are the mean of the two graphs' summed embeddings and
        half their absolute difference.
        """
        nodes = self.message_passing(adjacency, node_mask, messages)
        b, _, n, d = nodes.shape
        first, second = nodes.sum(2).unbind(1)
        pair = torch.stack([(first + second) / 2, (first - second).abs() / 2], dim=1)
        return nodes.view(b, 2 * n, d), pair

    def forward(
        self, adjacency: torch.Tensor, node_mask: torch.Tensor, messages: torch.Tensor, context: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return node tokens ``(b, 2n, d)`` and the summary ``(b, 2d + context)`` (pair tokens, step).

        Inputs have one leading batch dimension ``b`` (flatten before calling).
        """
        b, _, n, _ = messages.shape
        nodes, pair = self.pair_tokens(adjacency, node_mask, messages)
        if self.transformer is not None:
            recent = most_recent_message(messages, context)
            # Flags: pair token 0 or 1; node in the most recent message.
            pair_flags = torch.eye(PAIR_TOKENS, dtype=pair.dtype, device=pair.device).expand(b, -1, -1)
            tokens = torch.cat(
                [
                    torch.cat([pair, pair_flags, pair.new_zeros(b, PAIR_TOKENS, 1)], dim=-1),
                    torch.cat([nodes, nodes.new_zeros(b, 2 * n, PAIR_TOKENS), recent.reshape(b, 2 * n, 1)], dim=-1),
                ],
                dim=1,
            )
            tokens = self.transformer(self.token_encoder(tokens), cross_graph_attention(node_mask))
            pair, nodes = tokens[:, :PAIR_TOKENS], tokens[:, PAIR_TOKENS:]
        return nodes, torch.cat([pair.reshape(b, PAIR_TOKENS * self.hidden_size), context], dim=-1)


class GraphPolicy(nn.Module):
    """Joint log-probabilities of the ``2n`` nodes, reject and accept, in two stages.

    As the NIP paper's agents, a decision head chooses between continuing,
    rejecting and accepting (from the summary), and a node head chooses the
    node to send when continuing (from each node token). The joint
    log-probability of node ``v`` is ``log p(continue) + log p(v)``; absent
    nodes get none. An agent that may not decide (a prover, or the verifier
    before ``min_rounds``) has the decision masked, and the masked categorical
    renormalises over the nodes, so its node distribution is the node head's.
    At initialisation the three choices are about equally likely.
    """

    def __init__(self, body: GraphBody, context_features: int) -> None:
        super().__init__()
        self.body = body
        size = body.hidden_size
        self.node_head = nn.Sequential(nn.Linear(size, size), nn.ReLU(), nn.Linear(size, 1))
        self.decision_head = nn.Sequential(
            nn.Linear(2 * size + context_features, size), nn.ReLU(), nn.Linear(size, 3)
        )
        for head in (self.node_head[-1], self.decision_head[-1]):
            nn.init.normal_(head.weight, std=0.01)
            nn.init.zeros_(head.bias)

    def forward(self, adjacency, node_mask, messages, context) -> torch.Tensor:
        lead = context.shape[:-1]
        adjacency, node_mask, messages, context = _flatten(adjacency, node_mask, messages, context)
        tokens, summary = self.body(adjacency, node_mask, messages, context)
        nodes = masked_log_softmax(self.node_head(tokens).squeeze(-1), node_mask.flatten(1))
        continue_reject_accept = self.decision_head(summary).log_softmax(-1)
        logits = torch.cat([continue_reject_accept[:, :1] + nodes, continue_reject_accept[:, 1:]], dim=-1)
        return logits.reshape(*lead, logits.shape[-1])


class GraphValue(nn.Module):
    """A scalar value from the summary (pair tokens and step number)."""

    def __init__(self, body: GraphBody, context_features: int) -> None:
        super().__init__()
        self.body = body
        size = body.hidden_size
        self.head = nn.Sequential(nn.Linear(2 * size + context_features, size), nn.ReLU(), nn.Linear(size, 1))

    def forward(self, adjacency, node_mask, messages, context) -> torch.Tensor:
        lead = context.shape[:-1]
        _, pooled = self.body(*_flatten(adjacency, node_mask, messages, context))
        return self.head(pooled).reshape(*lead, 1)


def _flatten(adjacency, node_mask, messages, context):
    lead = context.shape[:-1]
    b = math.prod(lead)
    n = adjacency.shape[-1]
    return (
        adjacency.reshape(b, 2, n, n),
        node_mask.reshape(b, 2, n),
        messages.reshape(b, 2, n, messages.shape[-1]),
        context.reshape(b, context.shape[-1]),
    )


def build_graph_agents(
    agent_names: tuple[str, ...],
    max_nodes: int,
    message_features: int,
    context_features: int,
    sizes: dict,
    verifier: int,
) -> AgentModules:
    """Build the graph agents: one body (or two) and heads per agent.

    Parameters
    ----------
    agent_names : tuple of str
        Agents, in the order of the agent dimension.
    max_nodes : int
        Nodes per graph (``n``); the action space is ``2n`` nodes, reject and accept.
    message_features, context_features : int
        Sizes of the per-node message features and of the flat observation.
    sizes : dict
        Per agent: ``hidden_size``, ``gin_layers``, ``gin_mlp_size``,
        ``attention_heads``, ``transformer_mlp_size``, ``message_encoding``
        (``"exchanges"`` or ``"steps"``) and ``shared_body`` (the policy and
        value share one body).
    verifier : int
        Index of the verifier among the agents (the ``exchanges`` encoding
        counts its nodes).

    Notes
    -----
    The actions follow a :class:`~nip_like.distributions.GroupedMaskedCategorical`
    whose group is the ``2n`` nodes: the greedy action (evaluation, test) first
    chooses between sending a node, rejecting and accepting, then the node.
    """
    policies, values = {}, {}
    for name in agent_names:
        size = sizes[name]
        exchanges_of = (context_features - 1, verifier) if size.message_encoding == "exchanges" else None

        def body() -> GraphBody:
            return GraphBody(
                message_features,
                size.hidden_size,
                size.gin_layers,
                size.attention_heads,
                size.gin_mlp_size or None,
                size.transformer_mlp_size or None,
                exchanges_of,
            )

        policy_body = body()
        policies[name] = GraphPolicy(policy_body, context_features)
        values[name] = GraphValue(policy_body if size.shared_body else body(), context_features)
    return actor_critic_from_networks(
        agent_names,
        PerAgent(policies, AGENT_DIMS, active_only=True),
        PerAgent(values, AGENT_DIMS),
        IN_KEYS,
        distribution_class=GroupedMaskedCategorical,
        distribution_kwargs={"group_size": 2 * max_nodes},
    )
