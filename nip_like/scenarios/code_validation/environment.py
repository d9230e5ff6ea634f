"""The code-validation game as an environment: the verifier decides whether a program solves its problem.

Each episode draws a program of the split (with its problem); the verifier
must accept it if it passes every hidden test of its problem and reject it
otherwise. Agents speak in the turns the protocol sets. What an agent says is
free text that the scenario parses
(:func:`~nip_like.scenarios.code_validation.chat_text.parse_reply`) into a
*move*, one symbol:

* ``accept`` or ``reject``, from the verifier on a turn where it may decide:
  the decision, which ends the episode;
* ``message``: anything else with text in it (a prover's argument, a
  verifier's question): no effect on the game, the others read it;
* ``<pad>``: an empty reply, or no turn.

A verifier that has not decided by its last turn ends the episode
*undecided*: that counts as a wrong decision (reward
``-verifier_incorrect_penalty``) and no prover is rewarded.

:class:`CodeValidationEnv` is the game the text agents play through (the
text trainers; :meth:`~nip_like.scenarios.chat.ChatGame.make_text_env`): its
action is each agent's move. The chat view of the RL loop's language-model
agents (:class:`~nip_like.scenarios.code_validation.chat_view.CodeValidationChatViewEnv`)
adds the prompts and the replies in each agent's own tokens.

Entries added to :class:`~nip_like.scenarios.environment.InteractionEnv`'s
(``B`` episodes, ``N`` agents, ``R`` rounds):

========================================  ===============  ==============================================
key                                       shape            meaning
========================================  ===============  ==============================================
``("state", "list_index")``               ``B``            the program's index in the split
``("state", "label")``                    ``B``            the program passes every hidden test (bool)
``("state", "moves")``                    ``B, R, N``      each agent's move in each round (``<pad>`` elsewhere)
``("state", "decision")``                 ``B``            ``1`` accept, ``0`` reject, ``-1`` none yet/undecided
``("agents", "list_index")``              ``B, N``         the program each agent reads (the move game's input)
``("agents", "action")``                  ``B, N, 1``      each agent's move (input of a step)
========================================  ===============  ==============================================
"""

from __future__ import annotations

from typing import Sequence

import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.data import Binary, Bounded, Unbounded

from nip_like.errors import ConfigError
from nip_like.protocols.proof import ProofProtocol
from nip_like.scenarios.code_validation.chat_text import ACCEPT, REJECT
from nip_like.scenarios.environment import InteractionEnv

#: The symbols of the moves, in the order of the move tokenizer's alphabet (after its special tokens).
MOVE_SYMBOLS = ("message", ACCEPT, REJECT)


class CodeValidationEnv(InteractionEnv):
    """The code-validation game whose action is each agent's move (see the module docstring).

    Parameters
    ----------
    protocol : ProofProtocol
        Turns, channels and rewards.
    labels : torch.Tensor
        ``(M,)`` bool: the split's programs' labels, by index.
    datapoints : sequence of str
        ``M`` texts: each program with its problem, as the agents read them
        (:func:`~nip_like.scenarios.code_validation.chat_text.datapoint_text`).
    move_ids : dict of str to int
        The token ids of ``pad`` and of each of :data:`MOVE_SYMBOLS`.
    vocab_size : int
        Size of the move tokenizer (the bound of the action spec).
    num_envs, device, seed, group_size
        As for :class:`~nip_like.scenarios.environment.InteractionEnv`.
    """

    def __init__(
        self,
        protocol: ProofProtocol,
        labels: torch.Tensor,
        datapoints: Sequence[str],
        move_ids: dict[str, int],
        vocab_size: int,
        num_envs: int = 1,
        device: torch.device | str = "cpu",
        seed: int = 0,
        group_size: int = 1,
    ) -> None:
        if len(labels) == 0 or len(labels) != len(datapoints):
            raise ConfigError(f"a code-validation split needs one text per program, got {len(datapoints)} for {len(labels)}")
        self.datapoints = list(datapoints)
        self.labels = torch.as_tensor(labels, dtype=torch.bool)
        self.num_programs = len(self.labels)
        self.move_ids = dict(move_ids)
        self.vocab_size = int(vocab_size)
        self.verifier_index = protocol.verifier_index
        self.visibility = protocol.visibility()
        # Messages of the last round are never read: the episode is over.
        self.seen_rounds = protocol.num_rounds - 1
        super().__init__(protocol, num_envs=num_envs, device=device, seed=seed, group_size=group_size)
        self.labels = self.labels.to(self.device)
        self.visibility = self.visibility.to(self.device)

    #: ``T`` of the move game: one symbol per move.
    message_tokens = 1

    # ----------------------------------------------------------------- specs
    def _state_spec(self) -> dict[str, object]:
        b, device = self.batch_size, self.device
        return {
            "list_index": Unbounded(shape=b, dtype=torch.int64, device=device),
            "label": Binary(shape=b, dtype=torch.bool, device=device),
            "moves": Unbounded(shape=(*b, self.protocol.num_rounds, self.num_agents), dtype=torch.int64, device=device),
            "decision": Unbounded(shape=b, dtype=torch.int64, device=device),
        }

    def _policy_input_spec(self) -> dict[str, object]:
        return {"list_index": Unbounded(shape=(*self.batch_size, self.num_agents), dtype=torch.int64, device=self.device)}

    @property
    def action_tokens(self) -> int:
        """Width of an agent's action: one move symbol (the chat view's replies are longer)."""
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
        return self.new_state(torch.randint(0, self.num_programs, (num_episodes,), generator=self.rng))

    def new_state(self, index: torch.Tensor) -> TensorDict:
        """Fresh episodes on the split's programs ``index`` ``(E,)``: the game's state before any turn
        (without the protocol's state, the round or the group ids of a reset)."""
        index = index.to(self.device)
        num_episodes = index.shape[0]
        shape = (num_episodes, self.protocol.num_rounds, self.num_agents)
        return TensorDict(
            {
                "list_index": index,
                "label": self.labels[index],
                "moves": torch.full(shape, self.move_ids["pad"], dtype=torch.int64, device=self.device),
                "decision": torch.full((num_episodes,), -1, dtype=torch.int64, device=self.device),
            },
            batch_size=[num_episodes],
            device=self.device,
        )

    def visible_cells(self, state: TensorDictBase) -> torch.Tensor:
        """``(B, N, 1)``, all True: every agent reads the whole problem and program (the chat game's view of the datapoint)."""
        return torch.ones(state.batch_size[0], self.num_agents, 1, dtype=torch.bool, device=self.device)

    def _policy_inputs(self, state: TensorDictBase) -> dict[str, torch.Tensor]:
        return {"list_index": state["list_index"].unsqueeze(-1).expand(-1, self.num_agents)}

    def _advance(
        self, state: TensorDictBase, action: torch.Tensor, active: torch.Tensor
    ) -> tuple[TensorDictBase, torch.Tensor, torch.Tensor]:
        return self.play_moves(state, action[..., 0], active)

    def play_moves(
        self, state: TensorDictBase, moves: torch.Tensor, active: torch.Tensor
    ) -> tuple[TensorDictBase, torch.Tensor, torch.Tensor]:
        """Play one round of ``(B, N)`` moves of the ``active`` agents: the new state, the rewards, which episodes ended."""
        round_index = state["round"]
        pad = self.move_ids["pad"]
        moves = torch.where(active, moves, torch.full_like(moves, pad))
        rows = torch.arange(moves.shape[0], device=self.device)
        played = state["moves"].clone()
        played[rows, round_index.clamp(max=self.protocol.num_rounds - 1)] = moves
        state["moves"] = played

        verifier_acted = active[:, self.verifier_index]
        move = moves[:, self.verifier_index]
        accept = move == self.move_ids[ACCEPT]
        decided = verifier_acted & self.protocol.may_decide(round_index) & (accept | (move == self.move_ids[REJECT]))
        undecided = verifier_acted & self.protocol.decision_round(round_index) & ~decided
        state["decision"] = torch.where(decided, accept.long(), state["decision"])
        reward = self.protocol.step_rewards(decided, accept, state["label"], verifier_acted)
        # An undecided verifier is wrong, and no prover's side won.
        reward = torch.where(undecided.unsqueeze(-1), torch.zeros_like(reward), reward)
        penalty = -self.protocol.verifier_incorrect_penalty
        if self.protocol.shared_reward:
            reward = torch.where(undecided.unsqueeze(-1), torch.full_like(reward, penalty), reward)
        else:
            reward[:, self.verifier_index] = torch.where(undecided, penalty, reward[:, self.verifier_index])
        return state, reward, decided | undecided
