"""The fair solo baseline: a verifier without a prover that may open cells itself before deciding."""

from __future__ import annotations

import pytest
import torch

from nip_like.errors import ConfigError
from nip_like.experiment import build_trainer
from nip_like.registry import PROTOCOLS
from nip_like.scenarios.duplicates.data import solo_verifier_accuracy
from tests.conftest import smoke_config
from tests.test_duplicates_scenario import TINY_AGENT, scenario_for


def opening_config(tmp_path, *overrides: str):
    """Tiny LM agents on the duplicates game under ``solo_opening``."""
    return smoke_config(
        "scenario=duplicates", "protocol=solo_opening", f"scenario.cache_dir={tmp_path / 'data'}", "scenario.num_lists=200",
        *[f"scenario.default_agent.{key}={value}" for key, value in TINY_AGENT.items()], *overrides,
    )


def test_the_verifier_acts_alone_for_opens_plus_one_steps_and_may_decide_at_each():
    protocol = PROTOCOLS.get("solo_opening")("solo_opening", opens=3)
    assert protocol.agent_names == ("verifier",) and protocol.num_rounds == 4
    rounds = torch.arange(4)
    assert bool(protocol.active_agents(rounds).all()) and bool(protocol.may_decide(rounds).all())
    assert protocol.decision_round(rounds).tolist() == [False, False, False, True]
    assert protocol.leader_order is None


def test_the_scripted_verifier_opens_a_pair_and_decides_on_what_it_saw(tmp_path):
    scenario = scenario_for("solo_opening", tmp_path, opens=1)
    demonstrations = scenario.demonstrations("train")["verifier"]
    tokenizer = scenario.tokenizer
    lists = scenario.split("train")
    count = len(lists)
    assert demonstrations.batch_size[0] == 2 * count  # an opening and a decision per list
    decisions = demonstrations[count:]  # the second step of every list, in list order
    correct = 0
    for row in range(count):
        prompt = tokenizer.convert_ids_to_tokens(decisions["prompt_ids"][row][decisions["prompt_mask"][row]].tolist())
        seen = [token for token in prompt[1 : 1 + 2 * scenario.symbols.length][1::2] if token != "?"]
        assert len(seen) == 2  # the two cells it opened itself
        decision = tokenizer.convert_ids_to_tokens(decisions["tokens"][row][:1].tolist())[0]
        assert decision == ("accept" if seen[0] == seen[1] else "reject")  # sound: accepts only a pair it saw
        correct += (decision == "accept") == bool(lists.label[row])
    # What opening a random pair is worth: the closed form of a verifier that sees two random cells.
    assert correct / count == pytest.approx(solo_verifier_accuracy(scenario.symbols.length, 2), abs=0.03)


@pytest.mark.slow
def test_a_run_with_the_opening_verifier_trains_and_bad_opens_are_one_line(tmp_path):
    trainer = build_trainer(opening_config(tmp_path, "protocol.opens=2"), tmp_path / "run")
    assert trainer.scenario.protocol.num_rounds == 3
    metrics = trainer.train()
    assert 0.0 <= metrics["test/accuracy"] <= 1.0
    with pytest.raises(ConfigError, match="protocol.opens must be >= 1"):
        build_trainer(opening_config(tmp_path, "protocol.opens=0"), tmp_path / "bad")
