"""The hidden-bits scenario: environment, agents and metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDictBase

from nip_like.allowed import checked
from nip_like.agent_modules import AgentModules, AgentNetConfig, build_actor_critic, mlp
from nip_like.errors import ConfigError
from nip_like.registry import register_scenario, typed_entry
from nip_like.scenarios.base import ScenarioConfig, TensorGame
from nip_like.scenarios.hidden_bits.environment import HiddenBitsEnv


@dataclass
class HiddenBitsConfig(ScenarioConfig):
    """The built-in hidden-bits scenario (see :mod:`nip_like.scenarios.hidden_bits`)."""

    name: str = "hidden_bits"  # scenario name
    num_bits: int = checked(2, ge=1, le=16)  # length of the hidden bit string the verifier must output
    message_vocab: int = checked(4, ge=2)  # number of distinct messages a prover can send per round
    agents: dict[str, Any] = field(default_factory=dict)  # per-agent AgentNetConfig entries; others use default_agent
    default_agent: AgentNetConfig = field(default_factory=AgentNetConfig)  # network size of agents not in agents


@register_scenario("hidden_bits", HiddenBitsConfig)
class HiddenBitsScenario(TensorGame):
    """A prover must convey a hidden bit string to a verifier.

    The seconds-long smoke scenario, and the yardstick of learning tests: its
    optimum is known in closed form (:meth:`optimal_rewards`).
    """

    def __init__(self, config, protocol) -> None:
        super().__init__(config, protocol)
        if "verifier" not in protocol.agent_names:
            raise ConfigError(
                f"scenario hidden_bits needs a protocol with a 'verifier' agent; "
                f"protocol {protocol.name!r} has {list(protocol.agent_names)}"
            )
        if not 1 <= config.num_bits <= 16:
            raise ConfigError(f"scenario.num_bits must be between 1 and 16, got {config.num_bits}")
        if config.message_vocab < 2:
            raise ConfigError(f"scenario.message_vocab must be at least 2, got {config.message_vocab}")
        unknown = sorted(set(config.agents) - set(protocol.agent_names))
        if unknown:
            raise ConfigError(
                f"scenario.agents names {unknown}, which protocol {protocol.name!r} "
                f"does not have; its agents are {list(protocol.agent_names)}"
            )

    def make_env(
        self, num_envs: int, split: str, seed: int, device: torch.device | str, group_size: int = 1
    ) -> HiddenBitsEnv:
        return HiddenBitsEnv(
            self.protocol,
            num_envs=num_envs,
            num_bits=self.config.num_bits,
            message_vocab=self.config.message_vocab,
            device=device,
            seed=seed,
            group_size=group_size,
        )

    def make_agents(self) -> AgentModules:
        probe = self.make_env(1, "train", 0, "cpu")

        def network(name: str, in_features: int, out_features: int):
            size = self.config.default_agent
            if name in self.config.agents:
                size = typed_entry(AgentNetConfig, self.config.agents[name], f"scenario.agents.{name}")
            return mlp(in_features, out_features, size.hidden_size, size.num_layers)

        return build_actor_critic(self.agent_names, probe.observation_size, probe.num_actions, network)

    def optimal_rewards(self) -> dict[str, float]:
        capacity = self.config.message_vocab ** self.protocol.message_rounds()
        best = min(1.0, capacity / 2**self.config.num_bits)
        # Rewards are linear in the verifier's correctness, so the protocol maps
        # the best accuracy to each agent's best expected return.
        rewards = self.protocol.rewards(torch.tensor(best))
        return {name: float(rewards[index]) for index, name in enumerate(self.agent_names)}

    def episode_metrics(self, episodes: TensorDictBase) -> dict[str, float]:
        metrics = super().episode_metrics(episodes)
        verifier = self.protocol.agent_index("verifier")
        metrics["accuracy"] = episodes.get(("agents", "episode_return"))[:, verifier].mean().item()
        return metrics
