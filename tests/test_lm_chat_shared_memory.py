"""scripts/lm_chat_shared_memory.py: the held bytes of lm_chat's agents, shared base against the preset and two copies."""

from __future__ import annotations

import json

import pytest

from tests.script_modules import script_module

#: A small game of the same agents: the sizes of the models, hence the held bytes, are the preset's.
SMALL = ("scenario.num_lists=400", "trainer.num_envs=8", "trainer.frames_per_batch=16", "trainer.minibatch_size=16", "trainer.num_epochs=1")


@pytest.mark.slow
def test_the_shared_base_holds_one_base_and_an_adapter_set_per_agent(tmp_path, monkeypatch, capsys):
    with script_module("lm_chat_shared_memory") as script:
        monkeypatch.setattr(script, "GAMES", {name: (*overrides, *SMALL) for name, overrides in script.GAMES.items()})
        results = script.main(["--cache-dir", str(tmp_path / "cache"), "--output", str(tmp_path / "held.json")])
    assert json.loads((tmp_path / "held.json").read_text()) == results
    preset, copies, shared = results["preset"], results["copies"], results["shared"]
    # Two copies of the prover's shape hold its base twice; the shared game once, with the same adapters and state.
    assert copies["frozen"] == 2 * shared["frozen"]
    assert copies["trained"] == shared["trained"] and copies["optimizer"] == shared["optimizer"]
    assert shared["total"] < preset["total"] < copies["total"]
    assert results["ratios"]["shared_over_copies"] == pytest.approx(shared["total"] / copies["total"])
    assert "shared / copies" in capsys.readouterr().out
