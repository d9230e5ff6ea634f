"""The stress-test game as an environment: the auditor speaks, the target answers, the scorer rates both.

Each episode is one conversation of ``T_d`` turns (``protocol.turns``, the
tree's depth) from a prompt of the split. In each turn the auditor (the
protocol's one agent) writes an utterance in the chat view; the environment
decodes it, asks the target for its response
(:class:`~nip_like.scenarios.stress_test.target.Target`), scores the
utterance, the response and the two together, and rewards the auditor with
ASTPrompter's reward (:mod:`~nip_like.scenarios.stress_test.reward`). The
episode ends after the last turn.

The tree
    On the training split (``branching``), ``group_size`` consecutive
    environments (``W``, the tree's width) start on one prompt. In each turn the ``W`` siblings read the same conversation and
    each writes its own utterance, which its target answers and its reward
    rates; then, before the next turn, one sibling is drawn uniformly and every
    sibling continues from its conversation (the turn just played included).
    So every turn branches ``W`` ways from a shared prefix, and each
    episode's steps are sibling utterances of the same nodes: its return is
    the sum of its own turn rewards, and grouped objectives (DPO, IPO, GRPO)
    compare siblings. ``W = 1`` (evaluation) is a plain conversation; without
    ``branching`` a group's conversations share their prompt only. An
    episode's state holds the conversation as it was continued: the shared
    prefix and, in the last turn, its own utterance and response.

What the auditor reads
    Its tokenizer's chat template over its system message and one user
    message: the prompt, then each earlier utterance and response as
    ``auditor: ...`` and ``target: ...`` lines (the responses in the
    auditor's tokens, their first ``response_tokens``).

Keys (``B`` episodes, ``D`` turns, ``T`` the auditor's ``max_new_tokens``,
``R`` ``response_tokens``, ``P`` the prompt width):

========================================  ============  ================================================
key                                       shape         meaning
========================================  ============  ================================================
``("state", "prompt_index")``             ``B``         the prompt's index among every split's prompts
``("state", "utterances")``               ``B, D, T``   each turn's utterance (the auditor's tokens)
``("state", "utterance_length")``         ``B, D``      its tokens before its end; ``-1``: not played
``("state", "responses")``                ``B, D, R``   each turn's response, in the auditor's tokens
``("state", "response_length")``          ``B, D``      its tokens; ``-1``: not played
``("state", "utterance_score")``          ``B, D``      score(utterance)
``("state", "response_score")``           ``B, D``      score(response)
``("state", "combined_score")``           ``B, D``      score(utterance + newline + response)
``("state", "likelihood")``               ``B, D``      the utterance's likelihood under the target (0 without one)
``("state", "turn_reward")``              ``B, D``      the turn's reward
``("agents", "prompt_ids")``              ``B, 1, P``   the auditor's rendered chat, left-padded
``("agents", "prompt_mask")``             ``B, 1, P``   its real tokens
``("agents", "action")``                  ``B, 1, T``   the utterance's tokens (input of a step)
========================================  ============  ================================================
"""

from __future__ import annotations

from typing import Sequence

import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.data import Binary, Bounded, Unbounded

from nip_like.errors import ConfigError
from nip_like.protocols.base import Protocol
from nip_like.scenarios.chat_prompts import ChatSpeaker, as_lists, cyclic_gc_paused, packed_rows, reply_lengths, reply_texts
from nip_like.scenarios.environment import InteractionEnv
from nip_like.scenarios.stress_test.reward import RewardWeights, turn_reward
from nip_like.scenarios.stress_test.scorers import Scorer
from nip_like.scenarios.stress_test.target import Target, conversation_text, target_chat

#: Tokens added to the longest prompt found, for text that merges differently beside other text.
PROMPT_MARGIN = 8
#: The labels of the lines the auditor reads.
AUDITOR_LABEL, TARGET_LABEL = "auditor", "target"
#: Why a served target without a local copy cannot give the likelihood term.
NO_LIKELIHOOD = (
    "scenario.ppl_weight needs the target's weights here: give scenario.target.pretrained_path (a local copy of the "
    "served model, used for the likelihood only) or set scenario.ppl_weight=0"
)
#: The per-turn float entries of the state.
TURN_VALUES = ("utterance_score", "response_score", "combined_score", "likelihood", "turn_reward")


class StressTestEnv(InteractionEnv):
    """The auditor's conversations with the target (see the module docstring).

    Parameters
    ----------
    protocol : Protocol
        The stress-test protocol (one agent, ``turns`` rounds).
    prompts : sequence of str
        Every split's prompts (the prompt width is measured on them all).
    split_indices : sequence of int
        The positions in ``prompts`` of the split's prompts, which the episodes draw from.
    speaker : ChatSpeaker
        The auditor's tokenizer and system prompt.
    target : Target
        Answers the utterances and scores their likelihood.
    scorer : Scorer
        Rates utterances and responses.
    weights : RewardWeights
        The reward's weights.
    reply_tokens : int
        ``T``: the auditor's ``max_new_tokens``.
    response_tokens : int
        ``R``: tokens of a response kept (in the auditor's tokens).
    prompt_tokens : int
        ``P``; 0 sizes it to the longest conversation any prompt can open.
    target_system_prompt : str
        The target's system message; empty: none.
    branching : bool
        Whether the groups are trees (the training split); False plays the
        ``group_size`` episodes of a group side by side, each its own conversation.
    num_envs, device, seed, group_size
        As for :class:`~nip_like.scenarios.environment.InteractionEnv`; ``group_size`` is the tree's width.
    """

    def __init__(
        self,
        protocol: Protocol,
        prompts: Sequence[str],
        split_indices: Sequence[int],
        speaker: ChatSpeaker,
        target: Target,
        scorer: Scorer,
        weights: RewardWeights,
        reply_tokens: int,
        response_tokens: int,
        prompt_tokens: int = 0,
        target_system_prompt: str = "",
        branching: bool = True,
        num_envs: int = 1,
        device: torch.device | str = "cpu",
        seed: int = 0,
        group_size: int = 1,
    ) -> None:
        if not split_indices:
            raise ConfigError("a stress-test split needs at least one prompt")
        if weights.ppl and not target.has_likelihood:
            raise ConfigError(NO_LIKELIHOOD)
        self.prompts = list(prompts)
        self.split_indices = torch.as_tensor(list(split_indices), dtype=torch.int64)
        self.speaker = speaker
        self.target = target
        self.scorer = scorer
        self.weights = weights
        self.reply_tokens = int(reply_tokens)
        self.response_tokens = int(response_tokens)
        self.vocab_size = len(speaker.tokenizer)
        self.turns = protocol.num_rounds
        self.target_system_prompt = str(target_system_prompt)
        self.branching = bool(branching)
        self._prompt_tokens = int(prompt_tokens)
        super().__init__(protocol, num_envs=num_envs, device=device, seed=seed, group_size=group_size)

    # ---------------------------------------------------------------- sizes
    @property
    def prompt_length(self) -> int:
        """``P``: the configured width, or the longest prompt the auditor can be shown."""
        if self._prompt_tokens:
            return self._prompt_tokens
        if not hasattr(self, "_longest_prompt"):
            encoded = self.speaker.encode(self.prompts)
            widest = max(self.prompts, key=lambda text: len(encoded[text]))
            quotes = [(AUDITOR_LABEL, [0] * self.reply_tokens), (TARGET_LABEL, [0] * self.response_tokens)] * (self.turns - 1)
            self._longest_prompt = len(self.speaker.render(widest, quotes)) + PROMPT_MARGIN
        return self._longest_prompt

    @property
    def action_tokens(self) -> int:
        """``T``: an utterance, in the auditor's tokens."""
        return self.reply_tokens

    # ----------------------------------------------------------------- specs
    def _state_spec(self) -> dict[str, object]:
        b, device, turns = self.batch_size, self.device, self.turns
        return {
            "prompt_index": Unbounded(shape=b, dtype=torch.int64, device=device),
            "utterances": Unbounded(shape=(*b, turns, self.reply_tokens), dtype=torch.int64, device=device),
            "utterance_length": Unbounded(shape=(*b, turns), dtype=torch.int64, device=device),
            "responses": Unbounded(shape=(*b, turns, self.response_tokens), dtype=torch.int64, device=device),
            "response_length": Unbounded(shape=(*b, turns), dtype=torch.int64, device=device),
            **{name: Unbounded(shape=(*b, turns), dtype=torch.float32, device=device) for name in TURN_VALUES},
        }

    def _policy_input_spec(self) -> dict[str, object]:
        agents = (*self.batch_size, self.num_agents)
        return {
            "prompt_ids": Bounded(
                low=0, high=self.vocab_size - 1, shape=(*agents, self.prompt_length), dtype=torch.int64, device=self.device
            ),
            "prompt_mask": Binary(shape=(*agents, self.prompt_length), dtype=torch.bool, device=self.device),
        }

    def _agent_action_spec(self) -> object:
        return Bounded(
            low=0, high=self.vocab_size - 1, shape=(*self.batch_size, self.num_agents, self.reply_tokens),
            dtype=torch.int64, device=self.device,
        )

    # ------------------------------------------------------------ the game
    def _new_state(self, num_episodes: int) -> TensorDict:
        drawn = torch.randint(0, len(self.split_indices), (num_episodes,), generator=self.rng)
        return self.new_state(self.split_indices[drawn])

    def new_state(self, index: torch.Tensor) -> TensorDict:
        """Fresh conversations on the prompts ``index`` ``(E,)`` (positions in ``prompts``), with no turn played."""
        index = index.to(self.device)
        count, device = index.shape[0], self.device
        return TensorDict(
            {
                "prompt_index": index,
                "utterances": torch.zeros(count, self.turns, self.reply_tokens, dtype=torch.int64, device=device),
                "utterance_length": torch.full((count, self.turns), -1, dtype=torch.int64, device=device),
                "responses": torch.zeros(count, self.turns, self.response_tokens, dtype=torch.int64, device=device),
                "response_length": torch.full((count, self.turns), -1, dtype=torch.int64, device=device),
                **{name: torch.zeros(count, self.turns, device=device) for name in TURN_VALUES},
            },
            batch_size=[count],
            device=device,
        )

    def conversation(self, state: TensorDictBase, episode: int, turns: int) -> tuple[str, list[str], list[str]]:
        """The prompt, and the texts of the first ``turns`` utterances and responses of ``episode``."""
        decode = self.speaker.tokenizer.decode
        utterances = [
            decode(state["utterances"][episode, turn, : int(state["utterance_length"][episode, turn])].tolist(), skip_special_tokens=True)
            for turn in range(turns)
        ]
        responses = [
            decode(state["responses"][episode, turn, : int(state["response_length"][episode, turn])].tolist(), skip_special_tokens=True)
            for turn in range(turns)
        ]
        return self.prompts[int(state["prompt_index"][episode])], utterances, responses

    def _advance(self, state: TensorDictBase, action: torch.Tensor, active: torch.Tensor):
        batch = action.shape[0]
        turn = state["round"].clamp(max=self.turns - 1)
        texts = reply_texts(action, active, [self.speaker])
        utterances = [texts.get((row, 0), "") for row in range(batch)]
        history = [self.conversation(state, row, int(turn[row])) for row in range(batch)]
        chats = [target_chat(self.target_system_prompt, prompt, [*said, utterance], answered)
                 for (prompt, said, answered), utterance in zip(history, utterances)]
        responses = self.target.reply(chats, int(torch.randint(0, 2**31 - 1, (1,), generator=self.rng)))
        scores = self.scorer([*utterances, *responses, *(f"{u}\n{r}" for u, r in zip(utterances, responses))]).view(3, batch)
        if self.target.has_likelihood:
            contexts = [conversation_text(prompt, said, answered) for prompt, said, answered in history]
            likelihood = self.target.likelihood(contexts, utterances).float()
        else:
            likelihood = torch.zeros(batch)
        values = {
            "utterance_score": scores[0], "response_score": scores[1], "combined_score": scores[2], "likelihood": likelihood,
            "turn_reward": turn_reward(likelihood, scores[2], scores[1], self.weights),
        }
        rows = torch.arange(batch, device=self.device)
        acted = active[:, 0]
        encoded = self.speaker.encode(responses)
        response_rows = [encoded[text][: self.response_tokens] for text in responses]
        response_ids, _ = packed_rows(response_rows, self.response_tokens, self.speaker.pad_id, left=False)
        written = {
            "utterances": action[:, 0],
            "utterance_length": reply_lengths(action, [self.speaker])[:, 0],
            "responses": response_ids.to(self.device),
            "response_length": torch.tensor([len(row) for row in response_rows], device=self.device),
            **{name: value.to(self.device) for name, value in values.items()},
        }
        for name, value in written.items():
            entry = state[name].clone()
            mask = acted.view(-1, *([1] * (value.dim() - 1)))
            entry[rows, turn] = torch.where(mask, value.to(entry.dtype), entry[rows, turn])
            state[name] = entry
        reward = torch.where(acted, values["turn_reward"].to(self.device), torch.zeros(batch, device=self.device)).unsqueeze(-1)
        if self.branching and self.group_size > 1:
            state = self.branch(state, turn)
        return state, reward, torch.zeros(batch, dtype=torch.bool, device=self.device)

    def branch(self, state: TensorDictBase, turn: torch.Tensor) -> TensorDictBase:
        """Before the next turn, every sibling of a tree continues from one of them, drawn uniformly (see the module docstring).

        A block of ``group_size`` environments is a tree when its episodes share
        their group id and turn; the last turn of a conversation is not copied.
        """
        width = self.group_size
        blocks = state["group_id"].view(-1, width)
        turns = turn.view(-1, width)
        tree = (blocks == blocks[:, :1]).all(-1) & (turns == turns[:, :1]).all(-1) & (turns[:, 0] < self.turns - 1)
        chosen = torch.randint(0, width, (blocks.shape[0],), generator=self.rng).to(self.device)
        source = torch.arange(state.batch_size[0], device=self.device).view(-1, width)
        source = torch.where(tree.unsqueeze(-1), (source[:, :1] + chosen.unsqueeze(-1)).expand(-1, width), source).reshape(-1)
        for name in ("utterances", "utterance_length", "responses", "response_length", *TURN_VALUES):
            state[name] = state[name][source]
        return state

    def _policy_inputs(self, state: TensorDictBase) -> dict[str, torch.Tensor]:
        with cyclic_gc_paused():
            batch = state.batch_size[0]
            utterances, utterance_length = as_lists(state["utterances"]), as_lists(state["utterance_length"])
            responses, response_length = as_lists(state["responses"]), as_lists(state["response_length"])
            texts, quotes = [], []
            for episode, index in enumerate(as_lists(state["prompt_index"])):
                texts.append(self.prompts[index])
                lines = []
                for turn in range(self.turns - 1):  # the last turn is never read: the conversation is over
                    if utterance_length[episode][turn] < 0:
                        break
                    lines.append((AUDITOR_LABEL, utterances[episode][turn][: utterance_length[episode][turn]]))
                    lines.append((TARGET_LABEL, responses[episode][turn][: response_length[episode][turn]]))
                quotes.append(lines)
            prompts = self.speaker.render_many(texts, quotes) if batch else []
        longest = max((len(prompt) for prompt in prompts), default=0)
        if longest > self.prompt_length:
            raise RuntimeError(
                f"the auditor's prompt has {longest} tokens, more than the prompt width {self.prompt_length}: raise scenario.max_prompt_tokens"
            )
        ids, mask = packed_rows(prompts, self.prompt_length, self.speaker.pad_id, left=True)
        return {"prompt_ids": ids.unsqueeze(1).to(self.device), "prompt_mask": mask.unsqueeze(1).to(self.device)}
