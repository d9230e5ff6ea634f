"""MALT-style training of text agents: DPO on good and bad siblings of a tree of replies."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from tensordict import TensorDict

from nip_like.allowed import checked
from nip_like.registry import register_trainer
from nip_like.text.fine_tune import FineTuneSpec
from nip_like.trainers.text.pure_text import PureTextRlTrainer


@dataclass
class MaltConfig:
    """Options of MALT-style training (``trainer.objective``); its loop's are ``trainer.*`` (:class:`~nip_like.config.TextTrainerConfig`)."""

    branching: int = checked(3, ge=2)  # replies sampled at every node of the tree (k); a list has k**rounds leaves
    min_value_gap: float = checked(0.0, ge=0)  # a pair needs its chosen sibling's value above the rejected one's by more than this


@register_trainer("malt", objective=MaltConfig)
class MaltTrainer(PureTextRlTrainer):
    """Sample a tree of replies per list, value each node by its leaves, DPO on the best and worst sibling.

    Each list of the train split is played as a tree: every round, every
    acting agent samples ``branching`` replies at each node, and each is played
    on to the end (:func:`~nip_like.text.rollouts.play_episodes` with
    ``branching``). A node's value, for the agent that made it, is the mean of
    that agent's returns over the leaves below it. Under each parent, the
    agent's best and worst sibling make a preference pair (when their replies
    differ and their values by more than ``min_value_gap``), and each group is
    fine-tuned by DPO on its agents' pairs (``trainer.fine_tune``:
    beta, loss type).
    """

    @property
    def branching(self) -> int:
        return int(self.options.branching)

    def _stage_create_fine_tune_jobs(self, rollouts: TensorDict) -> dict[str, FineTuneSpec]:
        rounds = self.scenario.protocol.num_rounds
        leaves = self.branching**rounds
        # node (agent, list, round, index of the node among the round's nodes) -> (chat, reply, leaf returns)
        nodes: dict[tuple, dict] = {}
        for turn in self.turns_by_agent(rollouts):
            tree, leaf = divmod(turn["episode"], leaves)
            node = leaf // self.branching ** (rounds - turn["round"] - 1)
            entry = nodes.setdefault(
                (turn["agent"], tree, turn["round"], node), {"chat": turn["chat"], "reply": turn["reply"], "returns": []}
            )
            entry["returns"].append(turn["return"])
        siblings: dict[tuple, list[dict]] = defaultdict(list)
        for (agent, tree, round_index, node), entry in nodes.items():
            entry["value"] = sum(entry["returns"]) / len(entry["returns"])
            siblings[(agent, tree, round_index, node // self.branching)].append(entry)
        pairs: dict[str, list[dict]] = {group: [] for group in self.scenario.group_names()}
        groups = self.scenario.groups()
        for (agent, *_), children in siblings.items():
            best = max(children, key=lambda entry: entry["value"])
            worst = min(children, key=lambda entry: entry["value"])
            if best["value"] - worst["value"] > float(self.options.min_value_gap) and best["reply"] != worst["reply"]:
                pairs[groups[agent]].append(
                    {
                        "prompt": best["chat"],
                        "chosen": [{"role": "assistant", "content": best["reply"]}],
                        "rejected": [{"role": "assistant", "content": worst["reply"]}],
                    }
                )
        name = f"iteration_{self.state.iteration:04d}"
        return {
            group: self.job_spec(group, "dpo", self.write_dataset(f"{name}_{group}", records))
            for group, records in pairs.items()
            if records
        }
