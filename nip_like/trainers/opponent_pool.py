"""Opponent pools: some training episodes meet an earlier version (a snapshot) of an agent instead of the agent itself.

With ``trainer.opponent_pool.agent`` set, the pool keeps up to ``size``
snapshots of that agent's trained weights (LoRA agents: the adapters only),
starting with its initial weights (version 0); after every ``every``
iterations' update a new snapshot (version = the iterations done) enters and
the oldest leaves. Each new training episode draws whom it meets in that
agent's seat: the agent itself, live, with probability ``live_fraction``,
else a snapshot (the ``latest``, one ``uniform`` over the pool, or by
``win_rate``: weight ``(1 - score)^2`` with the learner's Laplace-smoothed
score against the snapshot, so the snapshots the learner beats least are met
most, as in prioritised fictitious self-play); ``per: iteration`` draws once
for all episodes that an iteration starts. Episodes of one group (the same
datapoint, ``trainer.group_size``) meet the same opponent.

A snapshot plays by having its weights copied into the agent's parameters
while the agent samples its messages for those episodes (and copied back
after), so sampling, prompts and tokenizer are the agent's own. The agent
trains on the episodes it played live only: its steps in the others are made
inactive for the update. Each finished training episode's opponent and the
two returns go to ``opponent_pool.jsonl`` in the run folder; the metrics
``pool/size``, ``pool/live_episodes`` and, for each snapshot met,
``pool/<version>/episodes`` and ``pool/<version>/score`` (the learner's
mean score against it: win 1, tie 0.5, loss 0, by episode return) are
logged every iteration. The pool (snapshots, the episodes in flight and whom
they meet, the scores, its random generator) is part of the checkpoint, so a
resumed run draws exactly what the uninterrupted one drew.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from tensordict import TensorDictBase

from nip_like import keys
from nip_like.checkpoint import derive_seed
from nip_like.errors import ConfigError

#: The version of "the agent itself, live" in ``opponent_version``.
LIVE = -1
#: What a snapshot's weight for ``draw: win_rate`` never goes below (a snapshot always beaten is still met now and then).
WIN_RATE_FLOOR = 1e-3
#: The file of every finished training episode's opponent, in the run folder.
EPISODES_FILE = "opponent_pool.jsonl"


class OpponentPool:
    """Snapshots of one agent and whom each training episode meets in its seat (see the module docstring).

    Parameters
    ----------
    options : OpponentPoolConfig
        ``trainer.opponent_pool``.
    agent_names : tuple of str
        The game's agents, in the order of the agent dimension.
    actor : LMActor
        The agents' policy (it samples the pooled agent's messages with :meth:`playing`).
    seed : int
        The run's seed (the pool's draws have a generator of their own).
    run_dir : Path
        Where ``opponent_pool.jsonl`` is written.
    """

    def __init__(self, options: Any, agent_names: tuple[str, ...], actor: Any, seed: int, run_dir: Path) -> None:
        self.agent = str(options.agent)
        self.index = agent_names.index(self.agent)
        learner = options.learner or next(name for name in agent_names if name != self.agent)
        self.learner_index = agent_names.index(learner)
        self.size, self.every = int(options.size), int(options.every)
        self.draw_rule, self.per = str(options.draw), str(options.per)
        self.live_fraction = float(options.live_fraction)
        self.model = actor.policy(self.agent).model
        self.names = [name for name, param in self.model.named_parameters() if param.requires_grad]
        self.generator = torch.Generator().manual_seed(derive_seed(int(seed), "opponent_pool"))
        self.snapshots: dict[int, list[torch.Tensor]] = {}  # version -> its trained tensors, oldest first
        self.retired: dict[int, list[torch.Tensor]] = {}  # left the pool, still met by episodes in flight
        self.assignments: dict[int, int] = {}  # group id of an episode in flight -> the version it meets
        self.scores: dict[int, list[float]] = {}  # version -> [the learner's summed score, episodes]
        self.iteration_draw: Optional[int] = None
        self.active = False
        self.episodes_file = Path(run_dir) / EPISODES_FILE
        self.add_snapshot(0)

    # ------------------------------------------------------------------ snapshots
    def _trained(self) -> list[torch.nn.Parameter]:
        parameters = dict(self.model.named_parameters())
        return [parameters[name] for name in self.names]

    def add_snapshot(self, version: int) -> None:
        """Put the agent's current trained weights in the pool as ``version``; the oldest leaves if it is full."""
        self.snapshots[version] = [param.detach().clone() for param in self._trained()]
        while len(self.snapshots) > self.size:
            oldest = next(iter(self.snapshots))
            self.retired[oldest] = self.snapshots.pop(oldest)

    @contextmanager
    @torch.no_grad()
    def playing(self, version: int) -> Iterator[None]:
        """Inside the block the agent's parameters hold snapshot ``version`` (the live weights are put back after)."""
        if version == LIVE:
            yield
            return
        weights = self.snapshots.get(version, self.retired.get(version))
        params = self._trained()
        live = [param.detach().clone() for param in params]
        for param, value in zip(params, weights):
            param.copy_(value)
        try:
            yield
        finally:
            for param, value in zip(params, live):
                param.copy_(value)

    # ------------------------------------------------------------------ draws
    @contextmanager
    def in_play(self) -> Iterator[None]:
        """The training collection: episodes started inside the block meet the pool (evaluation and test meet the agent)."""
        if self.per == "iteration":
            self.iteration_draw = self._draw()
        self.active = True
        try:
            yield
        finally:
            self.active = False

    def _draw(self) -> int:
        live = float(torch.rand((), generator=self.generator)) < self.live_fraction
        versions = list(self.snapshots)
        if self.draw_rule == "latest":
            chosen = versions[-1]
        elif self.draw_rule == "uniform":
            chosen = versions[int(torch.randint(len(versions), (), generator=self.generator))]
        else:
            weights = torch.tensor([max((1.0 - self.score(version)) ** 2, WIN_RATE_FLOOR) for version in versions])
            chosen = versions[int(torch.multinomial(weights, 1, generator=self.generator))]
        return LIVE if live else chosen

    def score(self, version: int) -> float:
        """The learner's Laplace-smoothed mean score against snapshot ``version`` (0.5 before any episode)."""
        total, episodes = self.scores.get(version, (0.0, 0))
        return (total + 1.0) / (episodes + 2.0)

    def versions_for(self, group_ids: torch.Tensor) -> torch.Tensor:
        """``(rows,)``: the version each row's episode meets; outside :meth:`in_play`, the agent itself."""
        if not self.active:
            return torch.full(group_ids.shape, LIVE, dtype=torch.long, device=group_ids.device)
        versions = []
        for group in group_ids.tolist():
            if group not in self.assignments:
                self.assignments[group] = self.iteration_draw if self.per == "iteration" else self._draw()
            versions.append(self.assignments[group])
        return torch.tensor(versions, dtype=torch.long, device=group_ids.device)

    # ------------------------------------------------------------------ after collection and update
    def record(self, batch: TensorDictBase, iteration: int) -> dict[str, float]:
        """Note the finished episodes' opponents and scores, make the agent inactive where a snapshot played; the metrics.

        Parameters
        ----------
        batch : TensorDictBase
            The iteration's collected batch, ``(env, time)``, with ``opponent_version``.
        iteration : int
            The iteration (0-based), for the episodes file.
        """
        versions = batch.get(keys.OPPONENT_VERSION_KEY)
        active = batch.get(keys.ACTIVE_KEY).clone()
        active[..., self.index] &= versions == LIVE
        batch.set(keys.ACTIVE_KEY, active)
        done = batch.get(("next", "done")).squeeze(-1)
        returns = batch.get(("next", *keys.EPISODE_RETURN_KEY))[done]
        returns = returns.reshape(*returns.shape[:2])  # (episodes, agents)
        met = versions[done].tolist()
        groups = batch.get(keys.GROUP_ID_KEY)[done].tolist()
        learner, opponent = returns[:, self.learner_index].tolist(), returns[:, self.index].tolist()
        counts: dict[int, int] = {}
        lines = []
        for version, group, mine, theirs in zip(met, groups, learner, opponent):
            counts[version] = counts.get(version, 0) + 1
            if version != LIVE:
                entry = self.scores.setdefault(version, [0.0, 0])
                entry[0] += 1.0 if mine > theirs else 0.5 if mine == theirs else 0.0
                entry[1] += 1
            lines.append(json.dumps({"iteration": iteration + 1, "group_id": group, "opponent": version,
                                     "learner_return": mine, "opponent_return": theirs}))
        if lines:
            self.episodes_file.parent.mkdir(parents=True, exist_ok=True)
            with self.episodes_file.open("a") as stream:
                stream.write("\n".join(lines) + "\n")
        metrics = {"pool/size": float(len(self.snapshots)), "pool/live_episodes": float(counts.pop(LIVE, 0))}
        for version, count in counts.items():
            metrics[f"pool/{version}/episodes"] = float(count)
            total, episodes = self.scores[version]
            metrics[f"pool/{version}/score"] = total / episodes
        return metrics

    def after_update(self, iterations_done: int, in_flight: torch.Tensor) -> None:
        """Add a snapshot when one is due; forget the episodes no longer in flight, and the snapshots none of them meets.

        Parameters
        ----------
        iterations_done : int
            Iterations completed, this one included (the new snapshot's version).
        in_flight : torch.Tensor
            The group ids of the episodes the collector holds in flight.
        """
        if iterations_done % self.every == 0:
            self.add_snapshot(iterations_done)
        flying = set(in_flight.flatten().tolist())
        self.assignments = {group: version for group, version in self.assignments.items() if group in flying}
        met = set(self.assignments.values())
        self.retired = {version: weights for version, weights in self.retired.items() if version in met}

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs to draw exactly what this one would."""
        return {
            "snapshots": list(self.snapshots.items()),
            "retired": list(self.retired.items()),
            "assignments": dict(self.assignments),
            "scores": {version: list(entry) for version, entry in self.scores.items()},
            "generator": self.generator.get_state(),
            "iteration_draw": self.iteration_draw,
        }

    def load_state_dict(self, state: dict[str, Any], iteration: int) -> None:
        """Restore :meth:`state_dict`; the episodes file keeps the lines of the first ``iteration`` iterations only."""
        device = self._trained()[0].device
        self.snapshots = {version: [value.to(device) for value in weights] for version, weights in state["snapshots"]}
        self.retired = {version: [value.to(device) for value in weights] for version, weights in state["retired"]}
        self.assignments = {int(group): int(version) for group, version in state["assignments"].items()}
        self.scores = {int(version): list(entry) for version, entry in state["scores"].items()}
        self.generator.set_state(state["generator"])
        self.iteration_draw = state["iteration_draw"]
        if self.episodes_file.is_file():
            kept = [line for line in self.episodes_file.read_text().splitlines() if line and json.loads(line)["iteration"] <= iteration]
            self.episodes_file.write_text("".join(f"{line}\n" for line in kept))


def opponent_pool_problems(options: Any, scenario: Any, world_size: int) -> list[str]:
    """What keeps an opponent pool from applying to this game, in one line (none without ``agent``, or when it applies).

    Parameters
    ----------
    options : OpponentPoolConfig
        ``trainer.opponent_pool``.
    scenario : TensorGame
        The game (its agents and, for language-model agents, their configs).
    world_size : int
        The torchrun ranks of the run (1 in one process).
    """
    if not options.get("agent"):
        return []
    names = tuple(scenario.agent_names)
    if len(names) < 2:
        return ["trainer.opponent_pool needs a game of two or more agents: the pooled agent's opponents learn against it"]
    if options.agent not in names:
        return [f"trainer.opponent_pool.agent={options.agent} is not an agent of this game; allowed: {list(names)}"]
    others = [name for name in names if name != options.agent]
    if options.get("learner") is not None and options.learner not in others:
        return [f"trainer.opponent_pool.learner={options.learner} must be another agent of the game: one of {others}"]
    lm_agents = getattr(scenario, "lm_agent_configs", dict)()
    if options.agent not in lm_agents:
        return ["trainer.opponent_pool plays snapshots of language-model agents; this game's agents are not (set agent: null)"]
    if world_size > 1:
        return ["trainer.opponent_pool runs in one process: each torchrun rank would draw its own opponents (set agent: null)"]
    where, agent, _ = lm_agents[options.agent]
    if agent.sampler.kind == "server":
        return [
            f"trainer.opponent_pool.agent={options.agent} samples from an inference server, which holds the live weights, "
            f"not a snapshot's: set {where}.sampler.kind=local"
        ]
    if agent.frozen_from:
        return [f"trainer.opponent_pool.agent={options.agent} is a frozen co-player (frozen_from): its snapshots would all be alike"]
    return []


def build_opponent_pool(
    options: Any, policy: Any, agent_names: tuple[str, ...], seed: int, run_dir: Path
) -> Optional[OpponentPool]:
    """The run's :class:`OpponentPool` (None without ``trainer.opponent_pool.agent``), attached to ``policy``.

    The options were checked against the game (:func:`opponent_pool_problems`)
    when the trainer was validated; what is left needs the agents built.

    Parameters
    ----------
    options : OpponentPoolConfig
        ``trainer.opponent_pool``.
    policy : LMPolicy
        The agents' stacked policy, built.
    agent_names : tuple of str
        The agents, in the order of the agent dimension.
    seed : int
        The run's seed.
    run_dir : Path
        The run folder.
    """
    if not options.agent:
        return None
    played = policy.policy(options.agent)
    if not any(param.requires_grad for param in played.model.parameters()):
        raise ConfigError(f"trainer.opponent_pool.agent={options.agent}: the agent's model trains nothing, so its snapshots would all be alike")
    pool = OpponentPool(options, tuple(agent_names), policy, seed, run_dir)
    policy.attach_pool(pool)
    return pool
