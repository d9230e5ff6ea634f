"""The hidden-bits environment.

Each episode draws a uniformly random string of ``num_bits`` bits. The prover
sees it and sends one message from ``message_vocab`` symbols in each message
round; the verifier sees only the messages and, in the decision round, guesses
the string (one of ``2 ** num_bits`` answers). A correct guess is rewarded 1.

With ``message_vocab ** message_rounds >= 2 ** num_bits`` the prover can encode
the whole string and the best expected reward is 1; otherwise it is
``message_vocab ** message_rounds / 2 ** num_bits``. Random play gets
``2 ** -num_bits``.

Observation of each agent, of length ``num_bits + message_rounds * vocab +
message_rounds + 2``: the bits (zeros for the verifier), the one-hot messages
sent so far, and the one-hot round number (``0 .. message_rounds + 1``, the last
value marking a finished episode).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from tensordict import TensorDict, TensorDictBase
from torchrl.data import Unbounded

from nip_like.protocols.base import Protocol
from nip_like.scenarios.environment import InteractionEnv


class HiddenBitsEnv(InteractionEnv):
    """Vectorised hidden-bits game (see the module docstring).

    Parameters
    ----------
    protocol : Protocol
        Must have an agent called ``"verifier"``; the others are provers.
    num_envs : int
        Number of parallel episodes.
    num_bits : int
        Length of the hidden bit string.
    message_vocab : int
        Number of distinct messages per round.
    device : torch.device or str
        Where the tensors live.
    seed : int
        Seed of the environment's generator.
    group_size : int
        Consecutive environments that play the same bit string.
    """

    def __init__(
        self,
        protocol: Protocol,
        num_envs: int,
        num_bits: int,
        message_vocab: int,
        device: torch.device | str = "cpu",
        seed: int = 0,
        group_size: int = 1,
    ) -> None:
        self.num_bits = num_bits
        self.message_vocab = message_vocab
        self.num_answers = 2**num_bits
        self.num_message_rounds = protocol.message_rounds()
        self.verifier_index = protocol.agent_index("verifier")
        observation_size = num_bits + self.num_message_rounds * message_vocab + protocol.num_rounds + 1
        super().__init__(
            protocol,
            num_envs=num_envs,
            num_actions=max(message_vocab, self.num_answers),
            observation_size=observation_size,
            device=device,
            seed=seed,
            group_size=group_size,
        )

    def _state_spec(self) -> dict[str, object]:
        rounds = max(self.num_message_rounds, 1)
        return {
            "bits": Unbounded(shape=(*self.batch_size, self.num_bits), dtype=torch.int64, device=self.device),
            "messages": Unbounded(shape=(*self.batch_size, rounds), dtype=torch.int64, device=self.device),
        }

    def _new_state(self, num_episodes: int) -> TensorDict:
        bits = torch.randint(0, 2, (num_episodes, self.num_bits), generator=self.rng)
        messages = torch.zeros(num_episodes, max(self.num_message_rounds, 1), dtype=torch.int64)
        return TensorDict({"bits": bits, "messages": messages}, batch_size=[num_episodes])

    def _observe(self, state: TensorDictBase) -> tuple[torch.Tensor, torch.Tensor]:
        batch = state.batch_size[0]
        round_index = state["round"]
        bits = state["bits"].float()
        rounds = torch.arange(self.num_message_rounds, device=self.device)
        sent = (rounds < round_index.unsqueeze(-1)).unsqueeze(-1)
        messages = F.one_hot(state["messages"][:, : self.num_message_rounds], self.message_vocab) * sent
        round_one_hot = F.one_hot(round_index.clamp(max=self.protocol.num_rounds), self.protocol.num_rounds + 1)
        shared = torch.cat([messages.flatten(1).float(), round_one_hot.float()], dim=-1)
        observations = []
        masks = []
        vocab_mask = torch.arange(self.num_actions, device=self.device) < self.message_vocab
        answer_mask = torch.arange(self.num_actions, device=self.device) < self.num_answers
        for index in range(self.num_agents):
            private = torch.zeros_like(bits) if index == self.verifier_index else bits
            observations.append(torch.cat([private, shared], dim=-1))
            masks.append(answer_mask if index == self.verifier_index else vocab_mask)
        observation = torch.stack(observations, dim=1)
        action_mask = torch.stack(masks).unsqueeze(0).expand(batch, -1, -1).clone()
        return observation, action_mask

    def answer(self, bits: torch.Tensor) -> torch.Tensor:
        """Return the answer index of each bit string (its binary value)."""
        weights = 2 ** torch.arange(self.num_bits - 1, -1, -1, device=bits.device)
        return (bits * weights).sum(-1)

    def _advance(
        self, state: TensorDictBase, action: torch.Tensor, active: torch.Tensor
    ) -> tuple[TensorDictBase, torch.Tensor, torch.Tensor]:
        round_index = state["round"]
        deciding = self.protocol.decision_round(round_index)
        speakers = active.clone()
        speakers[:, self.verifier_index] = False
        if self.num_message_rounds > 0:
            # The message of the round is the action of the (first) active prover.
            has_speaker = speakers.any(-1) & ~deciding
            speaker = speakers.float().argmax(-1)
            # Illegal symbols (only a policy that ignores the action mask sends them)
            # fold back into the vocabulary.
            message = action.gather(-1, speaker.unsqueeze(-1)).squeeze(-1) % self.message_vocab
            slot = round_index.clamp(max=self.num_message_rounds - 1)
            current = state["messages"].gather(-1, slot.unsqueeze(-1)).squeeze(-1)
            new = torch.where(has_speaker, message, current)
            state["messages"] = state["messages"].scatter(-1, slot.unsqueeze(-1), new.unsqueeze(-1))
        correct = (action[:, self.verifier_index] == self.answer(state["bits"])) & deciding
        reward = self.protocol.rewards(correct.float())
        ended = torch.zeros_like(deciding)
        return state, reward, ended
