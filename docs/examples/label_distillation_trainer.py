"""A text trainer in a file of your own: fine-tune the verifier on the true labels of its own rollouts.

Every iteration, the verifier's decision turns are taken with the correct decision
(accept when the list holds a duplicate pair) as the reply, and its model is
fine-tuned on them (SFT); the provers are left as they are. A baseline for expert
iteration: what the verifier learns from labels alone, on the chats it really sees.

    python -m nip_like preset=text_quick trainer.trainer_type=label_distillation_trainer.LabelDistillationTrainer
"""

from __future__ import annotations

from tensordict import TensorDict

from nip_like.text.fine_tune import FineTuneSpec
from nip_like.trainers.text import PureTextRlTrainer, sft_record


class LabelDistillationTrainer(PureTextRlTrainer):
    """SFT the verifier's group on its decision turns, with the label as the reply."""

    def _stage_create_fine_tune_jobs(self, rollouts: TensorDict) -> dict[str, FineTuneSpec]:
        verifier = self.scenario.agent_names[self.scenario.protocol.verifier_index]
        group = self.scenario.groups()[verifier]
        last_turn = {}  # the verifier's last turn of each episode is its decision
        for turn in self.turns_by_agent(rollouts):
            if turn["agent"] == verifier:
                last_turn[turn["episode"]] = turn
        words = {True: self.scenario.accept_word, False: self.scenario.reject_word}  # the scenario's, not ours
        records = [sft_record(turn, words[bool(turn["label"])]) for turn in last_turn.values()]
        dataset = self.write_dataset(f"iteration_{self.state.iteration:04d}_{group}", records)
        return {group: self.job_spec(group, "sft", dataset)}
