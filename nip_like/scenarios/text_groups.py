"""Model groups of text agents: which text model each agent of a chat game plays with.

:class:`TextModelGroups` reads what every chat scenario of the text trainers
configures the same way: ``scenario.agent_groups`` (agents in one group share a
text model and its fine-tune jobs; an agent not named is a group of its own),
``scenario.models.<group>`` and ``scenario.default_model`` (each a
:class:`~nip_like.text.interface.TextModelConfig`) and
``scenario.scripted_provers`` (every prover is the scenario's honest scripted
player). The game gives each agent's role (``role(agent)``: ``"verifier"``,
``"accept"`` or ``"reject"``) and its scripted player
(:meth:`~nip_like.scenarios.chat.ChatGame.scripted_player`). The duplicates
game (:class:`~nip_like.scenarios.duplicates.chat.DuplicatesChatScenario`) and
the code-validation task
(:class:`~nip_like.scenarios.code_validation.scenario.CodeValidationScenario`)
use it. This module registers nothing.
"""

from __future__ import annotations

from nip_like.errors import ConfigError
from nip_like.registry import typed_entry
from nip_like.scenarios.chat import ChatGame
from nip_like.text.interface import TextModel, TextModelConfig

__all__ = ["TextModelGroups"]


class TextModelGroups(ChatGame):
    """The model groups of a chat game's text agents (see the module docstring).

    The scenario calls :meth:`check_groups` when it is built.
    """

    def check_groups(self) -> None:
        """Refuse, in one line, ``agent_groups`` that name no agent of the protocol and ``models`` that name no group."""
        unknown = sorted(set(self.config.agent_groups) - set(self.agent_names))
        if unknown:
            raise ConfigError(f"scenario.agent_groups names {unknown}, not agents of this protocol {list(self.agent_names)}")
        unknown = sorted(set(self.config.models) - set(self.groups()))
        if unknown:
            raise ConfigError(f"scenario.models names {unknown}, not model groups {sorted(set(self.groups().values()))}")

    def groups(self) -> dict[str, str]:
        """Each agent's model group (``scenario.agent_groups``, else the agent's own name)."""
        return {name: str(self.config.agent_groups.get(name, name)) for name in self.agent_names}

    def model_config_path(self, group: str) -> str:
        """The config path that sets ``group``'s model: ``scenario.models.<group>`` or ``scenario.default_model``."""
        return f"scenario.models.{group}" if group in self.config.models else "scenario.default_model"

    def model_config(self, group: str) -> TextModelConfig:
        """The text model of ``group`` (``scenario.models.<group>``, else ``scenario.default_model``;
        a group of provers is scripted with ``scenario.scripted_provers``)."""
        agents = [agent for agent, owner in self.groups().items() if owner == group]
        if self.config.scripted_provers and all(self.role(agent) != "verifier" for agent in agents):
            return TextModelConfig(backend="scripted")
        if group in self.config.models:
            return typed_entry(TextModelConfig, self.config.models[group], f"scenario.models.{group}")
        return self.config.default_model

    def scripted_model(self, group: str) -> TextModel:
        """The honest scripted player of ``group`` (``backend: scripted``); its agents must share one role."""
        agents = [agent for agent, owner in self.groups().items() if owner == group]
        roles = {self.role(agent) for agent in agents}
        if len(roles) != 1:
            raise ConfigError(f"model group {group!r} is scripted but its agents play different roles {sorted(roles)}")
        return self.scripted_player(agents[0])
