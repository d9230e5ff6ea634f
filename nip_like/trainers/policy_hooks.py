"""What the RL trainer asks of its policy beyond a TorchRL actor: the hooks, declared once.

The RL loop runs any TorchRL actor. Language-model agents
(:class:`~nip_like.lm.actor_critic.LMActor`) need a word from the loop at a few
named points: after the warm start (LoRA adapters added late), after an
update (inference servers fetch the new weights), at a checkpoint (Hugging
Face folders), when the run ends (servers stopped), and they report what the
loop logs (servers' sampling metrics, the padding of scoring passes, the
frozen co-players' sources). :class:`PolicyHooks` declares those points;
:class:`TensorPolicyHooks` gives their defaults, which do nothing, for the
actors of tensor agents; :func:`policy_hooks` gives the trainer a policy's
hooks once, when the agents are built. The trainer calls the hooks only
through them, never by asking a policy what it has.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Protocol, runtime_checkable

__all__ = ["PolicyHooks", "TensorPolicyHooks", "hook_names", "policy_hooks"]


@runtime_checkable
class PolicyHooks(Protocol):
    """The points at which the RL loop tells its policy what happens, and what it reads from it.

    :class:`~nip_like.lm.actor_critic.LMActor` implements every hook with its own
    methods; a policy of tensor agents implements none and gets
    :class:`TensorPolicyHooks`.
    """

    def after_warm_start(self) -> None:
        """The warm start is done, before the reference policy is taken: add what comes after it (late LoRA adapters)."""

    def weights_changed(self) -> None:
        """An update changed the agents' weights (inference servers fetch them before they sample again)."""

    def pop_sampler_metrics(self) -> dict[str, float]:
        """Sampling metrics gathered since the last call (``sampler/...``), then forget them."""

    def pop_padding_fraction(self) -> float | None:
        """Share of padding in the scoring passes since the last call (None: nothing was scored), then forget it."""

    def frozen_sources(self) -> dict:
        """The frozen co-players' sources by agent (what a checkpoint records and a resume checks)."""

    def whole_states(self) -> dict[str, tuple[dict, dict | None]]:
        """Each agent's model and value-head state dicts with whole tensors (for agents sharded over the ranks)."""

    def save_pretrained(self, folder: Path, states: Mapping[str, tuple[dict, dict | None]] | None = None) -> list[Path]:
        """Write the agents in their own format under ``folder`` (one folder per agent); the folders written."""

    def close_servers(self) -> None:
        """Stop the servers the run started and close their clients."""

    def policy(self, name: str) -> Any:
        """Agent ``name``'s language-model policy (:class:`~nip_like.lm.policy.LMPolicy`); None for an agent that is none."""


def hook_names() -> tuple[str, ...]:
    """The names of the hooks that :class:`PolicyHooks` declares, in the order declared."""
    return tuple(name for name in vars(PolicyHooks) if not name.startswith("_") and callable(vars(PolicyHooks)[name]))


class TensorPolicyHooks:
    """The hooks of a policy that implements none (tensor agents): each does nothing and reports nothing."""

    def after_warm_start(self) -> None:
        """Nothing comes after the warm start."""

    def weights_changed(self) -> None:
        """No server holds the weights."""

    def pop_sampler_metrics(self) -> dict[str, float]:
        """No server samples: no metrics."""
        return {}

    def pop_padding_fraction(self) -> float | None:
        """No scoring pass pads: None."""
        return None

    def frozen_sources(self) -> dict:
        """No frozen co-player was loaded from a folder: empty."""
        return {}

    def whole_states(self) -> dict[str, tuple[dict, dict | None]]:
        """No agent has a state of its own format: empty."""
        return {}

    def save_pretrained(self, folder: Path, states: Mapping[str, tuple[dict, dict | None]] | None = None) -> list[Path]:
        """The trainer state holds the agents whole: no folder is written."""
        return []

    def close_servers(self) -> None:
        """No server was started."""

    def policy(self, name: str) -> None:
        """No agent is a language model: None."""
        return None


def policy_hooks(policy: Any) -> PolicyHooks:
    """The hooks of ``policy``: the policy itself when it implements every hook, the defaults when it implements none.

    Parameters
    ----------
    policy : TensorDictModuleBase
        The agents' stacked policy (:attr:`~nip_like.agent_modules.AgentModules.policy`).

    Raises
    ------
    TypeError
        If ``policy`` implements some hooks and not the others: a half of the
        hooks would leave the loop's other points silently doing nothing.
    """
    if isinstance(policy, PolicyHooks):
        return policy
    names = hook_names()
    present = [name for name in names if callable(getattr(policy, name, None))]
    if present:
        missing = [name for name in names if name not in present]
        raise TypeError(
            f"policy {type(policy).__name__} implements the hooks {present} of nip_like.trainers.policy_hooks.PolicyHooks "
            f"but not {missing}: implement every one (TensorPolicyHooks has their defaults) or none"
        )
    return TensorPolicyHooks()
