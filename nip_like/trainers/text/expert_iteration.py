"""Expert iteration for text agents: fine-tune each agent on its own successful turns."""

from __future__ import annotations

import random
from dataclasses import dataclass

from tensordict import TensorDict

from nip_like.allowed import checked
from nip_like.checkpoint import derive_seed
from nip_like.registry import register_trainer
from nip_like.text.fine_tune import FineTuneSpec
from nip_like.trainers.text.fine_tune_jobs import sft_record
from nip_like.trainers.text.pure_text import PureTextRlTrainer

SELECTIONS = ("threshold", "sample")


@dataclass
class ExpertIterationConfig:
    """Options of expert iteration (``trainer.objective``); its loop's are ``trainer.*`` (:class:`~nip_like.config.TextTrainerConfig`)."""

    selection: str = checked("threshold", choices=SELECTIONS)  # threshold: keep turns whose episode return >= reward_threshold | sample: keep each with probability rising linearly with its return
    reward_threshold: float = checked(0.5)  # threshold: the least episode return (the agent's own) a kept turn has
    label_replacement: float = checked(1.0, ge=0, le=1)  # share of the verifier's decisions replaced by the true label (kept as correct)
    anneal_replacement: bool = True  # the share falls linearly to 0 over the iterations


@register_trainer("expert_iteration", objective=ExpertIterationConfig)
class ExpertIterationTrainer(PureTextRlTrainer):
    """Keep each agent's turns from episodes it did well in, and SFT its model on them.

    With ``label_replacement``, a share of the verifier's decisions are first
    replaced by the true label (``accept`` when the list holds a pair), so the
    verifier also learns from episodes it got wrong; the share falls to 0 over
    the iterations with ``anneal_replacement``.
    """

    def replacement_share(self) -> float:
        """The share of verifier decisions replaced by the label at this iteration."""
        share = float(self.options.label_replacement)
        if self.options.anneal_replacement and self.num_iterations > 1:
            share *= 1 - self.state.iteration / (self.num_iterations - 1)
        return share

    def _stage_create_fine_tune_jobs(self, rollouts: TensorDict) -> dict[str, FineTuneSpec]:
        rng = random.Random(derive_seed(self.seed, f"expert_iteration:{self.state.iteration}"))
        share = self.replacement_share()
        turns = self.turns_by_agent(rollouts)
        returns = [turn["return"] for turn in turns]
        low, high = min(returns), max(returns)
        kept: dict[str, list[dict]] = {group: [] for group in self.scenario.group_names()}
        verifier = self.scenario.agent_names[self.scenario.protocol.verifier_index]
        # The verifier's last turn of each episode is where it had to decide.
        deciding = {}
        for index, turn in enumerate(turns):
            if turn["agent"] == verifier:
                deciding[turn["episode"]] = index
        deciding = set(deciding.values())
        for index, turn in enumerate(turns):
            if index in deciding and rng.random() < share:
                kept[turn["group"]].append(sft_record(turn, self.scenario.accept_word if turn["label"] else self.scenario.reject_word))
                continue
            if self.options.selection == "threshold":
                keep = turn["return"] >= float(self.options.reward_threshold)
            else:
                keep = high > low and rng.random() < (turn["return"] - low) / (high - low)
            if keep:
                kept[turn["group"]].append(sft_record(turn))
        name = f"iteration_{self.state.iteration:04d}"
        return {
            group: self.job_spec(group, "sft", self.write_dataset(f"{name}_{group}", records))
            for group, records in kept.items()
            if records
        }
