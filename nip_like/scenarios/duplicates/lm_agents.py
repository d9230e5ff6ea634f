"""The duplicates game's language-model agents: the shared agent handling, and the token view's tokenizer check.

:class:`DuplicatesLMAgents` is :class:`~nip_like.scenarios.lm_agents.LMAgents`
(each agent's :class:`~nip_like.lm.models.LMAgentConfig`, frozen co-players,
shared models, a shared base, the small chat models of the chat view, the
size checks, the agents) on the duplicates game, whose token view plays over
the game's own word-level tokenizer. It is the base of
:class:`~nip_like.scenarios.duplicates.scenario.DuplicatesScenario`. This
module registers nothing.
"""

from __future__ import annotations

from nip_like.errors import ConfigError
from nip_like.lm.policy import LMPolicy
from nip_like.lm.shared_models import build_policies
from nip_like.scenarios.duplicates.game import DuplicatesGame
from nip_like.scenarios.lm_agents import LMAgents

__all__ = ["DuplicatesLMAgents"]


class DuplicatesLMAgents(LMAgents, DuplicatesGame):
    """The duplicates game with language-model agents: one causal LM per agent, in the token or the chat view.

    Everything that depends on the agents' configs is
    :class:`~nip_like.scenarios.lm_agents.LMAgents`'s; in the token view the
    agents share the game's own tokenizer (:meth:`token_view_policies`).
    """

    def token_view_policies(self) -> dict[str, LMPolicy]:
        """Each agent's policy over the game's symbols: an agent with a model folder must carry the game's own tokenizer."""
        configs = self.agent_configs()
        tokenizers = {name: self.tokenizer if agent.pretrained_path is None else None for name, agent in configs.items()}
        policies = build_policies(configs, tokenizers)
        for name, agent in configs.items():
            if agent.pretrained_path is not None and policies[name].tokenizer.get_vocab() != self.tokenizer.get_vocab():
                raise ConfigError(
                    f"agent {name}: the tokenizer in {agent.pretrained_path} is not the duplicates game's "
                    f"(length {self.symbols.length}, {self.symbols.num_values} values, agents {list(self.symbols.agents)})"
                )
        return policies
