"""Text rollouts: playing a chat scenario with text models, and holding the episodes.

:func:`play_episodes` plays episodes of a chat scenario
(:class:`~nip_like.scenarios.duplicates.chat.DuplicatesChatScenario`) through
its token environment: at each round every acting agent's chat is rendered,
its group's :class:`~nip_like.text.interface.TextModel` answers all of them in
one batched call, the replies are parsed into the game's moves and the
environment steps. The result is a TensorDict of batch ``(E,)`` (episodes):

==============================  ===========  ==========================================
key                             shape        meaning
==============================  ===========  ==========================================
``"list_index"``                ``E``        the list's index in the split
``"values"``                    ``E, L``     the list
``"label"``                     ``E``        it holds a duplicate pair
``"decision"``                  ``E``        ``1`` accept, ``0`` reject, ``-1`` undecided
``"return"``                    ``E, N``     each agent's summed reward
``("turns", "acted")``          ``E, R, N``  the agent had a turn in that round
``("turns", "reward")``         ``E, R, N``  its reward in that round
``("turns", "chat")``           ``E, R, N``  the chat it read, as JSON (string; ``""`` without a turn)
``("turns", "reply")``          ``E, R, N``  its reply (string)
``("turns", "move")``           ``E, R, N``  what the reply did: ``cells i j``, ``accept``, ``reject``, ``none``
==============================  ===========  ==========================================

String entries are non-tensor stacks. :func:`save_rollouts` writes them as
JSONL, one readable dialogue per line, and :func:`load_rollouts` reads that
file back into the same TensorDict, so a resumed run reuses saved rollouts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

import torch
from tensordict import NonTensorStack, TensorDict
from torchrl.envs.utils import step_mdp

from nip_like.checkpoint import derive_seed, write_text_atomic
from nip_like.text.interface import Sampling, TextModel


def play_episodes(
    scenario,
    models: Mapping[str, TextModel],
    sampling: Mapping[str, Sampling],
    split: str,
    num_episodes: int,
    seed: int,
    by_agent: bool = False,
    branching: int = 1,
) -> TensorDict:
    """Play ``num_episodes`` episodes on ``split``; the TensorDict of the module docstring.

    Parameters
    ----------
    scenario : DuplicatesChatScenario
        The chat scenario (rendering, parsing, groups).
    models : Mapping[str, TextModel]
        The text model of each group (of each agent with ``by_agent``).
    sampling : Mapping[str, Sampling]
        How each group (agent) samples.
    split : str
        The data split the lists come from.
    num_episodes : int
        Episodes, all played at once.
    seed : int
        Seed of the list draws and of every reply (each round and agent gets
        its own seed derived from it), so that a replay is identical.
    by_agent : bool
        ``models`` and ``sampling`` are keyed by agent, not by group (scripted
        players, one per role).
    branching : int
        ``k``: play each list as a tree whose every round branches ``k`` ways
        (MALT). The result then has ``num_episodes * k**R`` episodes (``R``
        rounds), the ``k**R`` leaves of one list consecutive; at round ``r``
        the leaves in each block of ``k**(R - r - 1)`` share one sampled
        reply per agent (one node of the tree), so the ``k`` blocks under one
        node of the previous round are its sampled children.
    """
    protocol, names, groups = scenario.protocol, scenario.agent_names, scenario.groups()
    rounds, agents = protocol.num_rounds, len(names)
    leaves = branching**rounds
    num_episodes *= leaves
    env = scenario.make_env(num_episodes, split, derive_seed(seed, "lists"), "cpu", group_size=leaves)
    acted = torch.zeros(num_episodes, rounds, agents, dtype=torch.bool)
    rewards = torch.zeros(num_episodes, rounds, agents)
    chats = [[[""] * agents for _ in range(rounds)] for _ in range(num_episodes)]
    replies: list[list[list[str | None]]] = [[[None] * agents for _ in range(rounds)] for _ in range(num_episodes)]
    moves = [[[""] * agents for _ in range(rounds)] for _ in range(num_episodes)]
    ended = torch.zeros(num_episodes, dtype=torch.bool)
    final_state = None
    tensordict = env.reset()
    for round_index in range(rounds):
        state = tensordict["state"]
        active = protocol.active_agents_in(state).cpu() & ~ended.unsqueeze(-1)
        if not bool(active.any()):
            break
        visible = env.visible_cells(state).cpu()
        action = torch.full((num_episodes, agents, env.message_tokens), scenario.tokenizer.pad_token_id, dtype=torch.long)
        # Each block of leaves under one node of this round samples once, on its first row.
        block = branching ** (rounds - round_index - 1)
        for agent, name in enumerate(names):
            acting = active[:, agent].nonzero().flatten().tolist()
            rows = [row for row in acting if row % block == 0]
            if not rows:
                continue
            rendered = [
                scenario.render_chat(env, state, visible, row, agent, replies[row][:round_index]) for row in rows
            ]
            group = name if by_agent else groups[name]
            answers = models[group].reply(rendered, sampling[group], derive_seed(seed, f"reply:{round_index}:{name}"))
            parsed = [scenario.reply_action(answer, agent) for answer in answers]
            action[rows] = action[rows].index_put(
                (torch.arange(len(rows)), torch.full((len(rows),), agent)), scenario.encode_actions([p[0] for p in parsed])
            )
            for row, chat, answer, (_, meaning) in zip(rows, rendered, answers, parsed):
                chats[row][round_index][agent] = json.dumps(chat)
                replies[row][round_index][agent] = answer
                moves[row][round_index][agent] = meaning
            if block > 1:
                for row in acting:
                    leader = row - row % block
                    if row != leader:
                        action[row, agent] = action[leader, agent]
                        chats[row][round_index][agent] = chats[leader][round_index][agent]
                        replies[row][round_index][agent] = replies[leader][round_index][agent]
                        moves[row][round_index][agent] = moves[leader][round_index][agent]
        acted[:, round_index] = active
        tensordict["agents", "action"] = action.to(env.device)
        tensordict = env.step(tensordict)
        step_reward = tensordict["next", "agents", "reward"].squeeze(-1).cpu()
        rewards[:, round_index] = torch.where(ended.unsqueeze(-1), torch.zeros_like(step_reward), step_reward)
        done = tensordict["next", "done"].squeeze(-1).cpu()
        newly = done & ~ended
        next_state = tensordict["next", "state"].cpu()
        if final_state is None:
            final_state = next_state.clone()
        elif bool(newly.any()):
            final_state[newly] = next_state[newly]
        ended |= done
        tensordict = step_mdp(tensordict)
    turns = TensorDict(
        {
            "acted": acted,
            "reward": rewards,
            "chat": NonTensorStack.from_list(chats),
            "reply": NonTensorStack.from_list([[[r or "" for r in row] for row in episode] for episode in replies]),
            "move": NonTensorStack.from_list(moves),
        },
        batch_size=[num_episodes, rounds, agents],
    )
    return TensorDict(
        {
            "list_index": final_state["list_index"],
            "values": final_state["values"],
            "label": final_state["label"],
            "decision": final_state["decision"],
            "return": rewards.sum(1),
            "turns": turns,
        },
        batch_size=[num_episodes],
    )


def rollout_records(rollouts: TensorDict, agent_names: tuple[str, ...]) -> list[dict]:
    """One readable record per episode: the list, label, every turn (chat, reply, move, reward), decision,
    returns, and each agent's reward in every round (``round_rewards``: a prover is rewarded in the round
    the verifier decides, without a turn of its own)."""
    turns = rollouts["turns"]
    # Everything as Python lists once: indexing tensors element by element is slow on big rollouts.
    chats, replies, moves = (turns.get(key).tolist() for key in ("chat", "reply", "move"))
    acted, rewards = turns["acted"].tolist(), turns["reward"].tolist()
    returns, values = rollouts["return"].tolist(), rollouts["values"].tolist()
    decisions, labels, indices = (rollouts[key].tolist() for key in ("decision", "label", "list_index"))
    records = []
    for episode, episode_acted in enumerate(acted):
        dialogue = []
        for round_index, round_acted in enumerate(episode_acted):
            for agent, name in enumerate(agent_names):
                if round_acted[agent]:
                    dialogue.append(
                        {
                            "round": round_index,
                            "agent": name,
                            "chat": json.loads(chats[episode][round_index][agent]),
                            "reply": replies[episode][round_index][agent],
                            "move": moves[episode][round_index][agent],
                            "reward": rewards[episode][round_index][agent],
                        }
                    )
        decision, label = int(decisions[episode]), bool(labels[episode])
        records.append(
            {
                "list_index": int(indices[episode]),
                "values": values[episode],
                "label": label,
                "turns": dialogue,
                "decision": {1: "accept", 0: "reject"}.get(decision, "none"),
                "correct": decision >= 0 and bool(decision) == label,
                "returns": {name: returns[episode][agent] for agent, name in enumerate(agent_names)},
                "round_rewards": {
                    name: [step[agent] for step in rewards[episode]] for agent, name in enumerate(agent_names)
                },
            }
        )
    return records


def save_rollouts(rollouts: TensorDict, agent_names: tuple[str, ...], num_rounds: int, path: Path) -> None:
    """Write ``rollouts`` as JSONL (one episode per line, after a header line), atomically."""
    header = {"agents": list(agent_names), "rounds": num_rounds, "episodes": rollouts.batch_size[0]}
    lines = [json.dumps(header)] + [json.dumps(record) for record in rollout_records(rollouts, agent_names)]
    write_text_atomic("\n".join(lines) + "\n", path)


def load_rollouts(path: Path) -> TensorDict:
    """Read a file of :func:`save_rollouts` back into the rollouts TensorDict."""
    lines = Path(path).read_text().splitlines()
    header, records = json.loads(lines[0]), [json.loads(line) for line in lines[1:]]
    names, rounds = header["agents"], int(header["rounds"])
    episodes, agents = len(records), len(names)
    acted = torch.zeros(episodes, rounds, agents, dtype=torch.bool)
    rewards = torch.zeros(episodes, rounds, agents)
    strings = {key: [[[""] * agents for _ in range(rounds)] for _ in range(episodes)] for key in ("chat", "reply", "move")}
    for episode, record in enumerate(records):
        rewards[episode] = torch.tensor([record["round_rewards"][name] for name in names]).T
        for turn in record["turns"]:
            round_index, agent = turn["round"], names.index(turn["agent"])
            acted[episode, round_index, agent] = True
            strings["chat"][episode][round_index][agent] = json.dumps(turn["chat"])
            strings["reply"][episode][round_index][agent] = turn["reply"]
            strings["move"][episode][round_index][agent] = turn["move"]
    turns = TensorDict(
        {"acted": acted, "reward": rewards, **{key: NonTensorStack.from_list(value) for key, value in strings.items()}},
        batch_size=[episodes, rounds, agents],
    )
    decisions = {"accept": 1, "reject": 0, "none": -1}
    return TensorDict(
        {
            "list_index": torch.tensor([record["list_index"] for record in records]),
            "values": torch.tensor([record["values"] for record in records]),
            "label": torch.tensor([record["label"] for record in records]),
            "decision": torch.tensor([decisions[record["decision"]] for record in records]),
            "return": torch.tensor([[record["returns"][name] for name in names] for record in records]),
            "turns": turns,
        },
        batch_size=[episodes],
    )
