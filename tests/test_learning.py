"""Learning claims, checked by training with a fixed seed (slow)."""

import json
from pathlib import Path

import pytest
import yaml

from nip_like.config import CONFIG_DIR
from nip_like.experiment import run_experiment
from nip_like.registry import TRAINERS
from nip_like.trainers import TensorDictRlTrainer
from tests.conftest import make_config

QUIET = ("run.progress_bar=false", "logger=none", "run.num_threads=1")


def _trainer_type(option: str) -> str:
    """The ``trainer_type`` of trainer option ``option``: its file's own, or that of the option it extends.

    Read from the YAML (its ``defaults`` name the option it extends) rather than composed, so that
    collecting this module does not compose a config per option (seconds on every pytest worker).
    """
    data = yaml.safe_load((CONFIG_DIR / "trainer" / f"{option}.yaml").read_text())
    if "trainer_type" in data:
        return str(data["trainer_type"])
    parents = [entry for entry in data.get("defaults", []) if isinstance(entry, str) and (CONFIG_DIR / "trainer" / f"{entry}.yaml").is_file()]
    assert parents, f"trainer option {option} names no trainer_type and extends no other option"
    return _trainer_type(parents[0])


def _rl_trainer_options() -> list[str]:
    """Every trainer option (``configs/trainer/*.yaml``) of an RL objective, but REINFORCE (its own bar below)."""
    options = []
    for path in sorted((CONFIG_DIR / "trainer").glob("*.yaml")):
        trainer_type = _trainer_type(path.stem)
        if issubclass(TRAINERS.get(trainer_type), TensorDictRlTrainer) and trainer_type != "reinforce":
            options.append(path.stem)
    return options


#: Training iterations of the hidden-bits runs below, by trainer option: where seed 0 reaches the optimum
#: (the deterministic validation accuracy 1.0, kept to the run's end) plus at least 8 iterations or a third more,
#: instead of the option's whole run. Measured 2026-12-02 with evaluation after every iteration (evaluation forks
#: the generators, so it does not change the run); before reaching it, each sat at 0.75 or below (a string sharing
#: a message). The constant learning rate makes a shorter run the same run cut short. An option not named here (a
#: new one) runs its configured length. One option a line: the first iteration at 1.0, of the configured run.
HIDDEN_BITS_ITERATIONS = {
    "ppo": 25,  # 17 of 40
    "ppo_kl": 20,  # 12 of 40
    "grpo": 23,  # 15 of 40
    "dpo": 50,  # 37 of 100
    "ipo": 40,  # 29 of 100
    "pspg": 32,  # 24 of 40
    "psos": 36,  # 27 of 40
    "lola": 31,  # 23 of 40
}


@pytest.mark.slow
@pytest.mark.parametrize("trainer", _rl_trainer_options())
def test_trainer_reaches_95_percent_of_the_optimum_on_hidden_bits(tmp_path, trainer):
    # No periodic evaluation: the test loop plays the final agents (trainer.eval.test_checkpoint=final), so the
    # evaluations only cost time.
    shortened = [f"trainer.num_iterations={HIDDEN_BITS_ITERATIONS[trainer]}"] if trainer in HIDDEN_BITS_ITERATIONS else []
    metrics = run_experiment(make_config(f"trainer={trainer}", "seed=0", "trainer.eval.every=0", *shortened, *QUIET), tmp_path)
    # Both agents share the verifier's reward; the optimum is 1 for 2 bits over 2 rounds of 4 symbols.
    assert metrics["test/agents/verifier/optimality"] >= 0.95, metrics
    assert metrics["test/agents/prover/optimality"] >= 0.95, metrics


@pytest.mark.slow
def test_solo_verifier_cannot_beat_guessing(tmp_path):
    metrics = run_experiment(make_config("protocol=solo_verifier", "trainer.num_iterations=10", *QUIET), tmp_path)
    assert metrics["test/accuracy"] < 0.35


@pytest.mark.slow
def test_reinforce_with_baseline_clears_the_local_optimum_bar(tmp_path):
    # REINFORCE often settles at 0.75 (two strings share a message); 0.7 is far above chance (0.25).
    metrics = run_experiment(make_config("trainer=reinforce", "seed=0", *QUIET), tmp_path)
    assert metrics["test/agents/verifier/optimality"] >= 0.7, metrics


@pytest.mark.slow
def test_documented_simpo_example_solves_hidden_bits(tmp_path, monkeypatch):
    # docs/new_trainer.rst: the SimPO example on the DPO config reaches 1.0 with seed 0. It does from iteration 48
    # of the config's 100 on (its deterministic validation accuracy, kept to the end; 0.77 or below before;
    # 2026-12-02), so the test runs 64 (a third more), without periodic evaluation (the test plays the final agents).
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "docs" / "examples"))
    shortened = ("trainer.num_iterations=64", "trainer.eval.every=0")
    config = make_config("trainer=dpo", "trainer.trainer_type=simpo_trainer.SimpoTrainer", "seed=0", *shortened, *QUIET)
    metrics = run_experiment(config, tmp_path)
    assert metrics["test/agents/verifier/optimality"] >= 0.95, metrics


@pytest.mark.slow
def test_main_job_verifier_decides_graph_isomorphism_with_the_prover(tmp_path):
    # The main job (graph isomorphism, NIP, PPO after the warm start on honest play), shortened to 3
    # of its 100 iterations, without periodic evaluation (the test plays the final agents, so evaluating only
    # costs time) and tested on its final agents. The warm start does most of the work: seed 0 reaches test
    # accuracy 0.901 with 0.953 faithful answers after 3 iterations (0.898 and 0.934 after 2, 0.894 and 0.934
    # after 4, 0.946 and 0.988 after 10; validation accuracy 0.92 after the first; 2026-12-02), 0.05 above
    # the bar (about 5 standard errors); the 7 iterations and the evaluation left out were about 16 CPU
    # seconds (2 an iteration). The recipe before the warm start reached
    # 0.685 after all 150 iterations with this seed (docs: graph_isomorphism, "Time to result");
    # 1024 test episodes give a standard error of about 0.01. The verifier alone reaches about 0.70.
    # One warm-start fit per agent instead of the preset's best of three: on seed 0 the first fit is the one
    # kept (the same test metrics, 0.946 and 0.988 faithful answers, either way; 2026-11-27), so the other
    # two would only spend CI time (the restarts have their own test in test_gi_scenario.py).
    config = make_config(
        "preset=quick", "trainer.num_iterations=3", "trainer.eval.every=0", "trainer.eval.test_checkpoint=final", "trainer.pretrain.restarts=1",
        f"scenario.cache_dir={tmp_path / 'cache'}", f"trainer.pretrain.cache_dir={tmp_path / 'pretrained'}", *QUIET,
    )
    metrics = run_experiment(config, tmp_path / "run")
    assert metrics["test/accuracy"] >= 0.85, metrics
    assert metrics["test/agents/prover/faithful_answers"] >= 0.8, metrics


@pytest.mark.slow
def test_lm_agents_nip_verifier_beats_the_solo_verifier(tmp_path):
    # Language-model agents on the duplicates task: the lm_quick preset from empty caches (docs: duplicates,
    # Results), NIP for 2 of its 8 iterations, without its periodic evaluation (the test plays the final
    # agents, so evaluating only costs time) and with 3 of the verifier's 5 warm-start epochs (the verifier's fit
    # was 70% of the warm start's time): the warm start already decides almost every list. Seed 0,
    # 2026-12-02: 0.977 so shortened (0.964 with all 5 epochs and 2 iterations, 0.976 with the whole preset;
    # validation accuracy 0.98 after the first iteration), against the 0.9 asked for (1024 test episodes: a
    # standard error of about 0.005), 0.445 above the solo verifier against the 0.35 asked for. One warm-start
    # epoch is too few (0.462: the verifier accepts every list). The whole preset's NIP run took 129 CPU
    # seconds. Alone the verifier sees no cell, so it cannot beat the majority
    # label (half the lists); with the prover's certificate it decides almost always right. The solo
    # verifier rejects every list from its warm start on (docs: duplicates, Results), so its accuracy is the
    # test split's share of negatives however long it trains or fits: it fits one epoch of its warm start's
    # five and trains 2 of the 8 iterations, tested on its final weights (0.532 either way, seed 0,
    # 2026-11-27: 8 s instead of 38).
    common = ["preset=lm_quick", f"scenario.cache_dir={tmp_path / 'data'}", f"trainer.pretrain.cache_dir={tmp_path / 'warm'}", *QUIET]
    nip = run_experiment(make_config(*common, "trainer.num_iterations=2", "trainer.eval.every=0", "trainer.pretrain.agent_epochs.verifier=3"), tmp_path / "nip")
    short = ("trainer.pretrain.agent_epochs.verifier=1", "trainer.num_iterations=2", "trainer.eval.every=0", "trainer.eval.test_checkpoint=final")
    solo = run_experiment(make_config(*common, "protocol=solo_verifier", *short), tmp_path / "solo")
    assert nip["test/accuracy"] >= 0.9, nip
    assert solo["test/accuracy"] <= 0.56, solo
    assert nip["test/accuracy"] - solo["test/accuracy"] >= 0.35, (nip, solo)


@pytest.mark.slow
def test_text_agents_expert_iteration_improves_the_verifier_on_held_out_lists(tmp_path):
    # The text_quick recipe (docs: text_trainers, Results), with 3 iterations instead of 6: the verifier,
    # a tiny character-level model warm-started on a little honest play, gets better at deciding from
    # the scripted prover's certificate on the test split, iteration after iteration.
    overrides = ["preset=text_quick", "trainer.num_iterations=3", f"scenario.cache_dir={tmp_path / 'data'}", *QUIET]
    run_dir = tmp_path / "run"
    metrics = run_experiment(make_config(*overrides), run_dir)
    tests = sorted((run_dir / "tests").glob("iteration_*.json"))
    curve = [json.loads(path.read_text())["accuracy"] for path in tests]
    assert len(curve) == 3
    assert curve[-1] >= curve[0] + 0.05, curve
    assert metrics["test/accuracy"] >= 0.85, curve
