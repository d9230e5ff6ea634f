"""Per-agent networks and the TorchRL actor and critic built from them.

Each agent has its own parameters (its own ``nn.Module``), so that learning
rates, gradient clipping and update schedules can differ between agents. The
modules still read and write the stacked ``("agents", ...)`` entries, with the
agent dimension last in the batch shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Mapping

import torch
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.modules import MaskedCategorical, ProbabilisticActor

from nip_like.allowed import checked
from nip_like.keys import ACTION_KEY, ACTION_MASK_KEY, ACTIVE_KEY, LOG_PROB_KEY, LOGITS_KEY, OBSERVATION_KEY, VALUE_KEY


@dataclass
class AgentNetConfig:
    """Size of one agent's MLP networks (:func:`mlp`)."""

    hidden_size: int = checked(64, ge=1)  # width of each hidden layer
    num_layers: int = checked(2, ge=0)  # hidden layers in the policy and value networks


class PerAgent(nn.Module):
    """Apply one network per agent along the agent dimension.

    Parameters
    ----------
    networks : Mapping[str, nn.Module]
        One network per agent, in the order of the agent dimension.
    agent_dims : tuple of int
        For each input, the (negative) position of its agent dimension.
    active_only : bool
        If True, ``forward`` takes one more input, last: the ``(*batch,
        num_agents)`` boolean active mask (``("agents", "active")``), and
        each agent's network runs only on the rows where that agent acts;
        the other rows of the output are zeros. Every learning signal in
        nip_like masks inactive agents' actions out, so this changes no
        result and saves the compute of the agents that wait (half of it
        when two agents alternate).

    Notes
    -----
    By default ``forward`` takes one tensor of shape ``(*batch, num_agents,
    features)`` and returns ``(*batch, num_agents, out_features)``. With
    several inputs (graphs, masks, ...), ``agent_dims`` says where each one's
    agent dimension is; each network gets its agent's slices, in order. With
    ``active_only``, a network gets its rows flattened to one batch dimension,
    possibly empty, and must accept that.
    """

    def __init__(
        self, networks: Mapping[str, nn.Module], agent_dims: tuple[int, ...] = (-2,), active_only: bool = False
    ) -> None:
        super().__init__()
        self.agent_names = tuple(networks)
        self.networks = nn.ModuleDict(networks)
        self.agent_dims = tuple(agent_dims)
        self.active_only = active_only

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        if self.active_only:
            *inputs, active = inputs
            return self._forward_active(inputs, active)
        outputs = [
            self.networks[name](*(x.select(dim, index) for x, dim in zip(inputs, self.agent_dims)))
            for index, name in enumerate(self.agent_names)
        ]
        return torch.stack(outputs, dim=-2)

    def _forward_active(self, inputs: list[torch.Tensor], active: torch.Tensor) -> torch.Tensor:
        outputs = []
        for index, name in enumerate(self.agent_names):
            acts = active[..., index]
            out = self.networks[name](*(x.select(dim, index)[acts] for x, dim in zip(inputs, self.agent_dims)))
            full = out.new_zeros(*acts.shape, *out.shape[1:])
            full[acts] = out
            outputs.append(full)
        return torch.stack(outputs, dim=-2)


def mlp(in_features: int, out_features: int, hidden_size: int, num_layers: int) -> nn.Sequential:
    """Build a tanh MLP with orthogonal initialisation (small last layer).

    Parameters
    ----------
    in_features, out_features : int
        Input and output sizes.
    hidden_size : int
        Width of each hidden layer.
    num_layers : int
        Number of hidden layers (0 gives a linear map).
    """
    layers: list[nn.Module] = []
    size = in_features
    for _ in range(num_layers):
        linear = nn.Linear(size, hidden_size)
        nn.init.orthogonal_(linear.weight, gain=2**0.5)
        nn.init.zeros_(linear.bias)
        layers += [linear, nn.Tanh()]
        size = hidden_size
    head = nn.Linear(size, out_features)
    nn.init.orthogonal_(head.weight, gain=0.01)
    nn.init.zeros_(head.bias)
    layers.append(head)
    return nn.Sequential(*layers)


@dataclass
class AgentModules:
    """The trainable parts of a scenario's agents.

    Attributes
    ----------
    policy : ProbabilisticActor
        Reads ``("agents", "observation")`` and ``("agents", "action_mask")``;
        writes ``("agents", "logits")``, ``("agents", "action")`` and
        ``("agents", "action_log_prob")``.
    value : TensorDictModule
        Reads ``("agents", "observation")``; writes ``("agents", "state_value")``.
    agent_names : tuple of str
        Names of the agents, in the order of the agent dimension.
    """

    policy: ProbabilisticActor
    value: TensorDictModule
    agent_names: tuple[str, ...]

    def agent_parameters(self, name: str) -> Iterator[nn.Parameter]:
        """Yield the parameters (policy and value) that belong to agent ``name``, each once.

        A body shared by an agent's policy and value networks is yielded once.
        """
        seen: set[int] = set()
        for module in (self.policy, self.value):
            for per_agent in module.modules():
                if isinstance(per_agent, PerAgent):
                    for param in per_agent.networks[name].parameters():
                        if id(param) not in seen:
                            seen.add(id(param))
                            yield param

    def modules(self) -> nn.ModuleDict:
        """Return the policy and value as one module (for state dicts and devices)."""
        return nn.ModuleDict({"policy": self.policy, "value": self.value})


def build_actor_critic(
    agent_names: tuple[str, ...],
    observation_size: int,
    num_actions: int,
    network: Callable[[str, int, int], nn.Module],
) -> AgentModules:
    """Build a masked-categorical actor and a critic with one network per agent.

    Parameters
    ----------
    agent_names : tuple of str
        Agents, in the order of the agent dimension.
    observation_size : int
        Length of each agent's observation vector.
    num_actions : int
        Size of the shared action space.
    network : callable
        ``network(agent_name, in_features, out_features)`` returns the module of
        one agent (called for the policy and for the value).
    """
    policy_net = PerAgent({name: network(name, observation_size, num_actions) for name in agent_names})
    value_net = PerAgent({name: network(name, observation_size, 1) for name in agent_names})
    return actor_critic_from_networks(agent_names, policy_net, value_net, [OBSERVATION_KEY])


def actor_critic_from_networks(
    agent_names: tuple[str, ...],
    policy_net: PerAgent,
    value_net: PerAgent,
    in_keys: list,
    distribution_class: type[MaskedCategorical] = MaskedCategorical,
    distribution_kwargs: dict | None = None,
) -> AgentModules:
    """Wrap per-agent policy and value networks into the masked-categorical actor and the critic.

    Parameters
    ----------
    agent_names : tuple of str
        Agents, in the order of the agent dimension.
    policy_net, value_net : PerAgent
        Map the entries ``in_keys`` to ``(*batch, num_agents, num_actions)``
        logits and ``(*batch, num_agents, 1)`` values.
    in_keys : list
        The TensorDict entries both networks read, in the order of their inputs
        (a policy network with ``active_only`` also reads ``("agents", "active")``).
    distribution_class : type
        The action distribution: :class:`~torchrl.modules.MaskedCategorical`
        or a subclass (e.g. :class:`~nip_like.distributions.GroupedMaskedCategorical`).
    distribution_kwargs : dict, optional
        Further keyword arguments of the distribution.
    """
    policy_keys = [*in_keys, ACTIVE_KEY] if policy_net.active_only else list(in_keys)
    policy = ProbabilisticActor(
        TensorDictModule(policy_net, in_keys=policy_keys, out_keys=[LOGITS_KEY]),
        in_keys={"logits": LOGITS_KEY, "mask": ACTION_MASK_KEY},
        out_keys=[ACTION_KEY],
        distribution_class=distribution_class,
        distribution_kwargs=distribution_kwargs,
        return_log_prob=True,
        log_prob_key=LOG_PROB_KEY,
    )
    value = TensorDictModule(value_net, in_keys=list(in_keys), out_keys=[VALUE_KEY])
    return AgentModules(policy=policy, value=value, agent_names=tuple(agent_names))
