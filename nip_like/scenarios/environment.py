"""The environment base shared by every scenario: a batched, turn-based game.

All episode state lives in the TensorDict (under ``"state"``), so an
environment holds nothing but its specs and its random-number generator. That
makes collection resumable: restoring the collector's current TensorDict and
the generator's state continues every episode exactly where it was.

Keys written by :class:`InteractionEnv` (``B`` is the env batch, ``N`` the
number of agents, ``A`` the size of the shared action space):

=================================  ==============  =========================================
key                                shape           meaning
=================================  ==============  =========================================
``("state", "round")``             ``B``           round about to be played (0-based)
``("state", "group_id")``          ``B``           id shared by episodes on the same datapoint
``("state", ...)``                 ``B, ...``      scenario state (hidden datapoint, messages)
``("agents", "observation")``      ``B, N, F``     what each agent sees
``("agents", "action_mask")``      ``B, N, A``     which actions are legal for each agent
``("agents", "active")``           ``B, N``        who acts in this round
``("agents", "episode_return")``   ``B, N, 1``     sum of the agent's rewards so far
``("agents", "action")``           ``B, N``        chosen action (input of a step)
``("agents", "reward")``           ``B, N, 1``     reward of the step (under ``"next"``)
``("agents", "done")``             ``B, N, 1``     episode over, per agent
``("agents", "terminated")``       ``B, N, 1``     same as done (no truncation)
``"done"`` / ``"terminated"``      ``B, 1``        episode over
=================================  ==============  =========================================
"""

from __future__ import annotations

from abc import abstractmethod

import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.data import Binary, Categorical, Composite, Unbounded
from torchrl.envs import EnvBase

from nip_like.errors import ConfigError
from nip_like.protocols.base import Protocol


class InteractionEnv(EnvBase):
    """A vectorised turn-based multi-agent environment driven by a protocol.

    Subclasses describe a game with four hooks: :meth:`_state_spec`,
    :meth:`_new_state`, :meth:`_observe` and :meth:`_advance`. The base class
    keeps the round counter, the per-agent active masks, rewards, done flags and
    running returns, and resets each finished episode on its own.

    Parameters
    ----------
    protocol : Protocol
        Who acts in which round and how rewards are shared.
    num_envs : int
        Number of independent episodes run side by side.
    num_actions : int, optional
        Size of the categorical action space shared by all agents (masked per
        agent). Needed by the default :meth:`_agent_action_spec`; a scenario
        whose actions are token sequences overrides that hook instead.
    observation_size : int, optional
        Length of each agent's observation vector (default
        :meth:`_policy_input_spec` only).
    device : torch.device or str
        Where the tensors live.
    seed : int
        Seed of the environment's own random-number generator.
    group_size : int
        Number of consecutive environments that play the same datapoint (see
        :meth:`_grouped_states`); 1 gives every episode its own.
    """

    batch_locked = True

    def __init__(
        self,
        protocol: Protocol,
        num_envs: int,
        num_actions: int | None = None,
        observation_size: int | None = None,
        device: torch.device | str = "cpu",
        seed: int = 0,
        group_size: int = 1,
    ) -> None:
        if group_size < 1 or num_envs % group_size:
            raise ConfigError(
                f"the number of environments ({num_envs}) must be a multiple of the group size ({group_size})"
            )
        super().__init__(device=device, batch_size=torch.Size([num_envs]))
        self.group_size = group_size
        self.protocol = protocol
        self.num_envs = num_envs
        self.num_agents = protocol.num_agents
        self.num_actions = num_actions
        self.observation_size = observation_size
        self.rng = torch.Generator().manual_seed(seed)
        self._make_specs()

    # ----------------------------------------------------------------- hooks
    @abstractmethod
    def _state_spec(self) -> dict[str, object]:
        """Return the specs of the scenario's state entries, with batch shape ``(B,)``."""

    @abstractmethod
    def _new_state(self, num_episodes: int) -> TensorDict:
        """Draw ``num_episodes`` fresh episodes; a TensorDict of batch ``(num_episodes,)``.

        Use :attr:`rng` for randomness, so that the stream can be saved and restored.
        """

    def _observe(self, state: TensorDictBase) -> tuple[torch.Tensor, torch.Tensor]:
        """Return each agent's ``(observation, action_mask)`` for ``state``.

        Shapes ``(B, N, F)`` (float) and ``(B, N, A)`` (bool). The hook of
        scenarios with categorical actions (the default
        :meth:`_policy_inputs`); a scenario that overrides
        :meth:`_policy_inputs` does not implement it.
        """
        raise NotImplementedError(
            f"{type(self).__name__} implements neither _observe (categorical actions) nor _policy_inputs"
        )

    @abstractmethod
    def _advance(
        self, state: TensorDictBase, action: torch.Tensor, active: torch.Tensor
    ) -> tuple[TensorDictBase, torch.Tensor, torch.Tensor]:
        """Play one round.

        Parameters
        ----------
        state : TensorDictBase
            The state before the round (a copy: it may be changed in place).
        action : torch.Tensor
            ``(B, N)`` actions of all agents; those of inactive agents must be ignored.
        active : torch.Tensor
            ``(B, N)`` boolean: who acts in this round.

        Returns
        -------
        tuple
            The new state, the ``(B, N)`` rewards and a ``(B,)`` boolean telling
            which episodes ended early (before the protocol's last round).
        """

    def _agent_observation_spec(self) -> dict[str, object]:
        """Specs of extra per-agent observation entries, shape ``(B, N, ...)`` (none by default).

        A scenario whose agents see more than a flat vector (graphs, message
        histories) declares the entries here and returns them from :meth:`_observe_extra`.
        """
        return {}

    def _observe_extra(self, state: TensorDictBase) -> dict[str, torch.Tensor]:
        """Extra per-agent observation entries for ``state`` (see :meth:`_agent_observation_spec`)."""
        return {}

    def _policy_input_spec(self) -> dict[str, object]:
        """Specs of the per-agent entries a policy acts on, shape ``(B, N, ...)``.

        The default is a categorical agent's: ``observation`` ``(B, N, F)``
        and ``action_mask`` ``(B, N, A)``. A scenario whose agents read other
        inputs (token prompts) overrides it with :meth:`_policy_inputs`.
        """
        agents = (*self.batch_size, self.num_agents)
        return {
            "observation": Unbounded(shape=(*agents, self.observation_size), device=self.device),
            "action_mask": Binary(n=self.num_actions, shape=(*agents, self.num_actions), dtype=torch.bool, device=self.device),
        }

    def _policy_inputs(self, state: TensorDictBase) -> dict[str, torch.Tensor]:
        """The entries of :meth:`_policy_input_spec` for ``state`` (by default from :meth:`_observe`)."""
        observation, action_mask = self._observe(state)
        return {"observation": observation, "action_mask": action_mask}

    def _agent_action_spec(self) -> object:
        """Spec of ``("agents", "action")``, shape ``(B, N, ...)``.

        The default is one categorical choice among ``num_actions`` per agent;
        a scenario whose agents send token sequences returns a ``(B, N, T)``
        integer spec.
        """
        return Categorical(n=self.num_actions, shape=(*self.batch_size, self.num_agents), device=self.device)

    # ----------------------------------------------------------------- specs
    def _make_specs(self) -> None:
        batch, agents = self.batch_size, (*self.batch_size, self.num_agents)
        state = Composite(
            round=Unbounded(shape=batch, dtype=torch.int64, device=self.device),
            group_id=Unbounded(shape=batch, dtype=torch.int64, device=self.device),
            **self._state_spec(),
            **self.protocol.state_spec(batch, self.device),
            shape=batch,
            device=self.device,
        )
        agent_obs = Composite(
            **self._agent_observation_spec(),
            **self._policy_input_spec(),
            active=Binary(n=self.num_agents, shape=agents, dtype=torch.bool, device=self.device),
            episode_return=Unbounded(shape=(*agents, 1), device=self.device),
            shape=agents,
            device=self.device,
        )
        self.observation_spec = Composite(state=state, agents=agent_obs, shape=batch, device=self.device)
        self.action_spec = Composite(
            agents=Composite(
                action=self._agent_action_spec(),
                shape=agents,
                device=self.device,
            ),
            shape=batch,
            device=self.device,
        )
        self.reward_spec = Composite(
            agents=Composite(reward=Unbounded(shape=(*agents, 1), device=self.device), shape=agents, device=self.device),
            shape=batch,
            device=self.device,
        )
        flag = dict(n=1, dtype=torch.bool, device=self.device)
        self.done_spec = Composite(
            done=Binary(shape=(*batch, 1), **flag),
            terminated=Binary(shape=(*batch, 1), **flag),
            agents=Composite(
                done=Binary(shape=(*agents, 1), **flag),
                terminated=Binary(shape=(*agents, 1), **flag),
                shape=agents,
                device=self.device,
            ),
            shape=batch,
            device=self.device,
        )

    # ------------------------------------------------------------- mechanics
    def _agent_entries(self, state: TensorDictBase, episode_return: torch.Tensor) -> dict:
        return {
            **self._observe_extra(state),
            **self._policy_inputs(state),
            "active": self.protocol.active_agents_in(state),
            "episode_return": episode_return,
        }

    def _done_entries(self, done: torch.Tensor) -> tuple[dict, dict]:
        root = done.unsqueeze(-1)
        per_agent = root.unsqueeze(-2).expand(*self.batch_size, self.num_agents, 1).clone()
        return {"done": root, "terminated": root.clone()}, {"done": per_agent, "terminated": per_agent.clone()}

    def _agents_td(self, entries: dict) -> TensorDict:
        # The agent dimension belongs to the batch shape of the sub-TensorDict.
        return TensorDict(entries, batch_size=(*self.batch_size, self.num_agents), device=self.device)

    def _fresh_state(self, num_episodes: int) -> TensorDict:
        state = self._new_state(num_episodes)
        state.update(self.protocol.initial_state(num_episodes, self.rng))
        state = state.to(self.device)
        state["round"] = torch.zeros(num_episodes, dtype=torch.int64, device=self.device)
        state["group_id"] = torch.randint(0, 2**62, (num_episodes,), generator=self.rng).to(self.device)
        return state

    def _grouped_states(self, reset: torch.Tensor, state: TensorDictBase | None) -> TensorDictBase:
        """New episodes for the positions in ``reset``, grouped by datapoint.

        Each block of ``group_size`` consecutive environments that is reset as
        a whole starts its episodes on one shared datapoint, under one group
        id. An environment reset without the rest of its block (possible when
        episodes end at different rounds) starts alone, in a group of one.
        """
        blocks = reset.view(-1, self.group_size)
        whole = blocks.all(-1)
        in_whole = whole.repeat_interleave(self.group_size) & reset
        alone = reset & ~in_whole
        shared = self._fresh_state(int(whole.sum()))
        copies = torch.arange(shared.batch_size[0], device=self.device).repeat_interleave(self.group_size)
        if state is None:
            return shared[copies]
        state = state.clone()
        state[in_whole] = shared[copies]
        state[alone] = self._fresh_state(int(alone.sum()))
        return state

    def _reset(self, tensordict: TensorDictBase | None, **kwargs) -> TensorDictBase:
        reset = None
        if tensordict is not None:
            reset = tensordict.get("_reset", None)
            if reset is None and tensordict.get(("agents", "_reset"), None) is not None:
                reset = tensordict.get(("agents", "_reset")).reshape(*self.batch_size, -1).any(-1)
        episode_return = torch.zeros(*self.batch_size, self.num_agents, 1, device=self.device)
        if reset is None or tensordict.get("state", None) is None:
            state = self._grouped_states(torch.ones(self.batch_size, dtype=torch.bool, device=self.device), None)
        else:
            reset = reset.reshape(self.batch_size)
            state = self._grouped_states(reset, tensordict["state"])
            kept = tensordict.get(("agents", "episode_return"))
            episode_return = torch.where(reset.view(-1, 1, 1), episode_return, kept)
        done, agent_done = self._done_entries(torch.zeros(self.batch_size, dtype=torch.bool, device=self.device))
        agents = self._agents_td({**self._agent_entries(state, episode_return), **agent_done})
        return TensorDict(
            {"state": state, "agents": agents, **done},
            batch_size=self.batch_size,
            device=self.device,
        )

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        state = tensordict["state"]
        active = self.protocol.active_agents_in(state)
        action = tensordict["agents", "action"]
        new_state, reward, ended = self._advance(state.clone(), action, active)
        new_state["round"] = state["round"] + 1
        done = ended | (new_state["round"] >= self.protocol.num_rounds)
        reward = reward.unsqueeze(-1).to(torch.float32)
        episode_return = tensordict["agents", "episode_return"] + reward
        done_entries, agent_done = self._done_entries(done)
        agents = self._agents_td({**self._agent_entries(new_state, episode_return), "reward": reward, **agent_done})
        return TensorDict(
            {"state": new_state, "agents": agents, **done_entries},
            batch_size=self.batch_size,
            device=self.device,
        )

    # ------------------------------------------------------- scripted play
    def policy_inputs(self, state: TensorDictBase) -> dict[str, torch.Tensor]:
        """What each agent acts on in ``state``: the entries of :meth:`_policy_input_spec` (a token view's
        ``prompt_ids`` and ``prompt_mask``, ``(B, N, P)``), as a step gives them to the policy."""
        return self._policy_inputs(state)

    def advance(
        self, state: TensorDictBase, action: torch.Tensor, active: torch.Tensor
    ) -> tuple[TensorDictBase, torch.Tensor, torch.Tensor]:
        """Play one round's ``action`` of the ``active`` agents: the new state, the rewards and which episodes ended.

        The game's rules (:meth:`_advance`) without the round counter, the
        returns or the resets of a step: scripted play (a warm start's
        demonstrations) drives episodes with it. ``state`` may be changed in place.
        """
        return self._advance(state, action, active)

    def _set_seed(self, seed: int | None) -> None:
        self.rng.manual_seed(0 if seed is None else int(seed))

    def get_rng_state(self) -> torch.Tensor:
        """Return the state of the environment's generator (for checkpoints)."""
        return self.rng.get_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        """Restore the environment's generator from :meth:`get_rng_state`."""
        self.rng.set_state(state)
