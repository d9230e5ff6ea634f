"""Which agents the RL loop trains on which iteration (``trainer.agent_updates``)."""

from __future__ import annotations

from typing import Mapping

from omegaconf import DictConfig

from nip_like.config import AgentUpdateConfig
from nip_like.errors import ConfigError
from nip_like.registry import typed_entry


class AgentUpdateSchedule:
    """Which agents are trained on which iteration.

    Parameters
    ----------
    config : Mapping[str, DictConfig]
        ``trainer.agent_updates``: per agent ``start``, ``stop`` and ``every``.
        Agents without an entry are trained on every iteration.
    agent_names : tuple of str
        All agents.
    """

    def __init__(self, config: Mapping[str, DictConfig], agent_names: tuple[str, ...]) -> None:
        unknown = sorted(set(config) - set(agent_names))
        if unknown:
            raise ConfigError(f"trainer.agent_updates names {unknown}; the agents are {list(agent_names)}")
        self.config = {}
        for name, entry in config.items():
            entry = typed_entry(AgentUpdateConfig, entry, f"trainer.agent_updates.{name}")
            if entry.every < 1:
                raise ConfigError(f"trainer.agent_updates.{name}.every must be at least 1, got {entry.every}")
            self.config[name] = entry
        self.agent_names = agent_names

    def is_trained(self, agent: str, iteration: int) -> bool:
        """Return whether ``agent`` is trained on ``iteration`` (0-based)."""
        entry = self.config.get(agent)
        if entry is None:
            return True
        if iteration < entry.start or (entry.stop is not None and iteration >= entry.stop):
            return False
        return (iteration - entry.start) % entry.every == 0

    def trained_agents(self, iteration: int) -> tuple[str, ...]:
        """Return the agents trained on ``iteration``."""
        return tuple(name for name in self.agent_names if self.is_trained(name, iteration))
