"""``scenario.shared_base=true`` beside frozen co-players: refused in one line when it would share nothing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from nip_like.errors import ConfigError
from nip_like.validation import shared_base_problems, validate
from tests.test_lm_chat import chat_config

FROZEN_VERIFIER = "+scenario.agents.verifier={frozen_from: /runs/earlier, max_new_tokens: 12}"


@pytest.mark.slow  # a config composed and validated: about a second on a quiet machine
def test_a_shared_base_that_frozen_co_players_leave_unshared_is_refused_before_any_work(tmp_path):
    config = chat_config(None, tmp_path, "scenario.default_agent.lora.r=4", "scenario.shared_base=true", FROZEN_VERIFIER)
    with pytest.raises(ConfigError) as error:
        validate(config)
    assert str(error.value) == (
        "scenario.shared_base=true shares nothing here: the frozen co-player verifier keeps the model of the run it "
        "comes from (frozen_from), leaving prover no agent to share its base with; drop scenario.shared_base"
    )


def game(names: tuple[str, ...], frozen: tuple[str, ...], shared_base: bool = True) -> SimpleNamespace:
    """A stand-in scenario: its agents' names and a config with ``shared_base`` and the frozen ones under ``agents``."""
    config = OmegaConf.create(
        {
            "shared_base": shared_base,
            "default_agent": {"lora": {"r": 4}, "frozen_from": None},
            "agents": {name: {"lora": {"r": 0}, "frozen_from": f"/runs/{name}"} for name in frozen},
        }
    )
    return SimpleNamespace(config=config, agent_names=names)


def test_frozen_co_players_beside_agents_that_share_are_accepted_and_several_are_named():
    assert not shared_base_problems(game(("prover", "verifier"), frozen=()))  # no frozen co-player: both share
    assert not shared_base_problems(game(("prover", "verifier"), frozen=("verifier",), shared_base=False))
    assert not shared_base_problems(game(("prover0", "prover1", "verifier"), frozen=("verifier",)))
    (line,) = shared_base_problems(game(("prover0", "prover1", "verifier"), frozen=("prover0", "prover1")))
    assert line.startswith("scenario.shared_base=true shares nothing here: the frozen co-players prover0, prover1 keep")
    assert "leaving verifier no agent to share its base with" in line
