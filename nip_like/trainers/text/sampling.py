"""The sampling stages: an iteration's rollouts (played once, saved, read back) and their statistics."""

from __future__ import annotations

from pathlib import Path

from tensordict import TensorDict

from nip_like.scenarios.chat import ChatGame
from nip_like.scenarios.decisions import decision_metrics
from nip_like.text.interface import Sampling, TextModel
from nip_like.text.rollouts import load_rollouts, play_episodes, rollout_records, save_rollouts


def rollouts_path(run_dir: Path, iteration: int) -> Path:
    """Where iteration ``iteration``'s rollouts are saved: ``rollouts/iteration_<i>.jsonl``."""
    return Path(run_dir) / "rollouts" / f"iteration_{iteration:04d}.jsonl"


def sample_rollouts(
    scenario: ChatGame,
    models: dict[str, TextModel],
    sampling: dict[str, Sampling],
    episodes: int,
    seed: int,
    path: Path,
    branching: int = 1,
) -> str:
    """Play ``episodes`` train episodes (trees if ``branching`` > 1) with ``models`` and save them to ``path``;
    the file's SHA-256."""
    rollouts = play_episodes(scenario, models, sampling, "train", episodes, seed, branching=branching)
    return save_rollouts(rollouts, scenario.agent_names, scenario.protocol.num_rounds, path)


def read_rollouts(path: Path, expected_digest: str | None = None) -> TensorDict:
    """The rollouts saved at ``path``, checked against their header and ``expected_digest`` (the file's SHA-256)."""
    return load_rollouts(path, expected_digest)


def rollout_metrics(rollouts: TensorDict, agent_names: list[str]) -> dict[str, float]:
    """Decision metrics, each agent's mean episode return (``reward``), reply length and share of replies that did something."""
    metrics = decision_metrics(rollouts["decision"], rollouts["label"], rollouts["list_index"])
    metrics["decided"] = (rollouts["decision"] >= 0).float().mean().item()
    # The reply and move strings as nested lists, (E, R, N): no chat needs reading here.
    turns = rollouts["turns"]
    acted = turns["acted"].tolist()
    replies, moves = turns.get("reply").tolist(), turns.get("move").tolist()
    for index, name in enumerate(agent_names):
        metrics[f"agents/{name}/reward"] = rollouts["return"][:, index].mean().item()
        own = [
            (replies[episode][step][index], moves[episode][step][index])
            for episode, rounds in enumerate(acted)
            for step, agents in enumerate(rounds)
            if agents[index]
        ]
        if own:
            metrics[f"agents/{name}/reply_chars"] = sum(len(reply) for reply, _ in own) / len(own)
            metrics[f"agents/{name}/effective_replies"] = sum(move != "none" for _, move in own) / len(own)
    return metrics


def sampled_frames(rollouts: TensorDict) -> int:
    """The environment steps of ``rollouts``: each round of each episode in which some agent acted."""
    return int(rollouts["turns", "acted"].any(-1).sum())


def turns_by_agent(rollouts: TensorDict, agent_names: list[str], groups: dict[str, str]) -> list[dict]:
    """Every turn of the rollouts as a record: episode, round, agent, group (from ``groups``, agent -> group),
    chat, reply, move, reward, the agent's episode return and the label."""
    turns = []
    for episode, record in enumerate(rollout_records(rollouts, agent_names)):
        for turn in record["turns"]:
            turns.append(
                {
                    **turn,
                    "episode": episode,
                    "group": groups[turn["agent"]],
                    "return": record["returns"][turn["agent"]],
                    "label": record["label"],
                }
            )
    return turns
