"""Graph neural network agents for the graph-isomorphism scenario.

Body: GIN-style message passing on each graph's dense adjacency, then
self-attention across the nodes of both graphs (so a node can be compared
with every node of the other graph), then mean pooling per graph and a
pair-invariant summary: the mean of the two graph vectors and half their
absolute difference. Heads: one
logit per node (the messages), two decision logits (reject, accept) and a
value. Pure torch; any leading batch shape.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from nip_like.agents import OBSERVATION_KEY, AgentModules, PerAgent, actor_critic_from_networks

IN_KEYS = [("agents", "adjacency"), ("agents", "node_mask"), ("agents", "messages"), OBSERVATION_KEY]
#: Where the agent dimension of each of :data:`IN_KEYS` is.
AGENT_DIMS = (-4, -3, -4, -2)


class NodeAttention(nn.Module):
    """Multi-head self-attention over a few dozen node tokens, with padding.

    Written out with plain tensor operations: for sequences this short, on the
    CPU, it runs several times faster forward and backward than
    ``nn.MultiheadAttention`` (see ``scripts/benchmark_gi.py``).

    Parameters
    ----------
    hidden_size : int
        Token width; a multiple of ``heads``.
    heads : int
        Attention heads.
    """

    def __init__(self, hidden_size: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size)
        self.out = nn.Linear(hidden_size, hidden_size)

    def forward(self, tokens: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        """Attend ``tokens`` ``(b, t, d)`` to each other, ignoring ``padding`` ``(b, t)`` keys."""
        b, t, d = tokens.shape
        h, width = self.heads, d // self.heads
        q, k, v = self.qkv(tokens).view(b, t, 3, h, width).permute(2, 0, 3, 1, 4).reshape(3, b * h, t, width)
        # The padding enters as an additive bias of the score product (one fused
        # baddbmm), which is cheaper than masking the scores afterwards.
        bias = torch.zeros(b, 1, 1, t, dtype=tokens.dtype, device=tokens.device)
        bias = bias.masked_fill(padding.view(b, 1, 1, t), torch.finfo(tokens.dtype).min)
        bias = bias.expand(b, h, t, t).reshape(b * h, t, t)
        scores = torch.baddbmm(bias, q, k.transpose(1, 2), alpha=width**-0.5)
        mixed = (scores.softmax(-1) @ v).view(b, h, t, width).transpose(1, 2).reshape(b, t, d)
        return self.out(mixed)


class GraphBody(nn.Module):
    """Node embeddings of both graphs and their pooled summary.

    Parameters
    ----------
    message_features : int
        Features per node from the message history.
    context_features : int
        Length of the flat observation (step number), broadcast to every node.
    hidden_size : int
        Width of the node embeddings.
    gin_layers : int
        Rounds of message passing.
    gin_mlp_size : int
        Hidden width of each round's two-layer MLP.
    attention_heads : int
        Heads of the cross-graph attention (``hidden_size`` must divide by it); 0 skips attention.
    """

    def __init__(
        self,
        message_features: int,
        context_features: int,
        hidden_size: int,
        gin_layers: int,
        attention_heads: int,
        gin_mlp_size: int | None = None,
    ) -> None:
        super().__init__()
        self.embed = nn.Linear(message_features + context_features, hidden_size)
        self.eps = nn.Parameter(torch.zeros(gin_layers))
        inner = gin_mlp_size or hidden_size
        self.gin = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden_size, inner), nn.ReLU(), nn.Linear(inner, hidden_size))
            for _ in range(gin_layers)
        )
        self.norms = nn.ModuleList(nn.LayerNorm(hidden_size) for _ in range(gin_layers))
        self.attention = NodeAttention(hidden_size, attention_heads) if attention_heads > 0 else None
        self.hidden_size = hidden_size

    def forward(
        self, adjacency: torch.Tensor, node_mask: torch.Tensor, messages: torch.Tensor, context: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return node embeddings ``(b, 2n, d)`` and the pair summary ``(b, 2d + context)``.

        Inputs have one leading batch dimension ``b`` (flatten before calling).
        """
        b, _, n, _ = adjacency.shape
        mask = node_mask.float().unsqueeze(-1)  # (b, 2, n, 1)
        # No graph identity among the inputs: the body treats the two graphs alike,
        # so that corresponding nodes of isomorphic graphs get equal embeddings.
        context_per_node = context.view(b, 1, 1, context.shape[-1]).expand(b, 2, n, context.shape[-1])
        inputs = torch.cat([messages, context_per_node], dim=-1)
        x = self.embed(inputs) * mask
        adj = adjacency.float()
        for index, (layer, norm) in enumerate(zip(self.gin, self.norms)):
            aggregate = adj @ x
            x = norm(x + layer((1 + self.eps[index]) * x + aggregate)) * mask
        tokens = x.reshape(b, 2 * n, self.hidden_size)
        if self.attention is not None:
            padding = ~node_mask.reshape(b, 2 * n)
            attended = self.attention(tokens, padding)
            tokens = (tokens + attended) * node_mask.reshape(b, 2 * n, 1).float()
        pooled = tokens.view(b, 2, n, self.hidden_size).sum(2) / mask.sum(2).clamp_min(1)  # (b, 2, d)
        # Pair-invariant summary (as in the NIP paper): the mean of the two graph
        # vectors and half their absolute difference. It does not depend on the
        # order of the graphs, and isomorphic graphs whose marked nodes
        # correspond give a difference of exactly zero.
        first, second = pooled.unbind(1)
        summary = torch.cat([(first + second) / 2, (first - second).abs() / 2, context], dim=-1)
        return tokens, summary


class GraphPolicy(nn.Module):
    """Logits over ``2n`` nodes, then reject and accept."""

    def __init__(self, body: GraphBody, context_features: int) -> None:
        super().__init__()
        self.body = body
        size = body.hidden_size
        self.node_head = nn.Linear(size, 1)
        self.decision_head = nn.Sequential(
            nn.Linear(2 * size + context_features, size), nn.ReLU(), nn.Linear(size, 2)
        )
        for head in (self.node_head, self.decision_head[-1]):
            nn.init.normal_(head.weight, std=0.01)
            nn.init.zeros_(head.bias)

    def forward(self, adjacency, node_mask, messages, context) -> torch.Tensor:
        lead = context.shape[:-1]
        tokens, pooled = self.body(*_flatten(adjacency, node_mask, messages, context))
        logits = torch.cat([self.node_head(tokens).squeeze(-1), self.decision_head(pooled)], dim=-1)
        return logits.reshape(*lead, logits.shape[-1])


class GraphValue(nn.Module):
    """A scalar value from the pooled summary."""

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
    agent_names: tuple[str, ...], message_features: int, context_features: int, sizes: dict
) -> AgentModules:
    """Build the graph agents: one body (or two) and heads per agent.

    Parameters
    ----------
    agent_names : tuple of str
        Agents, in the order of the agent dimension.
    message_features, context_features : int
        Sizes of the per-node message features and of the flat observation.
    sizes : dict
        Per agent: ``hidden_size``, ``gin_layers``, ``gin_mlp_size``,
        ``attention_heads`` and ``shared_body`` (the policy and value share one body).
    """
    policies, values = {}, {}
    for name in agent_names:
        size = sizes[name]

        def body() -> GraphBody:
            return GraphBody(
                message_features,
                context_features,
                size.hidden_size,
                size.gin_layers,
                size.attention_heads,
                size.gin_mlp_size or None,
            )

        policy_body = body()
        policies[name] = GraphPolicy(policy_body, context_features)
        values[name] = GraphValue(policy_body if size.shared_body else body(), context_features)
    return actor_critic_from_networks(
        agent_names, PerAgent(policies, AGENT_DIMS, active_only=True), PerAgent(values, AGENT_DIMS), IN_KEYS
    )
