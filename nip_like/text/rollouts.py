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
``"list_index"``                ``E``        the datapoint's index in the split (the list's, the program's)
``"values"``                    ``E, L``     the list (a game whose state has ``values``: duplicates)
``"label"``                     ``E``        accepting is right (the list holds a pair; the program is correct)
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

A saved file is checked before it is used. Its header line holds the number of
episodes and the SHA-256 of the lines after it, and :func:`save_rollouts`
returns the SHA-256 of the whole file, which the text trainers keep in their
checksummed experiment state; :func:`load_rollouts` refuses, in one
:class:`~nip_like.errors.CheckpointError` line naming the file, a file whose
bytes are not that digest, whose body is not its header's, that is cut, has
lines added or removed, or is not UTF-8 JSON.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Mapping

import torch
from tensordict import NonTensorStack, TensorDict
from torchrl.envs.utils import step_mdp

from nip_like.checkpoint import derive_seed, write_text_atomic
from nip_like.errors import CheckpointError
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
    group_size: int = 1,
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
    group_size : int
        Play each list this many times side by side (consecutive episodes;
        ``num_episodes`` must be a multiple), the test's
        ``trainer.test_rollouts``. Not combined with ``branching``.
    """
    if group_size > 1 and branching > 1:
        raise ValueError("play_episodes: group_size and branching cannot be combined")
    if num_episodes % group_size:
        raise ValueError(f"play_episodes: num_episodes ({num_episodes}) must be a multiple of group_size ({group_size})")
    protocol, names, groups = scenario.protocol, scenario.agent_names, scenario.groups()
    rounds, agents = protocol.num_rounds, len(names)
    leaves = branching**rounds
    num_episodes *= leaves
    env = scenario.make_text_env(num_episodes, split, derive_seed(seed, "lists"), "cpu", group_size=leaves * group_size)
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
            **({"values": final_state["values"]} if "values" in final_state.keys() else {}),
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
    returns = rollouts["return"].tolist()
    values = rollouts["values"].tolist() if "values" in rollouts.keys() else None
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
                **({"values": values[episode]} if values is not None else {}),
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


#: The layout of a rollouts file: 2 added the checksum and episode count to the header.
ROLLOUTS_FORMAT = 2

#: What a user can do about a damaged rollouts file, in every message about one.
_REMEDY = "delete it and resume to sample the iteration again with the same models and seed"


def save_rollouts(rollouts: TensorDict, agent_names: tuple[str, ...], num_rounds: int, path: Path) -> str:
    """Write ``rollouts`` as JSONL (one episode per line, after a header line), atomically.

    Returns
    -------
    str
        The SHA-256 of the file written, for :func:`load_rollouts`' ``expected_digest``.
    """
    body = "".join(json.dumps(record) + "\n" for record in rollout_records(rollouts, agent_names))
    header = {
        "format": ROLLOUTS_FORMAT,
        "agents": list(agent_names),
        "rounds": num_rounds,
        "episodes": rollouts.batch_size[0],
        "sha256": hashlib.sha256(body.encode()).hexdigest(),
    }
    text = json.dumps(header) + "\n" + body
    write_text_atomic(text, path)
    return hashlib.sha256(text.encode()).hexdigest()


def _damaged(path: Path, reason: str) -> CheckpointError:
    return CheckpointError(f"rollouts file {path} is damaged or was edited ({reason}); {_REMEDY}")


def _checked_records(path: Path, expected_digest: str | None) -> tuple[dict, list[dict]]:
    """The header and records of a rollouts file, after every check of the module docstring."""
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise CheckpointError(f"rollouts file {path} is unreadable ({error.strerror or type(error).__name__}); {_REMEDY}") from None
    if expected_digest is not None and hashlib.sha256(data).hexdigest() != expected_digest:
        raise _damaged(path, "its sha256 is not the one the run recorded when it wrote it")
    head, newline, body = data.partition(b"\n")
    try:
        header = json.loads(head.decode("utf-8"))
        known = isinstance(header, dict) and header.get("format") == ROLLOUTS_FORMAT
    except ValueError:  # UnicodeDecodeError and json.JSONDecodeError
        raise _damaged(path, "its header line is not UTF-8 JSON") from None
    if not known:
        raise _damaged(path, f"its header line is not a nip_like rollouts header of format {ROLLOUTS_FORMAT}")
    if not newline or hashlib.sha256(body).hexdigest() != header.get("sha256"):
        raise _damaged(path, "the episodes after its header do not match the header's sha256")
    try:
        records = [json.loads(line) for line in body.decode("utf-8").splitlines()]
    except ValueError:  # the checksum holds, so only a header and body edited together end here
        raise _damaged(path, "its episodes are not UTF-8 JSON lines") from None
    if len(records) != header.get("episodes"):
        raise _damaged(path, f"it holds {len(records)} episodes, its header says {header.get('episodes')}")
    return header, records


def load_rollouts(path: Path, expected_digest: str | None = None) -> TensorDict:
    """Read a file of :func:`save_rollouts` back into the rollouts TensorDict, after checking it.

    Parameters
    ----------
    path : Path
        The file.
    expected_digest : str, optional
        The SHA-256 :func:`save_rollouts` returned for it; without it only the
        header's checksum of the episodes is checked.

    Raises
    ------
    CheckpointError
        The file is unreadable, damaged or edited (see the module docstring),
        in one line naming it and what to do.
    """
    header, records = _checked_records(path, expected_digest)
    try:
        return _rollouts_of(header, records)
    except (KeyError, IndexError, TypeError, ValueError) as error:  # a header and body edited together
        raise _damaged(path, f"an episode lacks a field or holds a wrong value: {type(error).__name__}: {error}") from None


def _rollouts_of(header: dict, records: list[dict]) -> TensorDict:
    """The rollouts TensorDict of a file's header and records."""
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
            **({"values": torch.tensor([record["values"] for record in records])} if not records or "values" in records[0] else {}),
            "label": torch.tensor([record["label"] for record in records]),
            "decision": torch.tensor([decisions[record["decision"]] for record in records]),
            "return": torch.tensor([[record["returns"][name] for name in names] for record in records]),
            "turns": turns,
        },
        batch_size=[episodes],
    )
