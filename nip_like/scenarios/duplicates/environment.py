"""The duplicates interactive proof, played in tokens.

Each episode draws a list ``x_0 .. x_{L-1}`` (values ``0 .. V-1``) from the
dataset; the verifier must say whether two cells hold the same value. Agents
speak in turns set by the protocol; a message is a token sequence of at most
``T`` tokens (``<eos>`` included) sampled by a language model.

What a message does, read from its first two tokens:

* ``c<i> c<j>`` with ``i != j`` (any agent): the environment *reveals* cells
  ``i`` and ``j`` to everyone who sees the sender's channel;
* ``accept`` / ``reject`` (the verifier, on a turn where it may decide): the
  decision, which ends the episode;
* anything else: a message with no effect, shown to the other agents as it is.

A verifier that has not decided on its last turn (its message is not a
decision) ends the episode *undecided*: that counts as a wrong decision
(reward ``-verifier_incorrect_penalty``) and no prover is rewarded.

What an agent reads, its prompt, is a fixed layout of ``P`` tokens with a mask
(``False`` at the slots that are empty for it):

``<bos>``, then for each cell its name ``c<i>`` and its value token ``v<x>``
(``?`` where the cell is hidden from the agent), ``|``, then for each round whose messages can
be seen and each agent: the speaker token ``<name>:`` and the message's ``T``
tokens. Provers see every cell. The verifier sees every cell with
``verifier_view: full`` and, with ``verifier_view: cells``, only the cells that
messages it can see have revealed, so without a prover it decides blind.

Entries added to :class:`~nip_like.scenarios.environment.InteractionEnv`'s
(``B`` episodes, ``N`` agents, ``L`` cells, ``R`` rounds, ``T`` message tokens):

========================================  ===============  ==============================================
key                                       shape            meaning
========================================  ===============  ==============================================
``("state", "list_index")``               ``B``            index of the list in the split
``("state", "values")``                   ``B, L``         the list (long)
``("state", "label")``                    ``B``            the list holds a duplicate pair (bool)
``("state", "certificate")``              ``B, 2``         the duplicate pair's cells, ``-1`` without one
``("state", "messages")``                 ``B, R, N, T``   every message sent so far (``<pad>`` elsewhere)
``("state", "revealed")``                 ``B, N, L``      cells revealed by each agent's messages (bool)
``("state", "decision")``                 ``B``            ``1`` accept, ``0`` reject, ``-1`` none yet/undecided
``("agents", "prompt_ids")``              ``B, N, P``      each agent's prompt (long)
``("agents", "prompt_mask")``             ``B, N, P``      its real tokens (bool)
``("agents", "action")``                  ``B, N, T``      the message each agent sends (input of a step)
========================================  ===============  ==============================================

The action's real tokens are those that are not ``<pad>``: a policy never
samples ``<pad>``, so the token mask of a message is ``action != pad``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.data import Binary, Bounded, Unbounded

from nip_like.errors import ConfigError
from nip_like.protocols.proof import ProofProtocol
from nip_like.scenarios.duplicates.data import DuplicateLists
from nip_like.scenarios.environment import InteractionEnv

#: How the verifier sees the list: only the revealed cells, or all of it.
VERIFIER_VIEWS = ("cells", "full")
#: The token a hidden cell shows.
HIDDEN = "?"
#: The token between the list and the dialogue.
SEPARATOR = "|"
ACCEPT = "accept"
REJECT = "reject"


def speaker_token(agent: str) -> str:
    """The token that opens ``agent``'s messages in a prompt (``"<agent>:"``)."""
    return f"{agent}:"


@dataclass(frozen=True)
class DuplicateSymbols:
    """The alphabet of the duplicates game, and where each kind of symbol sits in a tokenizer.

    Parameters
    ----------
    length : int
        ``L``, cells in a list (cell tokens ``c0 .. c<L-1>``).
    num_values : int
        ``V`` (value tokens ``v0 .. v<V-1>``).
    agents : tuple of str
        The protocol's agents (one speaker token each).
    """

    length: int
    num_values: int
    agents: tuple[str, ...]

    def alphabet(self) -> list[str]:
        """The symbols in tokenizer order: values, cells, ``?``, ``|``, decisions, speakers."""
        return [
            *(f"v{value}" for value in range(self.num_values)),
            *(f"c{cell}" for cell in range(self.length)),
            HIDDEN,
            SEPARATOR,
            ACCEPT,
            REJECT,
            *(speaker_token(agent) for agent in self.agents),
        ]

    def ids(self, tokenizer) -> dict[str, int]:
        """Token ids of the symbol kinds: ``value0``, ``cell0`` (the first of each run), and the single symbols."""
        vocab = tokenizer.get_vocab()
        missing = [symbol for symbol in self.alphabet() if symbol not in vocab]
        if missing:
            raise ConfigError(f"the agents' tokenizer lacks the duplicates symbols {missing[:5]}")
        for run, count in (("v", self.num_values), ("c", self.length)):
            first = vocab[f"{run}0"]
            if [vocab[f"{run}{k}"] for k in range(count)] != list(range(first, first + count)):
                raise ConfigError(f"the tokenizer's {run}0 .. {run}{count - 1} tokens must have consecutive ids")
        return {
            "value0": vocab["v0"],
            "cell0": vocab["c0"],
            "hidden": vocab[HIDDEN],
            "separator": vocab[SEPARATOR],
            "accept": vocab[ACCEPT],
            "reject": vocab[REJECT],
            "bos": tokenizer.bos_token_id,
            "pad": tokenizer.pad_token_id,
            **{f"speaker:{agent}": vocab[speaker_token(agent)] for agent in self.agents},
        }


def named_cells(messages: torch.Tensor, cell0: int, length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Parse ``(..., T)`` messages: do they name two different cells, and which?

    Parameters
    ----------
    messages : torch.Tensor
        Token ids.
    cell0 : int
        The id of ``c0`` (the cell tokens' ids are consecutive).
    length : int
        ``L``, cells in a list.

    Returns
    -------
    names : torch.Tensor
        ``(...)`` bool: the first two tokens are cell tokens of different cells.
    first, second : torch.Tensor
        ``(...)`` the two cells (clamped into range where ``names`` is False).
    """
    first = messages[..., 0] - cell0
    second = messages[..., 1] - cell0 if messages.shape[-1] > 1 else torch.full_like(first, -1)
    in_range = (first >= 0) & (first < length) & (second >= 0) & (second < length)
    names = in_range & (first != second)
    return names, first.clamp(0, length - 1), second.clamp(0, length - 1)


class DuplicatesEnv(InteractionEnv):
    """Vectorised duplicates interactive proof with token-sequence messages (see the module docstring).

    Parameters
    ----------
    protocol : ProofProtocol
        Turns, channels and rewards.
    lists : DuplicateLists
        The split's lists, labels and certificates.
    token_ids : dict
        :meth:`DuplicateSymbols.ids` of the agents' tokenizer.
    vocab_size : int
        Size of the tokenizer (the bound of the action spec).
    message_tokens : int
        ``T``: tokens in a message, ``<eos>`` included.
    verifier_view : str
        ``"cells"`` or ``"full"``.
    num_envs, device, seed, group_size
        As for :class:`~nip_like.scenarios.environment.InteractionEnv`.
    """

    def __init__(
        self,
        protocol: ProofProtocol,
        lists: DuplicateLists,
        token_ids: dict[str, int],
        vocab_size: int,
        message_tokens: int,
        verifier_view: str = "cells",
        num_envs: int = 1,
        device: torch.device | str = "cpu",
        seed: int = 0,
        group_size: int = 1,
    ) -> None:
        if verifier_view not in VERIFIER_VIEWS:
            raise ConfigError(f"scenario.verifier_view must be one of {list(VERIFIER_VIEWS)}, got {verifier_view!r}")
        if message_tokens < 1:
            raise ConfigError(f"a message needs at least one token, got {message_tokens}")
        self.ids = dict(token_ids)
        self.vocab_size = int(vocab_size)
        self.message_tokens = int(message_tokens)
        self.verifier_view = verifier_view
        self.length = lists.length
        self.num_lists = len(lists)
        self.data = {"values": lists.values, "label": lists.label, "certificate": lists.certificate}
        self.verifier_index = protocol.verifier_index
        self.visibility = protocol.visibility()
        # Messages of the last round are never read: the episode is over.
        self.seen_rounds = protocol.num_rounds - 1
        self.speakers = torch.tensor([self.ids[f"speaker:{agent}"] for agent in protocol.agent_names])
        super().__init__(protocol, num_envs=num_envs, device=device, seed=seed, group_size=group_size)
        self.data = {key: value.to(self.device) for key, value in self.data.items()}
        self.visibility = self.visibility.to(self.device)
        self.speakers = self.speakers.to(self.device)

    @property
    def prompt_length(self) -> int:
        """``P``: ``<bos>``, each cell's name and value, ``|``, then a speaker token and a message per agent and seen round."""
        return 2 * self.length + 2 + self.seen_rounds * self.num_agents * (1 + self.message_tokens)

    # ----------------------------------------------------------------- specs
    def _state_spec(self) -> dict[str, object]:
        b, device = self.batch_size, self.device
        rounds, agents, tokens = self.protocol.num_rounds, self.num_agents, self.message_tokens
        return {
            "list_index": Unbounded(shape=b, dtype=torch.int64, device=device),
            "values": Unbounded(shape=(*b, self.length), dtype=torch.int64, device=device),
            "label": Binary(shape=b, dtype=torch.bool, device=device),
            "certificate": Unbounded(shape=(*b, 2), dtype=torch.int64, device=device),
            "messages": Unbounded(shape=(*b, rounds, agents, tokens), dtype=torch.int64, device=device),
            "revealed": Binary(shape=(*b, agents, self.length), dtype=torch.bool, device=device),
            "decision": Unbounded(shape=b, dtype=torch.int64, device=device),
        }

    def _policy_input_spec(self) -> dict[str, object]:
        agents = (*self.batch_size, self.num_agents)
        return {
            "prompt_ids": Bounded(
                low=0, high=self.vocab_size - 1, shape=(*agents, self.prompt_length), dtype=torch.int64, device=self.device
            ),
            "prompt_mask": Binary(shape=(*agents, self.prompt_length), dtype=torch.bool, device=self.device),
        }

    @property
    def action_tokens(self) -> int:
        """Width of an agent's action: a message of ``message_tokens`` symbols (the chat view's replies are longer)."""
        return self.message_tokens

    def _agent_action_spec(self) -> object:
        return Bounded(
            low=0,
            high=self.vocab_size - 1,
            shape=(*self.batch_size, self.num_agents, self.action_tokens),
            dtype=torch.int64,
            device=self.device,
        )

    # ------------------------------------------------------------ the game
    def _new_state(self, num_episodes: int) -> TensorDict:
        index = torch.randint(0, self.num_lists, (num_episodes,), generator=self.rng).to(self.device)
        shape = (num_episodes, self.protocol.num_rounds, self.num_agents, self.message_tokens)
        return TensorDict(
            {
                "list_index": index,
                "values": self.data["values"][index],
                "label": self.data["label"][index],
                "certificate": self.data["certificate"][index],
                "messages": torch.full(shape, self.ids["pad"], dtype=torch.int64, device=self.device),
                "revealed": torch.zeros(num_episodes, self.num_agents, self.length, dtype=torch.bool, device=self.device),
                "decision": torch.full((num_episodes,), -1, device=self.device),
            },
            batch_size=[num_episodes],
            device=self.device,
        )

    def visible_cells(self, state: TensorDictBase) -> torch.Tensor:
        """``(B, N, L)``: which cells each agent sees."""
        # Agent i sees the cells revealed by the senders whose channel it shares.
        revealed = (self.visibility.float() @ state["revealed"].float()) > 0
        everything = torch.ones_like(revealed)
        sees_all = torch.ones(self.num_agents, dtype=torch.bool, device=self.device)
        if self.verifier_view == "cells":
            sees_all[self.verifier_index] = False
        return torch.where(sees_all.view(1, -1, 1), everything, revealed)

    def _policy_inputs(self, state: TensorDictBase) -> dict[str, torch.Tensor]:
        batch, agents = state.batch_size[0], self.num_agents
        shown = torch.where(
            self.visible_cells(state),
            self.ids["value0"] + state["values"].unsqueeze(1),
            torch.full((), self.ids["hidden"], device=self.device),
        )
        # Each value follows its cell's name ("c0 v4 c1 ? ..."), so naming a cell is copying a token.
        names = self.ids["cell0"] + torch.arange(self.length, device=self.device).expand_as(shown)
        cells = torch.stack([names, shown], dim=-1).reshape(batch, agents, 2 * self.length)
        edge = torch.full((batch, agents, 1), 0, dtype=torch.int64, device=self.device)
        header = torch.cat([edge + self.ids["bos"], cells, edge + self.ids["separator"]], dim=-1)
        header_mask = torch.ones_like(header, dtype=torch.bool)
        if not self.seen_rounds:
            return {"prompt_ids": header, "prompt_mask": header_mask}
        messages = state["messages"][:, : self.seen_rounds]  # (B, R, N_sender, T)
        message_mask = messages != self.ids["pad"]
        sent = message_mask.any(-1, keepdim=True)
        speaker = self.speakers.view(1, 1, -1, 1).expand(batch, self.seen_rounds, agents, 1)
        blocks = torch.cat([speaker, messages], dim=-1)  # (B, R, N_sender, 1 + T)
        block_mask = torch.cat([sent, message_mask], dim=-1)
        # Viewer i reads sender j's blocks where it shares j's channel.
        seen = self.visibility.view(1, agents, 1, agents, 1)
        block_mask = block_mask.unsqueeze(1) & seen
        blocks = blocks.unsqueeze(1).expand(batch, agents, *blocks.shape[1:])
        blocks = torch.where(block_mask, blocks, torch.full((), self.ids["pad"], device=self.device))
        return {
            "prompt_ids": torch.cat([header, blocks.reshape(batch, agents, -1)], dim=-1),
            "prompt_mask": torch.cat([header_mask, block_mask.reshape(batch, agents, -1)], dim=-1),
        }

    def scripted_replies(self, moves: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The messages that make ``(B, N, T)`` moves, and their masks: in the token view, the moves themselves.

        A scripted player (the warm start's demonstrations) writes its moves in
        game symbols; a view whose agents write otherwise (the chat view)
        translates them into what its agents would send.
        """
        return moves, moves != self.ids["pad"]

    def new_state(self, num_episodes: int) -> TensorDictBase:
        """Fresh episodes on random lists of the split (the game's state before any turn)."""
        return self._new_state(num_episodes)

    def named_cells(self, messages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Parse ``(..., T)`` messages (see :func:`named_cells`)."""
        return named_cells(messages, self.ids["cell0"], self.length)

    def _advance(
        self, state: TensorDictBase, action: torch.Tensor, active: torch.Tensor
    ) -> tuple[TensorDictBase, torch.Tensor, torch.Tensor]:
        round_index = state["round"]
        pad = self.ids["pad"]
        message = torch.where(active.unsqueeze(-1), action, torch.full((), pad, device=self.device))
        step = round_index.clamp(max=self.protocol.num_rounds - 1).view(-1, 1, 1, 1)
        index = step.expand(-1, 1, self.num_agents, self.message_tokens)
        state["messages"] = state["messages"].scatter(1, index, message.unsqueeze(1))

        names, first, second = self.named_cells(message)
        reveal = torch.zeros_like(state["revealed"])
        reveal.scatter_(-1, first.unsqueeze(-1), True)
        reveal.scatter_(-1, second.unsqueeze(-1), True)
        state["revealed"] = state["revealed"] | (reveal & (names & active).unsqueeze(-1))

        verifier_acted = active[:, self.verifier_index]
        opening = message[:, self.verifier_index, 0]
        is_decision = (opening == self.ids["accept"]) | (opening == self.ids["reject"])
        decided = verifier_acted & self.protocol.may_decide(round_index) & is_decision
        undecided = verifier_acted & self.protocol.decision_round(round_index) & ~decided
        accept = opening == self.ids["accept"]
        state["decision"] = torch.where(decided, accept.long(), state["decision"])
        reward = self.protocol.step_rewards(decided, accept, state["label"], verifier_acted)
        # An undecided verifier is wrong, and no prover's side won.
        reward = torch.where(
            undecided.unsqueeze(-1), torch.zeros_like(reward), reward
        )
        penalty = -self.protocol.verifier_incorrect_penalty
        if self.protocol.shared_reward:
            reward = torch.where(undecided.unsqueeze(-1), torch.full_like(reward, penalty), reward)
        else:
            reward[:, self.verifier_index] = torch.where(undecided, penalty, reward[:, self.verifier_index])
        return state, reward, decided | undecided
